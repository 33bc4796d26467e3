"""SentencePiece tokenizer wrapper with the ids the training loop needs.

`eod` (end of document, appended by `--append-eod` and used as a separator) is the
id of the piece `<EOD>` when the model has one (tools/train_tokenizer.py adds it by
default, and Megatron-LM's SentencePieceTokenizer resolves `<EOD>` to the same id),
otherwise the model's `</s>` (eos) id. `pad` is the model's pad id, or `eod` when the
model has none. `vocab_size` is the number of pieces in the model.
"""

from __future__ import annotations

import os

from megaq.data.errors import DataError

SUPPORTED_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
EOD_PIECE = "<EOD>"


class SentencePieceTokenizer:
    """`tokenize(text) -> list[int]`, `detokenize(ids) -> str`, plus vocab_size/eod/pad."""

    def __init__(self, model_path: str):
        import sentencepiece as spm

        self.model_path = model_path
        if not model_path:
            raise DataError("no tokenizer model given; pass --tokenizer-model PATH "
                            "(train one with tools/train_tokenizer.py)")
        if not os.path.isfile(model_path):
            raise DataError(f"{model_path}: tokenizer model not found; check --tokenizer-model "
                            "or train one with tools/train_tokenizer.py")
        if not os.access(model_path, os.R_OK):
            raise DataError(f"{model_path}: tokenizer model is not readable; fix its permissions")
        try:
            with open(model_path, "rb") as f:
                proto = f.read()
            self.sp = spm.SentencePieceProcessor(model_proto=proto)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{model_path}: not a valid SentencePiece model ({e}); "
                            "pass the .model file written by tools/train_tokenizer.py") from None
        self.vocab_size = int(self.sp.get_piece_size())
        if self.vocab_size == 0:
            raise DataError(f"{model_path}: SentencePiece model has an empty vocabulary; retrain it")
        eod = self.sp.piece_to_id(EOD_PIECE)
        if eod == self.sp.unk_id() or self.sp.id_to_piece(eod) != EOD_PIECE:
            eod = self.sp.eos_id()
        if eod < 0:
            raise DataError(f"{model_path}: model has neither an '{EOD_PIECE}' piece nor an eos id; "
                            "retrain with tools/train_tokenizer.py (adds <EOD>)")
        self.eod = int(eod)
        pad = self.sp.pad_id()
        self.pad = int(pad) if pad >= 0 else self.eod

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # One thread: parallelism comes from worker processes, and SentencePiece's own
        # default would grab every core in every worker.
        return self.sp.encode(texts, num_threads=1)

    def detokenize(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def __repr__(self):
        return (f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size}, "
                f"eod={self.eod}, pad={self.pad})")


def build_tokenizer(tokenizer_type: str, tokenizer_model: str) -> SentencePieceTokenizer:
    """Megatron's `--tokenizer-type` / `--tokenizer-model` -> tokenizer object."""
    if tokenizer_type not in SUPPORTED_TYPES:
        raise DataError(f"--tokenizer-type {tokenizer_type!r} is not supported; "
                        f"use one of {', '.join(SUPPORTED_TYPES)}")
    return SentencePieceTokenizer(tokenizer_model)
