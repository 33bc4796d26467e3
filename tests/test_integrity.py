"""The SHA-256 checkpoint manifest (megaq.checkpoint.integrity): every byte of every file is covered.

The checkpoint here is a real one: saved by megaq.pretrain on 2 forked ranks with qgZ
error feedback (DCP index and shard files, common file, RNG and error-feedback files). The loader's use of the checks
(each kind of file, refused end to end with one line) is in tests/test_reliability.py.
"""

import json
import os
import random

import pytest

from megaq import pretrain
from megaq.checkpoint import integrity
from megaq.testing.ranks import run_cli_on_ranks


def tiny_argv(iters, *extra):
    return ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
            "--vocab-size", "64", "--eval-iters", "0", "--log-interval", "1",
            "--train-iters", str(iters), *extra]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ck"))
    r = run_cli_on_ranks(pretrain.cli, tiny_argv(
        1, "--save", root, "--save-interval", "1", "--zero-quantized-gradients",
        "--zero-gradient-error-feedback"), 2)
    assert r["codes"] == [0, 0], r["stderr"]
    return os.path.join(root, "iter_0000001")


def test_manifest_lists_every_file_and_verifies(saved):
    files = integrity.verify_all(saved)
    on_disk = sorted(os.path.relpath(os.path.join(d, n), saved)
                     for d, _, ns in os.walk(saved) for n in ns if n != integrity.MANIFEST_NAME)
    assert files == on_disk
    assert {".metadata", "common.pt", "__0_0.distcp", "__1_0.distcp", "rng/rank_00000.pt",
            "rng/rank_00001.pt", "qgz/rank_00000.pt", "qgz/rank_00001.pt"} <= set(files)


def test_a_flipped_byte_anywhere_in_any_file_is_refused_naming_it(saved):
    rng = random.Random(0)
    for rel in integrity.verify_all(saved):
        path = os.path.join(saved, rel)
        data = open(path, "rb").read()
        if not data:  # a rank that owns only padding writes an empty shard file
            continue
        positions = {0, len(data) - 1} | {rng.randrange(len(data)) for _ in range(8)}
        for pos in sorted(positions):
            bad = bytearray(data)
            bad[pos] ^= 1 << rng.randrange(8)
            open(path, "wb").write(bytes(bad))
            with pytest.raises(integrity.IntegrityError) as e:
                integrity.verify(saved, path)
            msg = str(e.value)
            expected = integrity.read_manifest(saved)["files"][rel]["sha256"]
            assert path in msg and expected in msg and integrity.sha256_of(path)[0] in msg
            assert "\n" not in msg
        open(path, "wb").write(data)
        integrity.verify(saved, path)  # restored: passes again


def test_truncated_empty_and_missing_files_are_refused(saved):
    path = os.path.join(saved, "rng", "rank_00001.pt")
    data = open(path, "rb").read()
    try:
        for content in (data[:len(data) // 2], b""):
            open(path, "wb").write(content)
            with pytest.raises(integrity.IntegrityError, match=f"{path} is damaged.*{len(content)} bytes"):
                integrity.verify(saved, path)
        os.remove(path)
        with pytest.raises(integrity.IntegrityError, match=f"{path} is missing"):
            integrity.verify(saved, path)
    finally:
        open(path, "wb").write(data)


def test_directory_without_complete_manifest_is_refused(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"x")
    files = integrity.Verifier(str(tmp_path))
    with pytest.raises(integrity.IntegrityError, match="has no integrity manifest"):
        files.require_manifest()
    integrity.write_manifest(str(tmp_path))
    body = json.loads((tmp_path / integrity.MANIFEST_NAME).read_text())
    body["complete"] = False
    (tmp_path / integrity.MANIFEST_NAME).write_text(json.dumps(body))
    with pytest.raises(integrity.IntegrityError, match="not a complete megaq manifest"):
        files.require_manifest()
    (tmp_path / integrity.MANIFEST_NAME).write_text('{"format": "megaq-sha')  # torn write
    with pytest.raises(integrity.IntegrityError, match="cannot be read"):
        files.require_manifest()
    with pytest.raises(integrity.IntegrityError, match="cannot be read"):
        files.verify(str(tmp_path / "a.pt"))
    unchecked = integrity.Verifier(str(tmp_path), enabled=False)  # --no-verify-checkpoint
    unchecked.require_manifest()
    unchecked.verify(str(tmp_path / "a.pt"))


def test_a_verifier_checks_a_file_again_once_it_changed(tmp_path):
    """A Verifier hashes a file once; a file written since (size or mtime) is hashed again."""
    path = tmp_path / "a.pt"
    path.write_bytes(b"x")
    integrity.write_manifest(str(tmp_path))
    files = integrity.Verifier(str(tmp_path))
    files.verify(str(path))
    path.write_bytes(b"xy")
    with pytest.raises(integrity.IntegrityError, match="a.pt is damaged"):
        files.verify(str(path))


def test_file_added_after_the_save_is_refused(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"x")
    integrity.write_manifest(str(tmp_path))
    (tmp_path / "b.pt").write_bytes(b"y")
    with pytest.raises(integrity.IntegrityError, match="b.pt is not listed"):
        integrity.verify(str(tmp_path), str(tmp_path / "b.pt"))
