"""The write loop shared by the held-out corpus builders (pod_corpus.py, usrshare_corpus.py):
one JSON document {"text": ...} a line, texts under a minimum length skipped, stopping
once the byte cap is reached, written to a temporary name and renamed into place."""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
from megaq.data.fsutil import atomic_write  # noqa: E402

MIN_CHARS = 200  # shorter texts are stubs (no POD, an empty copyright file), not prose


def write_text_jsonl(out_path: str, files: Iterable[str], read: Callable[[str], str | None],
                     max_bytes: int, min_chars: int = MIN_CHARS) -> tuple[int, int]:
    """Write read(f) for each file in order; return (documents, bytes of text).

    `read` returns the stripped text or None when the file has none; it is not called
    once max_bytes of text are written (reading may be costly: a pod2text run)."""
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    total = docs = 0
    with atomic_write(out_path, "w") as out:
        for f in files:
            if total >= max_bytes:
                break
            text = read(f)
            if text is None or len(text) < min_chars:
                continue
            out.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode())
            docs += 1
    return docs, total
