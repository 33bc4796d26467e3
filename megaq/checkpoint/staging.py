"""--async-save: the host copy of a rank's shard, and the background save in flight.

The copy is one buffer of exactly the bytes staged, page-locked by registering it with
CUDA.

Why not ``torch.empty(..., pin_memory=True)`` per tensor: torch's pinned-memory cache
rounds every block up to a power of two. Over the 444 pieces of a 124M-parameter shard
that is 2,470 MB for 1,485 MB of data, which is the 1.67x save peak measured on an H200
host (docs/PERFORMANCE.md, "Checkpoint save and load"), and the cache keeps those
blocks for the rest of the run. Here the pieces are slices of one buffer, each tensor
on its own exact-size storage (an ``UntypedStorage`` slice), so DCP's writer writes them
as they are, with no copy of its own (it copies a tensor whose storage is larger than
the tensor).

The pinned buffer is kept for the next save (one save is in flight at a time, and a
run's shard keeps its size), as torch's cache would keep its blocks, so the
registration is paid once per run. Without CUDA nothing is pinned and the buffer is
dropped after the write.

One save is in flight at a time (:func:`start_background`): a thread writes, hashes and
commits it while training goes on; the next save and the end of the run wait for it
(:func:`wait_for_async_save`, which re-raises its failure). :data:`HOST_BYTES` counts
the host memory the checkpoint code allocates itself (staging copies, read buffers).
"""

from __future__ import annotations

import threading

import torch

ALIGN = 64  # bytes between pieces: the CPU allocator's alignment, for every dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StagingBuffer:
    """`nbytes` of host memory (pinned when `pin`), handed out piece by piece (:meth:`take`)."""

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes = nbytes
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.pinned = pin and _register(self.buffer)
        self.used = 0

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` and `dtype` in the next free bytes, on a
        storage of exactly its own size."""
        n = torch.Size(shape).numel() * dtype.itemsize
        start = self.used
        if start + n > self.nbytes:
            raise RuntimeError(f"staging buffer of {self.nbytes} bytes is full (asked {n} at {start})")
        self.used = _aligned(start + n)
        storage = self.buffer.untyped_storage()[start:start + n]
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A staged copy of `t` (any device)."""
        out = self.take(t.shape, t.dtype)
        out.copy_(t)
        return out

    def reset(self) -> None:
        """Hand the bytes out again from the start (the previous save is written)."""
        self.used = 0

    def release(self) -> None:
        """Unregister the pinned pages (before the memory can be freed)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False


def bytes_needed(tensors) -> int:
    """The buffer size for staging `tensors` one after another (:meth:`StagingBuffer.take`)."""
    return sum(_aligned(t.nbytes) for t in tensors)


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock `buffer` for CUDA copies; False (unpinned: slower copies, same bytes)
    where CUDA refuses."""
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0)
    return int(err) == 0


_KEPT: list[StagingBuffer] = []  # the pinned buffer of this process, kept between saves


def buffer_for(nbytes: int, pin: bool) -> StagingBuffer:
    """A buffer of `nbytes`: the kept pinned one when it fits (the previous save is
    written: the caller waits for it first), else a new one (pinned and kept when `pin`)."""
    if pin and _KEPT and _KEPT[0].nbytes == nbytes and _KEPT[0].pinned:
        _KEPT[0].reset()
        return _KEPT[0]
    while _KEPT:
        _KEPT.pop().release()
    buffer = StagingBuffer(nbytes, pin)
    if buffer.pinned:
        _KEPT.append(buffer)
    return buffer


# ------------------------------------------------------------------ host bytes
class HostBytes:
    """Bytes of the tensors the checkpoint code itself allocates (staging copies,
    read buffers), live and peak: what a rank materialises beyond its own state."""

    def __init__(self):
        self.live = self.peak = 0

    def reset(self) -> None:
        self.live = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes


HOST_BYTES = HostBytes()


# ------------------------------------------------------------ the save in flight
class _PendingSave:
    def __init__(self, iteration: int):
        self.thread, self.iteration, self.error = None, iteration, None


_PENDING: list[_PendingSave] = []


def wait_for_async_save() -> int | None:
    """Wait for the background save in flight (if any) to be written and committed;
    re-raise its failure here. Returns its iteration (None when there was none)."""
    if not _PENDING:
        return None
    pending = _PENDING.pop()
    pending.thread.join()
    if pending.error is not None:
        raise pending.error
    return pending.iteration


def async_save_in_flight() -> bool:
    return bool(_PENDING)


def start_background(iteration: int, write, job: dict, staged_bytes: int) -> None:
    """Run write(**job) in a background thread (the save of `iteration`, its tensors
    staged: `staged_bytes` of HOST_BYTES, given back when it ends). The caller waited
    for the previous one (wait_for_async_save)."""
    pending = _PendingSave(iteration)
    # daemon: a run that dies mid-write must not hang on it (the save is then simply
    # not committed, and the previous checkpoint stays latest)
    pending.thread = threading.Thread(target=_background, args=(pending, write, job, staged_bytes),
                                      name=f"megaq-async-save-{iteration}", daemon=True)
    _PENDING.append(pending)
    pending.thread.start()


def _background(pending: _PendingSave, write, job: dict, staged_bytes: int) -> None:
    try:
        write(**job)
    except BaseException as e:  # noqa: BLE001 - handed to the main thread's next wait
        pending.error = e
    finally:
        HOST_BYTES.sub(staged_bytes)  # the staged copies are dropped now (a pinned buffer
        job.clear()                   # stays for the next save)
