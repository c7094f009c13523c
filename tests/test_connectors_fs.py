"""Listing and reading through fsspec: local, memory:// and a real S3-protocol server; versions and doc ids."""

from __future__ import annotations

import os
import time

import fsspec
import pytest
from clover_batch.connectors.fs import Location, document_id, list_documents, matches, read_bytes


def _tree(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.pdf").write_bytes(b"%PDF a")
    (root / "b.txt").write_text("bee")
    (root / "sub" / "c.txt").write_text("sea")
    (root / "sub" / "d.md").write_text("# dee")
    (root / ".hidden.txt").write_text("x")
    (root / "_tmp").mkdir()
    (root / "_tmp" / "e.txt").write_text("x")


@pytest.mark.parametrize(
    ("path", "include", "exclude", "expected"),
    [
        ("a.pdf", ["*"], [], True),
        ("sub/c.txt", ["*.txt"], [], True),
        ("sub/c.txt", ["sub/*"], [], True),
        ("sub/c.txt", ["other/*"], [], False),
        ("sub/c.txt", ["*.txt"], ["sub/*"], False),
        (".hidden.txt", ["*"], [], False),
        ("_tmp/e.txt", ["*"], [], False),
    ],
)
def test_globs(path, include, exclude, expected):
    assert matches(path, include, exclude) is expected


def test_local_listing_with_globs_sizes_and_stable_ids(tmp_path):
    _tree(tmp_path)
    docs = list_documents(Location(str(tmp_path)), ["*.txt", "*.md"], ["d.*"])
    assert [os.path.relpath(d.source_uri, tmp_path) for d in docs] == ["b.txt", "sub/c.txt"]
    assert [d.size for d in docs] == [3, 3]
    again = list_documents(Location(str(tmp_path) + "/"), ["*.txt", "*.md"], ["d.*"])
    assert [d.doc_id for d in again] == [d.doc_id for d in docs]
    assert len({d.doc_id for d in docs}) == 2


def test_editing_a_file_changes_version_and_id(tmp_path):
    _tree(tmp_path)
    before = {d.source_uri: d for d in list_documents(Location(str(tmp_path)), ["*"], [])}
    time.sleep(0.01)
    (tmp_path / "b.txt").write_text("bee, edited")
    after = {d.source_uri: d for d in list_documents(Location(str(tmp_path)), ["*"], [])}
    b = str(tmp_path / "b.txt")
    assert after[b].version != before[b].version
    assert after[b].doc_id != before[b].doc_id
    a = str(tmp_path / "a.pdf")
    assert after[a].doc_id == before[a].doc_id == document_id(a, before[a].version)


def test_memory_filesystem():
    fs = fsspec.filesystem("memory")
    fs.pipe({"/docs-mem/x.txt": b"hello", "/docs-mem/y.pdf": b"%PDF"})
    docs = list_documents(Location("memory://docs-mem"), ["*.txt"], [])
    assert [d.source_uri for d in docs] == ["memory:///docs-mem/x.txt"]
    assert read_bytes(docs[0].source_uri, {}) == b"hello"


def test_s3_listing_uses_etag_and_reads_with_storage_options(s3_server, s3_bucket):
    bucket, client = s3_bucket
    client.put_object(Bucket=bucket, Key="in/one.txt", Body=b"first")
    client.put_object(Bucket=bucket, Key="in/deep/two.md", Body=b"# second")
    client.put_object(Bucket=bucket, Key="other/three.txt", Body=b"not listed")
    docs = list_documents(Location(f"s3://{bucket}/in/", s3_server), ["*"], [])
    assert [d.source_uri for d in docs] == [f"s3://{bucket}/in/deep/two.md", f"s3://{bucket}/in/one.txt"]
    etag = client.head_object(Bucket=bucket, Key="in/one.txt")["ETag"].strip('"')
    assert docs[1].version == etag
    assert read_bytes(docs[1].source_uri, s3_server) == b"first"
    client.put_object(Bucket=bucket, Key="in/one.txt", Body=b"first, changed")
    changed = list_documents(Location(f"s3://{bucket}/in/", s3_server), ["one.txt"], [])
    assert changed[0].doc_id != docs[1].doc_id


def test_read_refuses_files_over_limit(tmp_path):
    (tmp_path / "big.txt").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="max_file_bytes=10"):
        read_bytes(str(tmp_path / "big.txt"), {}, max_bytes=10)


def test_missing_local_folder_is_an_error_but_empty_s3_prefix_is_not(tmp_path, s3_server, s3_bucket):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_documents(Location(str(tmp_path / "typo")), ["*"], [])
    bucket, _ = s3_bucket
    assert list_documents(Location(f"s3://{bucket}/nothing-yet/", s3_server), ["*"], []) == []
