"""The built-in corpus: the Python standard library's own text, no download.

`ensure_builtin_corpus()` builds, on first use, into `<cache_dir>/builtin-v1-.../`:
  corpus.jsonl                 one document per source file ({"text", "path"})
  tokenizer.model / .vocab     SentencePiece BPE trained on it (small vocab, seconds)
  corpus_text_document.bin/.idx   preprocessed with --append-eod
  manifest.json                written last; its presence means the build is complete
and returns (data_prefix, tokenizer_model). Files are the `.py`, `.txt` and `.rst`
files under `sysconfig.get_paths()["stdlib"]`, in sorted path order, skipping tests,
site-packages and files over 256 KB, until `max_bytes` of text: deterministic for a
given Python installation.

Concurrent callers (several ranks on one machine) take turns on a file lock; the
build happens in a temporary directory renamed into place, so a crashed build leaves
nothing that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import time

from megaq.data.fsutil import FileLock, atomic_write

BUILTIN_VERSION = 1
SUFFIXES = (".py", ".txt", ".rst")
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test",
             "lib2to3", "ensurepip", "turtledemo"}
MAX_FILE_BYTES = 256 * 1024
DEFAULT_MAX_BYTES = 4_000_000
DEFAULT_VOCAB = 4096


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_cache_dir() -> str:
    """$MEGAQ_DATA_CACHE, else <repo>/data_cache."""
    return os.environ.get("MEGAQ_DATA_CACHE") or os.path.join(repo_root(), "data_cache")


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None) -> list[tuple[str, str]]:
    """[(path relative to root, text)] in sorted order, up to max_bytes of UTF-8."""
    root = root or sysconfig.get_paths()["stdlib"]
    picked, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(SUFFIXES):
                continue
            path = os.path.join(dirpath, name)
            try:
                if os.path.getsize(path) > MAX_FILE_BYTES:
                    continue
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            if not text.strip():
                continue
            picked.append((os.path.relpath(path, root), text))
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                return picked
    return picked


def write_corpus_jsonl(out_path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """Write the stdlib corpus as jsonl (atomically); return {'documents', 'bytes'}."""
    files = stdlib_files(max_bytes)
    if not files:
        from megaq.data.errors import DataError
        raise DataError(f"{sysconfig.get_paths()['stdlib']}: no standard-library text found for "
                        "the built-in corpus; use your own corpus with --data-path")
    with atomic_write(out_path, "w") as f:
        for rel, text in files:
            f.write(json.dumps({"text": text, "path": rel}) + "\n")
    return {"documents": len(files), "bytes": sum(len(t.encode()) for _, t in files)}


def _build(dest: str, vocab_size: int, max_bytes: int, log) -> None:
    from megaq.data.errors import DataError
    from megaq.data.preprocess import preprocess
    from megaq.data.tokenizer_training import VocabTooSmall, train_sentencepiece

    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        t0 = time.perf_counter()
        corpus = os.path.join(tmp, "corpus.jsonl")
        info = write_corpus_jsonl(corpus, max_bytes)
        log(f"[builtin] corpus: {info['documents']} stdlib files, {info['bytes'] / 1e6:.1f} MB")
        try:
            model = train_sentencepiece([corpus], os.path.join(tmp, "tokenizer"), vocab_size,
                                        "bpe", num_threads=1, log=log)
        except VocabTooSmall as e:  # its message names our temp file and a flag we lack
            need = f"at least {e.needed} ids" if e.needed else "more ids"
            raise DataError(f"--vocab-size {vocab_size} is too small for the built-in corpus: "
                            f"its characters and byte fallback need {need}; pass a larger "
                            f"--vocab-size (default {DEFAULT_VOCAB})") from None
        preprocess(corpus, os.path.join(tmp, "corpus"), model, append_eod=True, workers=1,
                   log_interval=0, log=log)
        with atomic_write(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump({"version": BUILTIN_VERSION, "python": sys.version.split()[0],
                       "stdlib": sysconfig.get_paths()["stdlib"], "vocab_size": vocab_size,
                       "max_bytes": max_bytes, **info,
                       "build_seconds": round(time.perf_counter() - t0, 2)}, f, indent=1)
        try:
            os.rename(tmp, dest)
        except OSError:  # another machine's builder got there first: keep theirs
            if not os.path.exists(os.path.join(dest, "manifest.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_builtin_corpus(cache_dir: str | None = None, vocab_size: int = DEFAULT_VOCAB,
                          max_bytes: int = DEFAULT_MAX_BYTES, log=None) -> tuple[str, str]:
    """Build the built-in corpus and tokenizer on first use; -> (data_prefix, tokenizer_model).

    Safe to call from every rank at once: one builds under a file lock, the others
    wait and reuse it."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    dest = os.path.join(cache_dir, f"builtin-v{BUILTIN_VERSION}-vocab{vocab_size}-{max_bytes}")
    result = (os.path.join(dest, "corpus_text_document"), os.path.join(dest, "tokenizer.model"))
    if os.path.exists(os.path.join(dest, "manifest.json")):
        return result
    try:
        os.makedirs(cache_dir, exist_ok=True)
        probe = os.path.join(cache_dir, ".builtin.lock")
        open(probe, "a").close()
    except OSError as e:
        from megaq.data.errors import DataError
        raise DataError(f"{cache_dir}: cannot write the built-in corpus cache ({e.strerror}); "
                        "pass another cache_dir or set MEGAQ_DATA_CACHE") from None
    with FileLock(probe):
        if not os.path.exists(os.path.join(dest, "manifest.json")):
            shutil.rmtree(dest, ignore_errors=True)  # an incomplete copy from elsewhere
            log(f"[builtin] building corpus and tokenizer in {dest}")
            _build(dest, vocab_size, max_bytes, log)
    return result
