"""Where every file of a checkpoint lives, the tracker that names the newest one, and the
file primitives a save writes with (fsynced; never through a symbolic link).

Under --save DIR (Megatron's layout; the package docstring lists what each file holds)::

    latest_checkpointed_iteration.txt     the iteration of the newest complete save
    .megaq_job.lock                       the job lock (megaq.checkpoint.guard)
    iter_0000100/                         one save; written as .iter_0000100.tmp, renamed
      mp_rank_{tp:02d}_{pp:03d}/model_optim.pt   --ckpt-format torch
      common.pt, .metadata, __{rank}_0.distcp    --ckpt-format torch_dist
      rng/rank_{rank:05d}.pt, qgz/rank_{rank:05d}.pt, MANIFEST.sha256.json   both

No links followed: the tracker (and its temporary) is opened with ``O_NOFOLLOW`` /
``O_EXCL`` and checked with ``lstat``, so a link someone planted there is refused in
one line (LinkRefused), never written through.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

import torch

from megaq.checkpoint.errors import CheckpointError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.pt"  # torch_dist: the run's record (megaq.checkpoint.record)


class LinkRefused(CheckpointError):
    """A file megaq writes (or reads to decide what to write) in a checkpoint directory
    is a symbolic link; the message names it and the fix."""


# ------------------------------------------------------------------------- names
def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def temporary_dir(root: str, iteration: int) -> str:
    """Where a save of `iteration` is written before it is renamed into place."""
    return os.path.join(root, f".{os.path.basename(iteration_dir(root, iteration))}.tmp")


def mp_rank_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def model_file(ckpt_dir: str, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(ckpt_dir, mp_rank_name(tp_rank, pp_rank), "model_optim.pt")


def common_file(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, COMMON_FILE)


def rng_file(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, "rng", f"rank_{rank:05d}.pt")


def error_feedback_file(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, "qgz", f"rank_{rank:05d}.pt")


def is_dist_checkpoint(ckpt_dir: str) -> bool:
    """True for a directory --ckpt-format torch_dist wrote (its common file)."""
    return os.path.isfile(common_file(ckpt_dir))


# ------------------------------------------------------------------ writing files
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(obj, path: str) -> None:
    """torch.save to `path` (directories made), flushed and fsynced."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def link_refusal(path: str, what: str) -> str:
    """The one line refusing `path` (a symbolic link) as `what` (e.g. "the job lock")."""
    target = "?"
    with contextlib.suppress(OSError):
        target = os.readlink(path)
    return (f"{path} is a symbolic link (to {target}), not {what}: megaq follows no links in "
            f"a checkpoint directory (it would read or write through it, outside the "
            f"directory); replace the link with a regular file, or remove it, and run again")


def open_no_follow(path: str, flags: int, what: str, mode: int = 0o644) -> int:
    """os.open(path, flags | O_NOFOLLOW); a symbolic link at `path` raises LinkRefused."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW's answer for a link
            raise LinkRefused(link_refusal(path, what)) from None
        raise


def write_file_no_follow(path: str, data: bytes, what: str) -> None:
    """Write `data` to a new file at `path` (O_EXCL | O_NOFOLLOW: never through a link,
    never into an existing file; a leftover at `path` (a file, or a link, which is
    removed itself) is replaced), flushed and fsynced."""
    try:
        fd = open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what)
    except FileExistsError:  # left by a killed process with the same pid
        os.unlink(path)
        fd = open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------ tracker
def read_tracker_text(root: str) -> str | None:
    """The text of ``root/latest_checkpointed_iteration.txt`` (its first 4 KiB), None when
    there is none (or something other than a file stands there); a link raises LinkRefused."""
    path = os.path.join(root, TRACKER_FILE)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        raise LinkRefused(link_refusal(path, "the checkpoint tracker"))
    if not stat.S_ISREG(st.st_mode):
        return None
    fd = open_no_follow(path, os.O_RDONLY, "the checkpoint tracker")
    try:
        return os.read(fd, 4096).decode("utf-8", "replace")  # never trusted to be text
    finally:
        os.close(fd)


def read_tracker(root: str) -> int | None:
    """The iteration named by latest_checkpointed_iteration.txt, or None if there is none.
    A tracker that is a symbolic link is refused (LinkRefused), never followed."""
    text = read_tracker_text(root)
    if text is None:
        return None
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{os.path.join(root, TRACKER_FILE)} holds {text[:200]!r}, not an "
                              f"iteration number; fix it to name an existing iter_* directory "
                              f"(e.g. 100) or remove it") from None


def latest_iteration(root: str) -> int | None:
    """The iteration `root`'s tracker names, None when it names none (or is unreadable)."""
    with contextlib.suppress(OSError, ValueError, CheckpointError):
        return read_tracker(root)
    return None


def write_tracker(root: str, iteration: int) -> None:
    """Point latest_checkpointed_iteration.txt at `iteration` (temporary file + rename).
    The temporary is created exclusively and never through a link; the rename replaces
    the name itself (a link there is replaced, what it pointed to is untouched)."""
    path = os.path.join(root, TRACKER_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    write_file_no_follow(tmp, f"{iteration}\n".encode(), "the tracker's temporary")
    os.replace(tmp, path)
    fsync_dir(root)


def not_a_checkpoint_root(path: str) -> str | None:
    """For a --load / --pretrained-checkpoint PATH without a tracker file: the one-line
    reason PATH is something other than a checkpoint root (so that a mistyped path does
    not start a run from scratch unnoticed), or None: an empty or missing directory, or
    anything else Megatron-LM would also start from scratch in."""
    if os.path.isfile(path):
        return (f"{path} is a file; name the checkpoint directory, the one holding "
                f"{TRACKER_FILE}")
    if not os.path.isdir(path) or read_tracker(path) is not None:
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if read_tracker(parent) is not None:
        return (f"{path} is one iteration of the checkpoint {parent}; name the checkpoint "
                f"directory itself (it resumes from the iteration {TRACKER_FILE} names)")
    names = set(os.listdir(path))
    if "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names):
        return (f"{path} is a Hugging Face model directory, not a megaq checkpoint; convert it with "
                f"`python tools/convert_checkpoint.py --from hf --to megaq --input {path} --output "
                f"MEGAQ_DIR` and start from it with --finetune --load MEGAQ_DIR")
    if names & {"latest", "latest_universal"} and any(n.startswith("global_step") for n in names):
        return (f"{path} is a DeepSpeed checkpoint, not a megaq checkpoint; convert it with "
                f"`python tools/convert_checkpoint.py --from deepspeed --to megaq --input {path} "
                f"--output MEGAQ_DIR --num-attention-heads N` (or --hf-config CONFIG for a "
                f"transformers model) and resume from it with --load MEGAQ_DIR --no-load-rng")
    return None
