"""jsonl (or .jsonl.gz) -> Megatron `{prefix}_{key}_document.bin/.idx`.

The main process reads raw lines in chunks and hands them to worker processes, which
parse the JSON, tokenize (megaq.data.tokenizer.build_tokenizer) and return the token array (in parts) plus the
document lengths per chunk; the main process writes them in input order. With one
worker everything runs in the main process (no pickling). `--partitions N` encodes N
contiguous line ranges one after another into temporary datasets and merges them;
the result is byte-identical to N = 1.

Bad input stops the run with a DataError naming the file and line; nothing is left
under the output names (everything is written to temporary names and renamed last).

Memory: a document longer than `LONG_DOC_CHARS` is tokenized in pieces
(megaq.data.tokenizer.tokenize_in_pieces: cut only where the ids provably equal the whole
document's) straight into a numpy array, and its raw line is dropped once parsed, so one
50 MB document peaks at a few times its size (docs/PERFORMANCE.md) instead of the
encoder's tens of bytes per character. Shorter documents are tokenized in batches as
before; the output is the same bytes either way.
"""

from __future__ import annotations

import gzip
import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from megaq.data.errors import DataError
from megaq.data.indexed import IndexedDatasetWriter, resolve_dtype
from megaq.data.tokenizer import build_tokenizer, tokenize_in_pieces

CHUNK_DOCS = 256          # documents per worker task: amortises IPC, keeps latency low
CHUNK_BYTES = 1 << 20
# Longer documents are tokenized in pieces of PIECE_CHARS. Up to this length a document is
# encoded whole, as always (the encoder's working memory stays within ~100 MB), so that
# every document of normal length gets exactly the ids it always got, whatever the model.
LONG_DOC_CHARS = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")  # a code point with no UTF-8 form


@dataclass
class PreprocessStats:
    documents: int = 0            # non-empty lines read (documents with at least one key)
    empty: dict = field(default_factory=dict)   # key -> empty documents skipped
    tokens: dict = field(default_factory=dict)  # key -> tokens written
    bytes: int = 0                # input bytes (uncompressed) read
    seconds: float = 0.0
    outputs: dict = field(default_factory=dict)  # key -> output prefix

    def rates(self) -> dict:
        s = max(self.seconds, 1e-9)
        return {"docs_per_s": self.documents / s, "mb_per_s": self.bytes / s / 1e6,
                "tokens_per_s": sum(self.tokens.values()) / s}


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def open_input(path: str):
    """Binary line reader for .jsonl or .jsonl.gz (gzip detected by magic bytes)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: input not found; check --input")
    try:
        return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb", buffering=1 << 20)
    except OSError as e:
        raise DataError(f"{path}: cannot read input ({e.strerror}); fix its permissions") from None


def is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def iter_chunks(path: str, start: int = 0, stop: int | None = None,
                chunk_docs: int = CHUNK_DOCS, by_range: bool = False):
    """Yield (first line number (1-based), payload) for lines [start, stop).

    payload is the list of raw lines, or with by_range=True (uncompressed files only)
    the (byte offset, byte count) of those lines, which a worker reads itself: the
    parent then ships a few integers per chunk instead of the text."""
    f = open_input(path)
    lineno = 0
    try:
        with f:
            lines, nbytes, first, offset, n = [], 0, start + 1, 0, 0
            for line in f:  # (not enumerate: it would keep the last, maybe huge, line alive)
                lineno += 1
                if lineno <= start:
                    offset += len(line)
                    continue
                if stop is not None and lineno > stop:
                    break
                if not by_range:
                    lines.append(line)
                n += 1
                nbytes += len(line)
                line = None  # held by `lines` only: the encoder drops it once parsed
                if n >= chunk_docs or nbytes >= CHUNK_BYTES:
                    yield first, ((offset, nbytes) if by_range else lines)
                    first, lines, offset, nbytes, n = lineno + 1, [], offset + nbytes, 0, 0
            if n:
                yield first, ((offset, nbytes) if by_range else lines)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: read error after line {lineno} ({e}); the file is corrupt "
                        "or truncated: re-create it") from None


def count_lines(path: str) -> int:
    n, last = 0, b""
    with open_input(path) as f:
        while block := f.read(1 << 24):
            n += block.count(b"\n")
            last = block
        if last and not last.endswith(b"\n"):
            n += 1
    return n


class ChunkEncoder:
    """Parses and tokenizes chunks of jsonl lines; one instance per worker process."""

    def __init__(self, path, json_keys, tokenizer_type, tokenizer_model, append_eod, dtype,
                 vocab_file=None, merge_file=None):
        self.path, self.keys, self.append_eod = path, list(json_keys), append_eod
        self.tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file)
        self.dtype = np.dtype(dtype)
        self._fd = None

    def __call__(self, chunk):
        """-> ("ok", {key: (token array parts, lengths)}, {key: empty}, docs, nbytes) or
        ("error", msg)."""
        first, lines = chunk
        if isinstance(lines, tuple):  # a byte range of the (uncompressed) input
            offset, nbytes = lines
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            lines = os.pread(self._fd, nbytes, offset).split(b"\n")  # only \n ends a line
            if not lines[-1]:
                lines.pop()  # after the last \n (the newlines are not needed to parse)
        else:
            nbytes = sum(len(x) for x in lines)
        texts = {k: [] for k in self.keys}
        empty = dict.fromkeys(self.keys, 0)
        docs = 0
        for index in range(len(lines)):
            lineno, raw = first + index, lines[index]
            lines[index] = None  # the raw line goes once parsed (its text is all that is kept)
            if not raw or raw.isspace():
                for k in self.keys:
                    empty[k] += 1
                continue
            try:  # decoded as json.loads decodes bytes, the bytes dropped before parsing
                raw = raw.decode(json.detect_encoding(raw), "surrogatepass")
                obj = json.loads(raw)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                return ("error", f"{self.path}:{lineno}: malformed JSON ({e}); fix or delete "
                                 "this line (one JSON object per line)")
            raw = None
            if not isinstance(obj, dict):
                return ("error", f"{self.path}:{lineno}: expected a JSON object, got "
                                 f"{type(obj).__name__}; write one object per line")
            docs += 1
            for k in self.keys:
                if k not in obj:
                    have = ", ".join(list(obj)[:8]) or "none"
                    return ("error", f"{self.path}:{lineno}: missing json key {k!r} (keys present: "
                                     f"{have}); pass the right name with --json-keys")
                text = obj[k]
                if not isinstance(text, str):
                    return ("error", f"{self.path}:{lineno}: json key {k!r} holds "
                                     f"{type(text).__name__}, expected a string; fix the line")
                # JSON's \ud800-style escapes can decode to lone surrogates (searched for,
                # not encoded: no copy of a long text)
                bad = None if text.isascii() else _SURROGATE.search(text)
                if bad is not None:
                    return ("error", f"{self.path}:{lineno}: invalid text: json key {k!r} holds "
                                     f"a lone surrogate {bad.group()!r} at character {bad.start()} "
                                     f"(not Unicode text); fix or delete this line")
                texts[k].append(text)
        raw = obj = text = None  # only texts[k] holds the documents now
        out = {}
        for k in self.keys:
            docs_k, texts[k] = texts[k], None
            out[k] = self._encode_documents(docs_k)
            empty[k] += out[k][2]
            out[k] = out[k][:2]
        return ("ok", out, empty, docs, nbytes)

    def _encode_documents(self, texts: list[str]) -> tuple[list[np.ndarray], np.ndarray, int]:
        """(the documents' tokens, concatenated, as consecutive array parts; lengths; empty
        documents) of `texts`, consumed: each long text is dropped once tokenized. Short
        documents are tokenized in one batch; a long one in pieces (tokenize_in_pieces),
        each kept as an array, so no Python int per token lives on."""
        short = [t for t in texts if len(t) <= LONG_DOC_CHARS]
        batch = iter(self.tokenizer.tokenize_batch(short) if short else [])
        del short
        eod = [self.tokenizer.eod] if self.append_eod else []
        parts: list[np.ndarray] = []
        lengths: list[int] = []
        run: list[list[int]] = []  # short documents since the last part

        def flush():
            n = sum(len(x) for x in run)
            parts.append(np.fromiter(itertools.chain.from_iterable(run), self.dtype, n))
            run.clear()

        empty = 0
        for i in range(len(texts)):
            text, texts[i] = texts[i], None
            if len(text) <= LONG_DOC_CHARS:
                ids = next(batch)
                if ids:
                    run.append(ids + eod)
                    lengths.append(len(run[-1]))
                else:
                    empty += 1
                continue
            pieces = [np.asarray(p, dtype=self.dtype) for p in tokenize_in_pieces(self.tokenizer, text)]
            text = None
            n = sum(p.size for p in pieces)
            if not n:
                empty += 1
                continue
            if run:
                flush()
            parts += [p for p in pieces if p.size] + ([np.asarray(eod, self.dtype)] if eod else [])
            lengths.append(n + len(eod))
        if run or not parts:
            flush()
        return parts, np.asarray(lengths, dtype=np.int32), empty


_WORKER_ENCODER = None  # set in each pool worker by _init_worker; never used in the parent
_POOL_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # the ones a worker handles as its own


def _init_worker(args):
    global _WORKER_ENCODER
    # pool.terminate() ends a worker with SIGTERM: a handler inherited from the caller (a
    # training loop's, a launcher's) would catch it and leave terminate() joining forever.
    # Ctrl-C reaches the whole process group; the parent ends the pool, so the workers
    # ignore it rather than each print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked by _start_pool since before the fork
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _POOL_SIGNALS)
    _WORKER_ENCODER = ChunkEncoder(*args)


def _start_pool(ctx, workers: int, enc_args):
    """The encoding pool, its workers started with SIGTERM and SIGINT blocked until
    _init_worker has reset their handlers. Between the fork and that reset a worker still
    has the caller's handlers: a pool.terminate() in that window (input that fails at
    once, with workers still starting) reached a handler that does not exit, and the
    worker lived on, waiting for tasks, with terminate() joining it for ever (seen: 2 of 4
    loops of 300 runs hung under load, 2026-12-07). Blocked, the signal waits and ends
    the worker as soon as the reset unblocks it. The caller's own thread gets its mask back
    at once, so a signal sent to it meanwhile reaches its handler then."""
    if not hasattr(signal, "pthread_sigmask"):
        return ctx.Pool(workers, initializer=_init_worker, initargs=(enc_args,))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _POOL_SIGNALS)
    try:
        return ctx.Pool(workers, initializer=_init_worker, initargs=(enc_args,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _encode_in_worker(chunk):
    return _WORKER_ENCODER(chunk)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def preprocess(input_path: str, output_prefix: str, tokenizer_model: str,
               json_keys=("text",), tokenizer_type: str = "SentencePieceTokenizer",
               append_eod: bool = False, workers: int = 1, partitions: int = 1,
               log_interval: int = 1000, dtype: str = "auto", log=_log,
               vocab_file: str | None = None, merge_file: str | None = None) -> PreprocessStats:
    """Tokenize `input_path` into `{output_prefix}_{key}_document.bin/.idx` per json key.
    `vocab_file`/`merge_file` are GPT2BPETokenizer's (then `tokenizer_model` is unused)."""
    if workers < 1 or partitions < 1:
        raise DataError("--workers and --partitions must be at least 1")
    if not json_keys:
        raise DataError("--json-keys is empty; name at least one key, e.g. --json-keys text")
    if output_prefix.endswith(("/", os.sep)):  # would write DIR/_text_document.bin
        raise DataError(f"--output-prefix {output_prefix!r} ends in a path separator; give a "
                        f"file name prefix, e.g. {os.path.join(output_prefix, 'corpus')}")
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_file,
                                merge_file)  # fail early, in the parent
    np_dtype = resolve_dtype(dtype, tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    if os.path.getsize(_checked_input(input_path)) == 0:
        raise DataError(f"{input_path}: empty input (0 bytes); give a jsonl file with one "
                        "JSON object per line")

    t0 = time.perf_counter()  # the clock includes starting the workers
    enc_args = (input_path, list(json_keys), tokenizer_type, tokenizer_model, append_eod, np_dtype,
                vocab_file, merge_file)
    stats = PreprocessStats(empty=dict.fromkeys(json_keys, 0), tokens=dict.fromkeys(json_keys, 0))
    writers = {}
    pool = None
    try:
        if workers > 1:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            pool = _start_pool(ctx, workers, enc_args)
        encode = ChunkEncoder(*enc_args) if pool is None else None
        for k in json_keys:
            writers[k] = IndexedDatasetWriter(output_prefix_for(output_prefix, k), np_dtype)
        ranges = _partition_ranges(input_path, partitions)
        for start, stop in ranges:
            if len(ranges) == 1:
                _encode_range(input_path, start, stop, pool, encode, writers, stats, t0,
                              log_interval, log)
                continue
            parts = {k: IndexedDatasetWriter(f"{w.prefix}.part{start}", np_dtype)
                     for k, w in writers.items()}  # temp names only; merged, then deleted
            try:
                _encode_range(input_path, start, stop, pool, encode, parts, stats, t0,
                              log_interval, log)
                for k, part in parts.items():
                    writers[k].append_writer(part)
            finally:
                for part in parts.values():
                    part.abort()
        if stats.documents == 0:
            raise DataError(f"{input_path}: empty input: no JSON documents found; give one "
                            "JSON object per line")
        for k in json_keys:
            if writers[k].num_documents == 0:
                raise DataError(f"{input_path}: all {stats.documents} documents have empty "
                                f"text under key {k!r}; check --json-keys")
        for w in writers.values():
            w.finish()
        for w in writers.values():
            w.commit()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    stats.seconds = time.perf_counter() - t0
    stats.outputs = {k: w.prefix for k, w in writers.items()}
    r = stats.rates()
    log(f"Done: {stats.documents} documents, {sum(stats.tokens.values())} tokens, "
        f"{stats.bytes / 1e6:.2f} MB in {stats.seconds:.2f} s ({r['docs_per_s']:.1f} docs/s, "
        f"{r['mb_per_s']:.2f} MB/s, {r['tokens_per_s']:.0f} tokens/s); empty documents skipped: "
        + ", ".join(f"{k}={v}" for k, v in stats.empty.items()))
    return stats


def _checked_input(path: str) -> str:
    open_input(path).close()  # existence, permissions
    return path


def _partition_ranges(path: str, partitions: int) -> list:
    if partitions == 1:
        return [(0, None)]
    n = count_lines(path)
    bounds = [n * p // partitions for p in range(partitions + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a] or [(0, None)]


def _encode_range(path, start, stop, pool, encode, writers, stats, t0, log_interval, log):
    # Chunks no larger than the log interval, so progress lines come when asked for.
    chunk_docs = min(CHUNK_DOCS, log_interval) if log_interval > 0 else CHUNK_DOCS
    chunks = iter_chunks(path, start, stop, chunk_docs,
                         by_range=pool is not None and not is_gzip(path))
    results = pool.imap(_encode_in_worker, chunks) if pool is not None else map(encode, chunks)
    next_log = (stats.documents // log_interval + 1) * log_interval if log_interval > 0 else None
    for res in results:
        if res[0] == "error":
            raise DataError(res[1])
        _, out, empty, docs, nbytes = res
        for k, (parts, lengths) in out.items():
            writers[k].add_documents(parts, lengths)
            stats.tokens[k] += int(sum(p.size for p in parts))
            stats.empty[k] += empty[k]
        stats.documents += docs
        stats.bytes += nbytes
        if next_log is not None and stats.documents >= next_log:
            dt = max(time.perf_counter() - t0, 1e-9)
            log(f"Processed {stats.documents} documents ({stats.documents / dt:.1f} docs/s, "
                f"{stats.bytes / dt / 1e6:.2f} MB/s, {sum(stats.tokens.values()) / dt:.0f} tokens/s).")
            next_log = (stats.documents // log_interval + 1) * log_interval
