"""Megatron-LM's indexed dataset (`.bin` + `.idx`), read by memory map and written
byte-for-byte as Megatron-LM writes it.

`.idx` (little-endian): magic `MMIDIDX\\x00\\x00`, uint64 version 1, uint8 dtype code,
uint64 sequence count S, uint64 document count D (documents + 1), int32[S] sequence
lengths, int64[S] byte offsets into `.bin`, int64[D] document boundaries (indices into
the sequence list, starting at 0). `.bin` holds the token ids back to back, no header.
The preprocessing tool writes one sequence per document, so sequences == documents.
"""

from __future__ import annotations

import os
import shutil
import struct

import numpy as np

from megaq.data.errors import DataError
from megaq.data.fsutil import open_tmp, remove_quietly, tmp_name

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPE_BY_CODE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                 6: np.float64, 7: np.float32, 8: np.uint16}
CODE_BY_DTYPE = {np.dtype(v): k for k, v in DTYPE_BY_CODE.items()}
TOKEN_DTYPES = {"uint16": np.uint16, "int32": np.int32, "int64": np.int64}


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def optimal_dtype(vocab_size: int):
    """Megatron's choice: uint16 when the vocab is under 65,500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def resolve_dtype(name: str, vocab_size: int, where: str = "--dtype"):
    """'auto' or a dtype name -> numpy dtype, refusing one too small for the vocab."""
    if name == "auto":
        return optimal_dtype(vocab_size)
    if name not in TOKEN_DTYPES:
        raise DataError(f"{where} {name!r} is not supported; use auto, {', '.join(TOKEN_DTYPES)}")
    dtype = TOKEN_DTYPES[name]
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise DataError(f"{where} {name}: vocab of {vocab_size} ids does not fit "
                        f"(max id {np.iinfo(dtype).max}); use --dtype int32 or auto")
    return dtype


class IndexedDataset:
    """Read-only, memory-mapped view of `{prefix}.bin/.idx`; `ds[i]` is sequence i."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        if not os.path.exists(ipath) and not os.path.exists(bpath):
            raise DataError(f"{prefix}: no {ipath} or {bpath}; pass the prefix without extension "
                            "(e.g. out_text_document) of files written by tools/preprocess_data.py")
        for p in (ipath, bpath):
            if not os.path.exists(p):
                raise DataError(f"{p}: missing (its pair exists); regenerate both with "
                                "tools/preprocess_data.py")
        self._read_index(ipath)
        self._map_bin(bpath)

    def _read_index(self, ipath: str) -> None:
        size = os.path.getsize(ipath)
        fix = "regenerate it with tools/preprocess_data.py"
        with open(ipath, "rb") as f:
            head = f.read(HEADER_BYTES)
        if head[:len(MAGIC)] != MAGIC:
            if len(head) < len(MAGIC) and head == MAGIC[:len(head)]:
                raise DataError(f"{ipath}: truncated at byte {len(head)} (header needs "
                                f"{HEADER_BYTES} bytes); {fix}")
            raise DataError(f"{ipath}: bad magic at offset 0 ({head[:9]!r}, expected {MAGIC!r}): "
                            f"not a Megatron indexed dataset; {fix}")
        if len(head) < HEADER_BYTES:
            raise DataError(f"{ipath}: truncated at byte {len(head)} (header needs "
                            f"{HEADER_BYTES} bytes); {fix}")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != VERSION:
            raise DataError(f"{ipath}: unsupported version {version} at offset 9 (expected "
                            f"{VERSION}); {fix}")
        if code not in DTYPE_BY_CODE:
            raise DataError(f"{ipath}: unknown dtype code {code} at offset 17; {fix}")
        need = HEADER_BYTES + n_seq * 4 + n_seq * 8 + n_doc * 8
        if size < need:
            raise DataError(f"{ipath}: truncated: {size} bytes but its header "
                            f"({n_seq} sequences, {n_doc} document boundaries) needs {need}; {fix}")
        self.dtype = DTYPE_BY_CODE[code]
        self.itemsize = np.dtype(self.dtype).itemsize
        mm = np.memmap(ipath, mode="r", dtype=np.uint8)
        self._idx_mm = mm
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(mm, np.int32, n_seq, off)
        off += n_seq * 4
        self.sequence_pointers = np.frombuffer(mm, np.int64, n_seq, off)
        off += n_seq * 8
        self.document_indices = np.frombuffer(mm, np.int64, n_doc, off)
        docs = self.document_indices
        if n_doc == 0 or docs[0] != 0 or docs[-1] != n_seq:
            raise DataError(f"{ipath}: corrupt document boundaries at offset {off} (must run from "
                            f"0 to {n_seq}); {fix}")
        # A boundary out of order would give a document a negative length or one
        # taken from another document's sequences (Megatron's sentence-split files too)
        bad = np.flatnonzero(docs[1:] < docs[:-1])
        if bad.size:
            raise DataError(f"{ipath}: corrupt document boundaries: boundary {bad[0] + 1} "
                            f"({docs[bad[0] + 1]}) is below the one before it ({docs[bad[0]]}); "
                            f"{fix}")
        self._check_lengths_and_pointers(ipath, code, fix)

    def _check_lengths_and_pointers(self, ipath: str, code: int, fix: str) -> None:
        """Megatron's writer puts sequence i at byte sum(lengths[:i]) * itemsize, so the
        pointers must be exactly the running sum of the lengths: a corrupted length or
        pointer (or dtype code) otherwise reads other bytes, or fails mid-training.
        O(n) numpy, in blocks so the temporaries stay small on huge indices."""
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        bad = np.flatnonzero(lengths < 0)
        if bad.size:
            raise DataError(f"{ipath}: corrupt sequence length {lengths[bad[0]]} (sequence "
                            f"{bad[0]}); {fix}")
        start, block = 0, 1 << 22
        for lo in range(0, len(lengths), block):
            ends = start + np.cumsum(lengths[lo:lo + block], dtype=np.int64) * self.itemsize
            expect = np.concatenate(([start], ends[:-1]))
            bad = np.flatnonzero(pointers[lo:lo + block] != expect)
            if bad.size:
                i = lo + int(bad[0])
                raise DataError(f"{ipath}: corrupt index: sequence {i} starts at byte "
                                f"{pointers[i]} of the .bin but the lengths before it put it at "
                                f"{expect[bad[0]]}{self._dtype_hint(code)}; {fix}")
            start = int(ends[-1])
        self._data_bytes = start  # what the .bin must hold, exactly

    def _dtype_hint(self, code: int) -> str:
        """When the pointers fit another token size, the dtype code is what is wrong."""
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        for size in (1, 2, 4, 8):
            if size != self.itemsize and len(lengths) > 1 and np.array_equal(
                    pointers[1:], np.cumsum(lengths[:-1], dtype=np.int64) * size):
                return (f" (its dtype code {code} says {self.itemsize}-byte "
                        f"{np.dtype(self.dtype).name} tokens, the offsets say {size}-byte ones)")
        return ""

    def _map_bin(self, bpath: str) -> None:
        size = os.path.getsize(bpath)
        need = self._data_bytes
        if size < need:
            raise DataError(f"{bpath}: {size} bytes but {idx_path(self.prefix)} says {need} "
                            f"(truncated .bin, ends inside sequence "
                            f"{int(np.searchsorted(self.sequence_pointers, size, 'right')) - 1}); "
                            "regenerate both files with tools/preprocess_data.py")
        # Megatron's writer leaves no bytes after the last sequence: extra ones mean the
        # .idx belongs to other data, or its dtype code is wrong (e.g. int8 on uint16 ids)
        if size > need:
            hint = ""
            if need and size % need == 0 and size // need * self.itemsize in (1, 2, 4, 8):
                hint = (f"; its dtype code says {self.itemsize}-byte {np.dtype(self.dtype).name} "
                        f"tokens, the .bin holds {size // need * self.itemsize}-byte ones")
            raise DataError(f"{bpath}: {size} bytes but {idx_path(self.prefix)} says {need} "
                            f"(the index does not match this .bin{hint}); regenerate both files "
                            "with tools/preprocess_data.py")
        self._bin = np.memmap(bpath, mode="r", dtype=np.uint8) if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence i (a read-only view of the map)."""
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        start = int(self.sequence_pointers[i]) + offset * self.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @staticmethod
    def exists(prefix: str) -> bool:
        return os.path.exists(idx_path(prefix)) and os.path.exists(bin_path(prefix))


def write_index(f, dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write an `.idx` body exactly as Megatron-LM's _IndexWriter does."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    f.write(MAGIC)
    f.write(struct.pack("<Q", VERSION))
    f.write(struct.pack("<B", CODE_BY_DTYPE[np.dtype(dtype)]))
    f.write(struct.pack("<Q", len(lengths)))
    f.write(struct.pack("<Q", len(docs)))
    f.write(lengths.tobytes(order="C"))
    f.write(pointers.tobytes(order="C"))
    f.write(docs.tobytes(order="C"))


class IndexedDatasetWriter:
    """Append documents (one sequence each) to temp files; `commit()` renames them to
    `{prefix}.bin/.idx`, `abort()` deletes them. Nothing appears under the final names
    until commit, so a failed run leaves no partial output."""

    def __init__(self, prefix: str, dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self._bin_tmp = tmp_name(bin_path(prefix))
        self._idx_tmp = tmp_name(idx_path(prefix))
        self._bin = open_tmp(self._bin_tmp, bin_path(prefix))
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0

    def add_document(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self.add_documents(arr, np.array([arr.size], dtype=np.int32))

    def add_documents(self, flat, lengths: np.ndarray) -> None:
        """Add several documents given as their concatenated tokens (one array, or a list
        of consecutive parts of it) and their lengths. Written without a copy."""
        for part in (flat if isinstance(flat, list) else [flat]):
            part = np.ascontiguousarray(part, dtype=self.dtype)
            self._bin.write(memoryview(part).cast("B"))
            self.num_tokens += int(part.size)
        self._lengths.append(np.asarray(lengths, dtype=np.int32))

    def append_writer(self, other: "IndexedDatasetWriter") -> None:
        """Append everything another (unfinished) writer holds; used to merge partitions."""
        if other.dtype != self.dtype:
            raise ValueError(f"dtype {other.dtype} differs from {self.dtype}")
        other._bin.close()
        with open(other._bin_tmp, "rb") as f:
            shutil.copyfileobj(f, self._bin, 1 << 24)
        self._lengths.extend(other._lengths)
        self.num_tokens += other.num_tokens

    @property
    def num_documents(self) -> int:
        return sum(len(x) for x in self._lengths)

    def finish(self) -> None:
        """Close the .bin and write the .idx, both still under temporary names."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        with open(self._idx_tmp, "wb") as f:
            write_index(f, self.dtype, lengths, np.arange(len(lengths) + 1, dtype=np.int64))

    def commit(self) -> None:
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        remove_quietly(self._bin_tmp, self._idx_tmp)
