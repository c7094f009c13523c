"""Checkpoints given as URIs are copied once per node into a local cache before a replica loads them.

The copy goes to `<cache>/<key>.tmp-<pid>` and is renamed to `<cache>/<key>` when complete, under an flock on
`<cache>/<key>.lock`: one process per node downloads, the others wait and reuse it, and none ever loads a
half-copied folder. The key hashes
the URI and the files' versions, so a changed checkpoint is copied again.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from typing import Any

from clover_batch.connectors.fs import Location, document_version

log = logging.getLogger(__name__)

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "clover-batch", "checkpoints")


def is_uri(source: str) -> bool:
    return "://" in source and not source.startswith("file://")


def local_checkpoint(source: str, storage_options: dict[str, Any] | None = None, cache_dir: str | None = None) -> str:
    """A local path or preset name to load `source` from: URIs are copied into the cache, the rest pass through."""
    if not is_uri(source):
        return source.removeprefix("file://")
    fs, root = Location(source, storage_options or {}).filesystem()
    root = root.rstrip("/")
    files = fs.find(root, detail=True)
    if not files:
        raise FileNotFoundError(f"no checkpoint files under {source}")
    fingerprint = "\n".join(f"{p}:{document_version(i)}" for p, i in sorted(files.items()))
    key = hashlib.sha256(f"{source.rstrip('/')}\n{fingerprint}".encode()).hexdigest()[:24]
    cache = cache_dir or DEFAULT_CACHE
    target = os.path.join(cache, key)
    if os.path.isdir(target):
        return target
    os.makedirs(cache, exist_ok=True)
    # One process per node copies; the others (the tokenize and postprocess workers, other actors) wait for it
    # and reuse the copy instead of each downloading the whole checkpoint.
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(target):
            return target
        return _copy(fs, root, files, source, target)


def _copy(fs, root: str, files: dict, source: str, target: str) -> str:
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for path in files:
        dest = os.path.join(tmp, os.path.relpath(path, root))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fs.get_file(path, dest)
    try:
        os.rename(tmp, target)
        log.info("copied checkpoint %s to %s", source, target)
    except OSError:  # another actor on this node finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target
