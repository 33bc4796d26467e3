"""DataConfig: where training samples come from (pretrain_gpt.py's data flags)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from megaq.data.blending import parse_data_path
from megaq.data.errors import DataError
from megaq.data.gpt_dataset import parse_split
from megaq.flags import flag, switch

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "NullTokenizer")
MOCK_VOCAB_SIZE = 1024  # vocab of --mock-data and of the NullTokenizer without --vocab-size


@dataclass(frozen=True)
class DataConfig:
    FLAG_GROUP: ClassVar[str] = "data"

    data_path: tuple[str, ...] | None = flag(
        "--data-path", "prefix, or weight prefix weight prefix ... (blending)", nargs="*",
        value=lambda a: tuple(a.data_path) if a.data_path else None)
    split: str = flag("--split", "train,valid,test proportions", "969,30,1")
    data_cache_path: str | None = flag("--data-cache-path", "where dataset index caches go")
    mock_data: bool = switch("--mock-data", "synthetic tokens, no files")
    demo_corpus: str | None = flag(
        "--demo-corpus", "use the built-in corpus (Python stdlib text) and its tokenizer, "
        "building them in DIR (default $MEGAQ_DATA_CACHE or <repo>/data_cache) if missing",
        nargs="?", const="", metavar="DIR")
    tokenizer_type: str = flag(
        "--tokenizer-type",
        "tokenizer of --data-path (NullTokenizer: ids as they are, needs --vocab-size)",
        "SentencePieceTokenizer", choices=list(TOKENIZER_TYPES))
    tokenizer_model: str | None = flag("--tokenizer-model", "SentencePiece .model file")
    vocab_size: int | None = flag(
        "--vocab-size", f"vocab of the NullTokenizer / --mock-data (default {MOCK_VOCAB_SIZE})",
        type=int)

    def __post_init__(self):
        sources = sum(bool(x) for x in (self.data_path, self.mock_data,
                                        self.demo_corpus is not None))
        if sources == 0:
            raise DataError("no training data: pass --data-path PREFIX (with --tokenizer-model), "
                            "--demo-corpus, or --mock-data")
        if sources > 1:
            raise DataError("pass only one of --data-path, --demo-corpus and --mock-data")
        if self.data_path:
            if self.tokenizer_type != "NullTokenizer" and not self.tokenizer_model:
                raise DataError(f"--tokenizer-type {self.tokenizer_type} needs --tokenizer-model "
                                f"PATH (the SentencePiece .model used to preprocess --data-path)")
            if self.tokenizer_type == "NullTokenizer" and not self.vocab_size:
                raise DataError("--tokenizer-type NullTokenizer needs --vocab-size N (the ids in "
                                "--data-path are below N)")
            parse_data_path(list(self.data_path))
        parse_split(self.split)

    def with_built_corpus(self, prefix: str, tokenizer_model: str) -> "DataConfig":
        """--demo-corpus once built: from here on an ordinary --data-path with its
        SentencePiece model (what a checkpoint records and tools/generate.py reads)."""
        return dataclasses.replace(self, demo_corpus=None, data_path=(prefix,),
                                   tokenizer_model=tokenizer_model,
                                   tokenizer_type="SentencePieceTokenizer")
