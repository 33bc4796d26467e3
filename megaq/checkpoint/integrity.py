"""SHA-256 manifest of a checkpoint directory: written last, verified on every read.

A save writes every file into its temporary directory, then :func:`write_manifest`
hashes them all and writes ``MANIFEST.sha256.json`` (itself through a temporary name
and a rename, fsynced), and only then is the directory renamed into place. So a
directory whose manifest is missing or incomplete is a save that did not finish (or
a checkpoint from before manifests), and :meth:`Verifier.require_manifest` refuses it.

Loading reads every file through a :class:`Verifier` of its directory, which checks
the file against the manifest before its bytes are used (:func:`verify`): its SHA-256
must equal the manifest's, else one :class:`IntegrityError` line names the file and
both hashes. A flipped byte, a truncation, an empty file and a missing file are all
caught. ``--no-verify-checkpoint`` (CheckpointConfig.no_verify_checkpoint, passed down
by the load) builds the Verifier with ``enabled=False``; nothing here remembers it.

The manifest format (JSON)::

    {"format": "megaq-sha256-manifest", "version": 1, "complete": true,
     "files": {"mp_rank_00_000/model_optim.pt": {"sha256": "...", "bytes": 123}, ...}}
"""

from __future__ import annotations

import hashlib
import json
import os

from megaq.checkpoint import safe_unpickle
from megaq.checkpoint.errors import CheckpointError

MANIFEST_NAME = "MANIFEST.sha256.json"
FORMAT = "megaq-sha256-manifest"
VERSION = 1
_CHUNK = 1 << 22


class IntegrityError(CheckpointError):
    """A checkpoint file that does not match its manifest, or a missing manifest."""


def sha256_of(path: str) -> tuple[str, int]:
    """(hex digest, size in bytes) of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _files_under(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel != MANIFEST_NAME:
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def write_manifest(root: str, known: dict | None = None) -> str:
    """Hash every file under `root` and write the manifest, atomically and fsynced.

    Call it after every file of the checkpoint is on disk and before the directory is
    renamed into place. `known` ({relative path: {"sha256", "bytes"}}) are hashes their
    writers computed already (a sharded save: each rank hashes the files it wrote);
    only the other files are read here. Returns the manifest's path."""
    files = {}
    known = known or {}
    for rel in _files_under(root):
        if rel in known and known[rel]["bytes"] == os.path.getsize(os.path.join(root, rel)):
            files[rel] = dict(known[rel])
            continue
        digest, size = sha256_of(os.path.join(root, rel))
        files[rel] = {"sha256": digest, "bytes": size}
    body = {"format": FORMAT, "version": VERSION, "complete": True, "files": files}
    path = os.path.join(root, MANIFEST_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(root: str) -> dict:
    """The parsed manifest of checkpoint directory `root`; IntegrityError when it is
    missing, unreadable or not marked complete."""
    path = os.path.join(root, MANIFEST_NAME)
    hint = ("a save that did not finish, or a checkpoint written before manifests; load an "
            "earlier iteration, or pass --no-verify-checkpoint to load it unverified")
    if not os.path.isfile(path):
        raise IntegrityError(f"{root} has no integrity manifest ({MANIFEST_NAME}): {hint}")
    try:
        with open(path) as f:
            body = json.load(f)
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{path} cannot be read ({type(e).__name__}: {e}): {hint}") from None
    if (not isinstance(body, dict) or body.get("format") != FORMAT or body.get("complete") is not True
            or not isinstance(body.get("files"), dict)):
        raise IntegrityError(f"{path} is not a complete megaq manifest: {hint}")
    return body


def verify(root: str, path: str) -> None:
    """Check that `path` (a file inside checkpoint directory `root`) matches the
    manifest; IntegrityError naming the file and both hashes otherwise."""
    manifest = read_manifest(root)
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    entry = manifest["files"].get(rel)
    if entry is None:
        raise IntegrityError(f"{path} is not listed in {os.path.join(root, MANIFEST_NAME)}; the "
                             f"checkpoint was altered after it was saved (or pass "
                             f"--no-verify-checkpoint)")
    if not os.path.isfile(path):
        raise IntegrityError(f"{path} is missing (the manifest lists it with sha256 "
                             f"{entry['sha256']}); the checkpoint is incomplete")
    actual, size = sha256_of(path)
    if actual != entry["sha256"]:
        raise IntegrityError(
            f"{path} is damaged: sha256 {actual} ({size} bytes), the manifest expects "
            f"{entry['sha256']} ({entry['bytes']} bytes); restore the file or load an earlier "
            f"iteration (--no-verify-checkpoint skips this check)")


def load_file(path: str, mmap: bool = False):
    """A checkpoint file's contents (tensors and plain containers only: read by
    megaq.checkpoint.safe_unpickle, on CPU); any reading failure becomes one
    IntegrityError line naming the file (a forbidden class: naming the class too)."""
    try:
        return safe_unpickle.load(path, safe_unpickle.TENSORS, mmap=mmap)
    except safe_unpickle.UnpicklingRefused as e:
        raise IntegrityError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - damaged file, foreign pickle, empty file
        first = (str(e).splitlines() or [""])[0]
        raise IntegrityError(f"{path} cannot be read ({type(e).__name__}: {first}); it is damaged "
                             f"or not a megaq checkpoint file") from None


def verify_all(root: str) -> list[str]:
    """Check every file the manifest lists (tools, tests); returns their relative paths."""
    manifest = read_manifest(root)
    for rel in sorted(manifest["files"]):
        verify(root, os.path.join(root, rel))
    return sorted(manifest["files"])


class Verifier:
    """The files of checkpoint directory `root`, checked against its manifest before they
    are used; with enabled=False (--no-verify-checkpoint) used unchecked. A file checked
    once and unchanged since (size, mtime) is not hashed again: a tool reading one tensor
    at a time must not hash a rank's file per tensor."""

    def __init__(self, root: str, enabled: bool = True):
        self.root, self.enabled = str(root), enabled
        self._checked: set[tuple] = set()

    def require_manifest(self) -> None:
        """Refuse a directory without a complete manifest (a save that did not finish)."""
        if self.enabled:
            read_manifest(self.root)

    def verify(self, path: str) -> None:
        if not self.enabled:
            return
        try:
            st = os.stat(path)
            key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        if key is not None and key in self._checked:
            return
        verify(self.root, path)
        if key is not None:
            self._checked.add(key)

    def load(self, path: str, mmap: bool = False):
        """`path`'s contents (load_file), verified first."""
        self.verify(path)
        return load_file(path, mmap)
