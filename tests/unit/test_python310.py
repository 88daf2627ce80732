"""rayft requires Python >= 3.10 (pyproject.toml): the product code uses no standard-library API
added later. mypy checks that statically (`python_version = "3.10"`); these pin what it found."""

import hashlib

from jobs.data import cache


def test_data_file_hash_needs_no_file_digest(tmp_path, monkeypatch):
    """`hashlib.file_digest` is Python 3.11+: the data hash reads the file in blocks instead."""
    monkeypatch.delattr(hashlib, "file_digest", raising=False)
    data = bytes(range(256)) * 5000  # more than one 1 MiB block
    path = tmp_path / "train.jsonl"
    path.write_bytes(data)
    assert cache.file_sha256(path) == hashlib.sha256(data).hexdigest()
