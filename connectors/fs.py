"""Listing and reading documents through fsspec.

Notable choices:
- One `Location` (a URI plus fsspec storage_options) names a folder on any fsspec filesystem: local paths, s3://
  (storage_options carry endpoint_url / key / secret, passed to s3fs as `client_kwargs` when needed), gs://,
  az://, memory://. Nothing above this module looks at URI schemes.
- Listing is one recursive `find(detail=True)` call, so object stores answer with their metadata (ETag) for free.
- A document's version is its ETag (or generation / md5) when the store gives one, else mtime + size; its id is a
  hash of URI + version, so an edited file is a new document and an unchanged one keeps its id across runs.
- Include / exclude globs: a pattern with no "/" matches the file name, one with "/" matches the path relative to
  the input folder. Hidden files and folders (leading "." or "_") are skipped.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import posixpath
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import pyarrow as pa
from clover_batch.connectors.faults import document_fault, fault_point
from fsspec.core import url_to_fs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Location:
    """A folder (or file) on some fsspec filesystem."""

    uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """The filesystem and the path of `uri` inside it."""
        return url_to_fs(self.uri, **_fsspec_options(self.uri, self.storage_options))

    def join(self, *parts: str) -> str:
        """The URI of `parts` under this location (a plain string join, valid for every scheme)."""
        return "/".join([self.uri.rstrip("/"), *parts])


def _fsspec_options(uri: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """s3fs wants endpoint_url / region_name inside client_kwargs; accept them at the top level too."""
    options = dict(storage_options)
    if uri.startswith(("s3://", "s3a://")):
        client_kwargs = dict(options.pop("client_kwargs", {}) or {})
        for key in ("endpoint_url", "region_name"):
            if key in options:
                client_kwargs[key] = options.pop(key)
        if client_kwargs:
            options["client_kwargs"] = client_kwargs
    return options


@dataclass(frozen=True)
class DocumentRef:
    """One listed document: where it is, which version, and its stable id."""

    doc_id: str  # sha256(uri + "\n" + version), 32 hex chars
    source_uri: str  # full URI, scheme included
    size: int  # bytes
    version: str  # etag, or "mtime-size"

    def to_row(self) -> dict[str, Any]:
        return asdict(self)


def document_id(uri: str, version: str) -> str:
    """Stable id of one version of one document."""
    return hashlib.sha256(f"{uri}\n{version}".encode()).hexdigest()[:32]


def document_version(info: dict[str, Any]) -> str:
    """ETag-like content version when the store has one, else modification time and size."""
    for key in ("ETag", "etag", "generation", "md5Hash", "content_md5"):
        value = info.get(key)
        if value:
            return str(value).strip('"')
    size = info.get("size", 0)
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is not None:
            stamp = value.timestamp() if hasattr(value, "timestamp") else float(value)
            return f"{stamp:.6f}-{size}"
    raise ValueError(f"filesystem gives neither an etag nor a modification time for {info.get('name')}")


def matches(relative_path: str, include: list[str], exclude: list[str]) -> bool:
    """Whether a path (relative to the input folder) passes the include and exclude globs."""
    parts = relative_path.split("/")
    if any(p.startswith((".", "_")) for p in parts):
        return False

    def hit(pattern: str) -> bool:
        target = relative_path if "/" in pattern else parts[-1]
        return fnmatch.fnmatchcase(target, pattern)

    return any(hit(p) for p in include) and not any(hit(p) for p in exclude)


DOCUMENT_SCHEMA = pa.schema(
    [("doc_id", pa.string()), ("source_uri", pa.string()), ("size", pa.int64()), ("version", pa.string())]
)


def list_document_table(location: Location, include: list[str], exclude: list[str]) -> pa.Table:
    """All documents under `location` passing the globs, sorted by URI, as an Arrow table (DOCUMENT_SCHEMA).

    Columns rather than one object per document: a million listed documents take ~150 MB as Arrow strings, and the
    pending set is one vectorised filter against the done ids (jobs/runner.py).
    """
    fs, root = location.filesystem()
    root = root.rstrip("/")
    fs.invalidate_cache()  # a scheduled re-run in the same process must see new files
    if "file" in fs.protocol and not fs.exists(root):
        # A missing local folder is a typo; an empty object-store prefix is just "nothing new yet".
        raise FileNotFoundError(f"input folder {location.uri} does not exist")
    if fs.isfile(root):
        infos = {root: fs.info(root)}
        base = posixpath.dirname(root)
    else:
        infos = fs.find(root, detail=True, withdirs=False)
        base = root
    fault_point("listing")
    protocol = location.uri.split("://", 1)[0] + "://" if "://" in location.uri else ""
    columns: dict[str, list] = {name: [] for name in DOCUMENT_SCHEMA.names}
    for path in sorted(infos):
        info = infos.pop(path)  # free each listing entry as it is turned into columns
        if info.get("type", "file") != "file":
            continue
        relative = path[len(base) :].lstrip("/")
        if not matches(relative, include, exclude):
            continue
        uri = protocol + path if protocol else path
        version = document_version(info)
        columns["doc_id"].append(document_id(uri, version))
        columns["source_uri"].append(uri)
        columns["size"].append(int(info.get("size") or 0))
        columns["version"].append(version)
    table = pa.table(columns, schema=DOCUMENT_SCHEMA)
    log.info("listed %d documents under %s", table.num_rows, location.uri)
    return table


def list_documents(location: Location, include: list[str], exclude: list[str]) -> list[DocumentRef]:
    """All documents under `location` passing the globs, sorted by URI (see `list_document_table`)."""
    return [DocumentRef(**row) for row in list_document_table(location, include, exclude).to_pylist()]


def read_bytes(uri: str, storage_options: dict[str, Any], max_bytes: int | None = None) -> bytes:
    """The bytes of one document; raises ValueError past `max_bytes` without reading them all."""
    document_fault("read_denied", uri)
    fs, path = url_to_fs(uri, **_fsspec_options(uri, storage_options))
    with fs.open(path, "rb") as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"file is larger than max_file_bytes={max_bytes}")
    return data
