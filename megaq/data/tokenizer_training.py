"""Train a SentencePiece model (BPE or unigram) from jsonl or plain text files.

jsonl inputs (`.jsonl`, `.json`, `.jsonl.gz`, `.json.gz`) contribute the strings under
`json_keys`; any other file contributes its lines. Each document is split into lines
(SentencePiece's unit of training text); lines longer than `max_sentence_length`
bytes are cut into pieces rather than silently dropped. The model and its `.vocab`
are written to temporary names and renamed at the end.

Normalisation defaults to `identity` (no NFKC folding, whitespace kept), so that
decode(encode(text)) == text, which code-like corpora need; pass `nmt_nfkc` for
SentencePiece's default behaviour.

Defaults: unk=0, bos=1 (`<s>`), eos=2 (`</s>`), pad=3 (`<pad>`), then the user-defined
symbols (default `<EOD>`, the end-of-document id megaq's tokenizer and Megatron-LM's
SentencePieceTokenizer both look up), byte fallback on, so any text encodes.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time

from megaq.data.errors import DataError
from megaq.data.fsutil import atomic_write

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


class VocabTooSmall(DataError):
    """The vocab cannot hold the characters SentencePiece must cover; `needed` is how
    many ids it asked for (None when its message did not say)."""

    def __init__(self, message: str, needed: int | None):
        super().__init__(message)
        self.needed = needed


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def iter_documents(paths, json_keys=("text",)):
    """Yield (path, line number, text) for every document in the inputs."""
    from megaq.data.preprocess import open_input

    for path in paths:
        is_json = path.endswith(JSON_SUFFIXES)
        with open_input(path) as f:
            for lineno, raw in enumerate(f, 1):
                if not is_json:
                    yield path, lineno, raw.decode("utf-8", errors="replace")
                    continue
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except ValueError as e:
                    raise DataError(f"{path}:{lineno}: malformed JSON ({e}); fix or delete this "
                                    "line (one JSON object per line)") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got "
                                    f"{type(obj).__name__}; write one object per line")
                for k in json_keys:
                    if k not in obj:
                        raise DataError(f"{path}:{lineno}: missing json key {k!r} (keys present: "
                                        f"{', '.join(list(obj)[:8]) or 'none'}); pass --json-keys")
                    if isinstance(obj[k], str):
                        yield path, lineno, obj[k]


def _sentences(docs, max_bytes: int, progress):
    for _, _, text in docs:
        progress(len(text))
        for line in text.splitlines():
            if not line.strip():
                continue  # keep indentation: whitespace is part of the text
            data = line.encode("utf-8")
            if len(data) <= max_bytes:
                yield line
                continue
            for i in range(0, len(data), max_bytes):  # cut, then drop a split UTF-8 tail
                yield data[i:i + max_bytes].decode("utf-8", errors="ignore")


def train_sentencepiece(inputs, model_prefix: str, vocab_size: int, model_type: str = "bpe",
                        json_keys=("text",), byte_fallback: bool = True,
                        user_defined_symbols=("<EOD>",), character_coverage: float = 0.9995,
                        input_sentence_size: int = 2_000_000, max_sentence_length: int = 4192,
                        num_threads: int = 1, seed: int = 1234, verbose: bool = False,
                        normalization: str = "identity", log=_log) -> str:
    """Train and write `{model_prefix}.model` and `.vocab`; return the .model path."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise DataError(f"--model-type {model_type!r} is not supported; use bpe or unigram")
    if vocab_size < 8:
        raise DataError(f"--vocab-size {vocab_size} is too small; use at least a few hundred")
    if not inputs:
        raise DataError("no input files; pass --input FILE [FILE ...]")
    if model_prefix.endswith(("/", os.sep)):  # would write DIR/.model, a hidden file
        raise DataError(f"--model-prefix {model_prefix!r} ends in a path separator; give a file "
                        f"name prefix, e.g. {os.path.join(model_prefix, 'tok')}")
    for p in inputs:
        if not os.path.isfile(p):
            raise DataError(f"{p}: input not found; check --input")
        if os.path.getsize(p) == 0:
            raise DataError(f"{p}: empty input (0 bytes); give a file with text in it")

    # the output directory first: a blocked or unwritable one fails now, not after training
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix + ".model")), exist_ok=True)
    state = {"docs": 0, "chars": 0, "next": time.perf_counter() + 5.0, "t0": time.perf_counter()}

    def progress(nchars):
        state["docs"] += 1
        state["chars"] += nchars
        now = time.perf_counter()
        if now >= state["next"]:
            state["next"] = now + 5.0
            log(f"[train_tokenizer] read {state['docs']} documents, "
                f"{state['chars'] / 1e6:.1f} M characters ({now - state['t0']:.0f} s)")

    sentences = _sentences(iter_documents(inputs, json_keys), max_sentence_length, progress)
    first = next(sentences, None)
    if first is None:
        raise DataError(f"{', '.join(inputs)}: empty input: no text found"
                        + (f" under json keys {list(json_keys)}" if any(
                            p.endswith(JSON_SUFFIXES) for p in inputs) else "")
                        + "; check --input / --json-keys")

    input_error = []  # SentencePiece wraps exceptions from the iterator; keep ours intact

    def all_sentences():
        yield first
        try:
            yield from sentences
        except DataError as e:
            input_error.append(e)

    model = io.BytesIO()
    log(f"[train_tokenizer] training {model_type} vocab={vocab_size} byte_fallback={byte_fallback} "
        f"on {', '.join(inputs)}")
    spm.set_random_generator_seed(seed)  # deterministic sentence sampling
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=all_sentences(), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, byte_fallback=byte_fallback,
            user_defined_symbols=list(user_defined_symbols), character_coverage=character_coverage,
            input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
            max_sentence_length=max_sentence_length, num_threads=num_threads,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3, pad_piece="<pad>", hard_vocab_limit=True,
            # identity: decode(encode(text)) == text, whitespace and newlines included
            # (newlines via byte fallback); SentencePiece's default NFKC would fold them.
            normalization_rule_name=normalization,
            remove_extra_whitespaces=normalization != "identity",
            allow_whitespace_only_pieces=True, split_digits=True,
            minloglevel=0 if verbose else 1)
    except RuntimeError as e:
        if input_error:
            raise input_error[0] from None
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        if "smaller than required_chars" in msg:
            needed = re.search(r"(\d+) vs (\d+)", msg)
            raise VocabTooSmall(
                f"{', '.join(inputs)}: SentencePiece training failed: {msg}; raise --vocab-size "
                "(byte fallback alone takes 256 ids) or lower --character-coverage",
                int(needed.group(2)) if needed else None) from None
        if "Vocabulary size too high" in msg:
            hint = "lower --vocab-size or give more text"
        else:
            hint = "check the options"
        raise DataError(f"{', '.join(inputs)}: SentencePiece training failed: {msg}; {hint}") from None
    if input_error:
        raise input_error[0]
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    model_path = model_prefix + ".model"
    with atomic_write(model_path) as f:
        f.write(model.getvalue())
    with atomic_write(model_prefix + ".vocab", "w") as f:
        for i in range(sp.get_piece_size()):
            f.write(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n")
    log(f"[train_tokenizer] wrote {model_path} ({sp.get_piece_size()} pieces) from "
        f"{state['docs']} documents, {state['chars'] / 1e6:.2f} M characters in "
        f"{time.perf_counter() - state['t0']:.1f} s")
    return model_path
