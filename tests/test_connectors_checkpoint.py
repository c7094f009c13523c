"""Checkpoints given as URIs are copied once per node into a local cache."""

from __future__ import annotations

import os

from clover_batch.connectors.checkpoint import local_checkpoint


def test_local_sources_pass_through(tmp_path):
    assert local_checkpoint("tiny") == "tiny"
    assert local_checkpoint(str(tmp_path)) == str(tmp_path)
    assert local_checkpoint(f"file://{tmp_path}") == str(tmp_path)


def test_s3_checkpoint_copied_once_and_again_when_changed(s3_server, s3_bucket, tmp_path):
    bucket, client = s3_bucket
    client.put_object(Bucket=bucket, Key="ckpt/config.json", Body=b'{"vocab_size": 512}')
    client.put_object(Bucket=bucket, Key="ckpt/weights/model-00001.safetensors", Body=b"w" * 1000)
    cache = tmp_path / "cache"
    first = local_checkpoint(f"s3://{bucket}/ckpt", s3_server, str(cache))
    assert open(os.path.join(first, "config.json"), "rb").read() == b'{"vocab_size": 512}'
    assert os.path.getsize(os.path.join(first, "weights", "model-00001.safetensors")) == 1000
    mtime = os.path.getmtime(os.path.join(first, "config.json"))
    assert local_checkpoint(f"s3://{bucket}/ckpt/", s3_server, str(cache)) == first  # cached, not copied again
    assert os.path.getmtime(os.path.join(first, "config.json")) == mtime
    # no temporary folders left (the .lock file is what makes one process per node copy)
    assert sorted(n for n in os.listdir(cache) if not n.endswith(".lock")) == [os.path.basename(first)]

    client.put_object(Bucket=bucket, Key="ckpt/config.json", Body=b'{"vocab_size": 1024}')
    second = local_checkpoint(f"s3://{bucket}/ckpt", s3_server, str(cache))
    assert second != first
    assert open(os.path.join(second, "config.json"), "rb").read() == b'{"vocab_size": 1024}'
