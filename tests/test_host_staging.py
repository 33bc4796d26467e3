"""--async-save's host staging (megaq/checkpoint/staging.py): one exact-size buffer whose
pieces DCP writes without copying them, and a pinned buffer kept (and unregistered
before it goes) across saves."""

import types

import pytest
import torch

from megaq.checkpoint import staging as hs


def test_pieces_are_exact_copies_on_storages_of_their_own_size():
    """Every staged piece equals its source, sits 64-byte aligned on a storage of exactly
    its bytes (DCP's writer copies a tensor whose storage is larger: no second copy of the
    shard here), and no two pieces share a byte."""
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g).bfloat16(),
           torch.randint(0, 255, (33,), generator=g, dtype=torch.uint8), torch.empty(0, 4),
           torch.randn(2, 3, 4, generator=g).double()[:, 1]]  # a strided view as source
    buf = hs.StagingBuffer(hs.bytes_needed(src), pin=False)
    out = [buf.copy(t) for t in src]
    spans = []
    for s, o in zip(src, out):
        assert o.dtype == s.dtype and o.shape == s.shape and o.is_contiguous() and torch.equal(o, s)
        assert o.untyped_storage().nbytes() == o.nbytes
        assert o.data_ptr() % hs.ALIGN == 0 or o.numel() == 0
        spans.append((o.data_ptr(), o.data_ptr() + o.nbytes))
    spans = sorted(sp for sp in spans if sp[1] > sp[0])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    with pytest.raises(RuntimeError, match="full"):
        buf.take((1,), torch.float32)


def test_staged_pieces_keep_the_buffer_alive():
    """The background writer holds only the pieces: they must keep the buffer's memory."""
    buf = hs.StagingBuffer(hs.bytes_needed([torch.ones(1000)]), pin=False)
    piece = buf.copy(torch.full((1000,), 3.0))
    del buf
    _ = [torch.zeros(1 << 20) for _ in range(8)]  # reuse of freed memory would show here
    assert torch.equal(piece, torch.full((1000,), 3.0))


def test_a_pinned_buffer_is_kept_for_the_next_save_and_unregistered_when_replaced(monkeypatch):
    """Pinning is paid once per run: the same size gets the same (reset) buffer back; a new
    size unregisters the old one first; an unpinned buffer is never kept."""
    calls = []
    fake = types.SimpleNamespace(cudaHostRegister=lambda p, n, f: calls.append(("reg", p, n)) or 0,
                                 cudaHostUnregister=lambda p: calls.append(("unreg", p)) or 0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(hs, "_KEPT", [])
    a = hs.buffer_for(1024, pin=True)
    assert a.pinned and calls == [("reg", a.buffer.data_ptr(), 1024)]
    a.take((16,), torch.float32)
    b = hs.buffer_for(1024, pin=True)
    assert b is a and b.used == 0 and len(calls) == 1
    c = hs.buffer_for(2048, pin=True)
    assert c is not a and not a.pinned and calls[1] == ("unreg", a.buffer.data_ptr())
    assert calls[2] == ("reg", c.buffer.data_ptr(), 2048)
    d = hs.buffer_for(2048, pin=False)
    assert not d.pinned and hs._KEPT == [] and calls[3] == ("unreg", c.buffer.data_ptr())


def test_a_refused_registration_stages_unpinned(monkeypatch):
    fake = types.SimpleNamespace(cudaHostRegister=lambda p, n, f: 1, cudaHostUnregister=None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(hs, "_KEPT", [])
    buf = hs.buffer_for(64, pin=True)
    assert not buf.pinned and hs._KEPT == []
    buf.release()  # nothing to unregister
