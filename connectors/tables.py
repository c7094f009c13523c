"""Documents from a table (`input.table`): Parquet, JSON Lines or CSV files read with pyarrow, or an Iceberg table
read with pyiceberg, one row per document.

Notable choices:
- The table's id column is the document's identity: its output row's `doc_id` is the id as a string, so the output
  joins back to the table on it, and one row per id is what the output keeps (connectors/sink.py for Parquet,
  connectors/iceberg.py for Iceberg).
- A document's `version` says which content its row was made from: `sha256:<hex>` of the text for a text column,
  the file's etag (else mtime and size, connectors/fs.py) for a URI column. A listed id whose row was made from
  another version is run again and its row replaced (jobs/runner.py plan_run): the folder listing gets the same
  from its ids, which hash the URI and the version, so an edited file is simply a new document there.
- The whole table is checked before anything runs, and a problem of the table refuses the job naming the column
  (`TableInputError`, exit 2): a missing column, a null or duplicate id, a text column that is not strings, a null
  URI. A null or empty text is the document's problem: its row gets status `empty`, as an empty file's does.
- Only the two needed columns are read; the texts travel with the pending documents (the folder path reads bytes
  in the workers instead), so a table of texts is held by the driver once, as Arrow strings.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
from clover_batch.connectors.fs import DOCUMENT_SCHEMA, Location, _fsspec_options, document_version
from fsspec.core import url_to_fs

log = logging.getLogger(__name__)

TEXT_DOCUMENT_SCHEMA = pa.schema([*DOCUMENT_SCHEMA, ("text", pa.large_string())])


class TableInputError(ValueError):
    """The input table cannot be used as it is (a missing column, null or duplicate ids, ...): nothing was run."""


@dataclass(frozen=True)
class TableInput:
    """Where a table of documents is and which columns to read (the job's input.table, in plain values)."""

    format: str  # parquet | json | csv | iceberg
    uri: str | None = None  # parquet, json, csv: a file or folder
    identifier: str | None = None  # iceberg: namespace.name
    catalog: dict[str, Any] = field(default_factory=dict)  # iceberg: pyiceberg catalog properties
    id_column: str = "id"
    text_column: str | None = None  # default "text" unless uri_column is given
    uri_column: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options for the files

    @property
    def column(self) -> str:
        return self.uri_column or self.text_column or "text"

    @property
    def source(self) -> str:
        return self.uri or f"iceberg:{self.identifier}"


def text_version(texts: pa.Array) -> list[str | None]:
    """`sha256:<hex>` of each text (None for a null text): what a text row's result was made from."""
    return [None if t is None else "sha256:" + hashlib.sha256(t.encode()).hexdigest()[:32] for t in texts.to_pylist()]


def _read_raw(table: TableInput) -> pa.Table:
    """The id and text/URI columns of the table, as Arrow, after checking that both exist."""
    columns = [table.id_column, table.column]
    if table.format == "iceberg":
        from pyiceberg.catalog import load_catalog

        try:
            props = dict(table.catalog)
            source = load_catalog(props.pop("name", "default"), **props).load_table(table.identifier)
        except Exception as e:
            raise TableInputError(f"input.table {table.identifier}: cannot load it from its catalog: "
                                  f"{type(e).__name__}: {e}") from None
        names = [f.name for f in source.schema().fields]
        _check_columns(table, names)
        return source.scan(selected_fields=tuple(columns)).to_arrow()
    fs, path = url_to_fs(table.uri, **_fsspec_options(table.uri, table.storage_options))
    if not fs.exists(path):
        raise TableInputError(f"input.table.uri {table.uri}: no such file or folder")
    from pyarrow.fs import FSSpecHandler, LocalFileSystem, PyFileSystem

    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    arrow_fs = LocalFileSystem() if local else PyFileSystem(FSSpecHandler(fs))
    try:
        dataset = pads.dataset(path, format=table.format, filesystem=arrow_fs)
        _check_columns(table, dataset.schema.names)
        return dataset.to_table(columns=columns)
    except TableInputError:
        raise
    except (pa.ArrowInvalid, OSError) as e:
        raise TableInputError(f"input.table.uri {table.uri}: cannot be read as {table.format}: {e}") from None


def _check_columns(table: TableInput, names: list[str]) -> None:
    for option, name in (("id_column", table.id_column),
                         ("uri_column" if table.uri_column else "text_column", table.column)):
        if name not in names:
            raise TableInputError(f"input.table.{option} {name!r}: no such column in {table.source} "
                                  f"(its columns: {', '.join(names)})")


def _ids(table: TableInput, column: pa.ChunkedArray) -> pa.Array:
    """The id column as strings, refused when null, duplicated or not a scalar."""
    name = f"input.table.id_column {table.id_column!r}"
    nulls = column.null_count
    if nulls:
        raise TableInputError(f"{name}: {nulls} rows of {table.source} have a null id; every document needs one")
    if not (pa.types.is_integer(column.type) or pa.types.is_string(column.type)
            or pa.types.is_large_string(column.type)):
        raise TableInputError(f"{name}: ids must be strings or integers, the column is {column.type}")
    ids = column.cast(pa.string()).combine_chunks()
    if len(pc.unique(ids)) != len(ids):
        counts = pc.value_counts(ids)
        dup = counts.filter(pc.greater(counts.field("counts"), 1))
        example = dup[0]["values"].as_py()
        raise TableInputError(f"{name}: {len(dup)} ids appear more than once in {table.source} (e.g. {example!r}); "
                              f"the id is the document's identity and must be unique")
    return ids


def read_document_table(table: TableInput) -> pa.Table:
    """The table's documents, sorted by id: DOCUMENT_SCHEMA (doc_id = the id), plus `text` for a text column.

    Raises TableInputError naming the column for a table that cannot be run (module docstring)."""
    raw = _read_raw(table)
    ids = _ids(table, raw.column(table.id_column))
    values = raw.column(table.column).combine_chunks()
    kind = "uri_column" if table.uri_column else "text_column"
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type) or pa.types.is_null(values.type)):
        raise TableInputError(f"input.table.{kind} {table.column!r}: must hold strings, the column is {values.type}")
    values = values.cast(pa.large_string())
    order = pc.sort_indices(ids)
    ids, values = ids.take(order), values.take(order)
    if table.uri_column:
        docs = _uri_documents(table, ids, values)
    else:
        texts = values
        sizes = pc.fill_null(pc.binary_length(texts), 0).cast(pa.int64())
        sources = pc.binary_join_element_wise(table.source, ids, "#")
        docs = pa.table([ids, sources, sizes, pa.array(text_version(texts), pa.string()), texts],
                        schema=TEXT_DOCUMENT_SCHEMA)
    log.info("read %d documents from table %s", docs.num_rows, table.source)
    return docs


def _uri_documents(table: TableInput, ids: pa.Array, uris: pa.Array) -> pa.Table:
    """Rows of a URI column: each file's size and version, as a folder listing finds them."""
    if uris.null_count:
        raise TableInputError(f"input.table.uri_column {table.column!r}: {uris.null_count} rows of {table.source} "
                              f"have a null URI")
    sizes, versions = [], []
    for uri in uris.to_pylist():
        fs, path = url_to_fs(uri, **_fsspec_options(uri, table.storage_options))
        try:
            info = fs.info(path)
            sizes.append(int(info.get("size") or 0))
            versions.append(document_version(info))
        except (FileNotFoundError, PermissionError, ValueError):  # the read stage gives this row its read_error
            sizes.append(0)
            versions.append("missing")
    return pa.table([ids, uris.cast(pa.string()), pa.array(sizes, pa.int64()), pa.array(versions, pa.string())],
                    schema=DOCUMENT_SCHEMA)


def table_location(table: TableInput) -> Location:
    return Location(table.source, table.storage_options)
