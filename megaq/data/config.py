"""DataConfig: where training samples come from (pretrain_gpt.py's data flags)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from megaq.data.blending import parse_data_path
from megaq.data.errors import DataError
from megaq.data.gpt_dataset import parse_split
from megaq.data.tokenizer import (DEFAULT_TYPE, SUPPORTED_TYPES, check_tokenizer_flags,
                                   infer_tokenizer_type)
from megaq.config.flags import flag, set_derived, switch

TOKENIZER_TYPES = SUPPORTED_TYPES + ("NullTokenizer",)
MOCK_VOCAB_SIZE = 1024  # vocab of --mock-data and of the NullTokenizer without --vocab-size
DEFAULT_SPLIT = "969,30,1"  # --split's default with --data-path


@dataclass(frozen=True)
class DataConfig:
    FLAG_GROUP: ClassVar[str] = "data"

    data_path: tuple[str, ...] | None = flag(
        "--data-path", "prefix, or weight prefix weight prefix ... (blending)", nargs="*",
        value=lambda a: tuple(a.data_path) if a.data_path else None)
    train_data_path: tuple[str, ...] | None = flag(
        "--train-data-path", "the training split's own blend (prefix, or weight prefix ...), "
        "used whole; instead of --data-path and --split", nargs="*",
        value=lambda a: tuple(a.train_data_path) if a.train_data_path else None)
    valid_data_path: tuple[str, ...] | None = flag(
        "--valid-data-path", "the validation split's own blend (with --train-data-path; "
        "without it there is no validation)", nargs="*",
        value=lambda a: tuple(a.valid_data_path) if a.valid_data_path else None)
    test_data_path: tuple[str, ...] | None = flag(
        "--test-data-path", "the test split's own blend (with --train-data-path)", nargs="*",
        value=lambda a: tuple(a.test_data_path) if a.test_data_path else None)
    # None on the command line: DEFAULT_SPLIT with --data-path; with the per-split paths
    # there is no split (Megatron refuses --split with them too).
    split: str | None = flag("--split", f"train,valid,test proportions of --data-path "
                             f"(default {DEFAULT_SPLIT})", value=lambda a: a.split)
    data_cache_path: str | None = flag("--data-cache-path", "where dataset index caches go")
    mock_data: bool = switch("--mock-data", "synthetic tokens, no files")
    demo_corpus: str | None = flag(
        "--demo-corpus", "use the built-in corpus (Python stdlib text) and its tokenizer, "
        "building them in DIR (default $MEGAQ_DATA_CACHE or <repo>/data_cache) if missing",
        nargs="?", const="", metavar="DIR")
    # left out: inferred from the other tokenizer flags (GPT-2 BPE from --vocab-file and
    # --merge-file; megatron_flags prints the note), else the default
    tokenizer_type: str = flag(
        "--tokenizer-type",
        f"tokenizer of --data-path (default {DEFAULT_TYPE}, or GPT2BPETokenizer when "
        "--vocab-file and --merge-file are given; NullTokenizer: ids as they are, needs "
        "--vocab-size)", DEFAULT_TYPE, choices=list(TOKENIZER_TYPES),
        value=lambda a: infer_tokenizer_type(a.tokenizer_type, a.tokenizer_model, a.vocab_file,
                                             a.merge_file))
    tokenizer_model: str | None = flag(
        "--tokenizer-model", "SentencePiece .model file, or a local HuggingFace tokenizer "
        "directory (HuggingFaceTokenizer)")
    vocab_file: str | None = flag(
        "--vocab-file", "GPT2BPETokenizer: GPT-2's vocab (encoder.json: token -> id)")
    merge_file: str | None = flag("--merge-file", "GPT2BPETokenizer: GPT-2's merges (vocab.bpe)")
    eod_mask_loss: bool = switch(
        "--eod-mask-loss", "no loss on the token after each end-of-document token (inputs "
        "equal to the tokenizer's eod id get loss mask 0, as in Megatron)")
    vocab_size: int | None = flag(
        "--vocab-size", f"vocab of the NullTokenizer / --mock-data (default {MOCK_VOCAB_SIZE})",
        type=int)

    @property
    def per_split_paths(self) -> tuple | None:
        """(train, valid, test) blends of --train/valid/test-data-path, or None."""
        paths = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return paths if any(paths) else None

    def __post_init__(self):
        per_split = self.per_split_paths
        if per_split and self.data_path:
            raise DataError("--data-path and --train/--valid/--test-data-path are both given; "
                            "pass --data-path (cut by --split) or the per-split paths, not both")
        if per_split and self.split is not None:
            raise DataError(f"--split {self.split} does not apply to --train/--valid/--test-data-"
                            f"path (each split's blend is used whole); drop --split")
        if per_split and not self.train_data_path:
            raise DataError("--valid-data-path / --test-data-path need --train-data-path "
                            "(the training blend)")
        if self.split is None and not per_split:
            set_derived(self, split=DEFAULT_SPLIT)
        sources = sum(bool(x) for x in (self.data_path or per_split, self.mock_data,
                                        self.demo_corpus is not None))
        if sources == 0:
            raise DataError("no training data: pass --data-path PREFIX (with --tokenizer-model), "
                            "--demo-corpus, or --mock-data")
        if sources > 1:
            raise DataError("pass only one of --data-path (or --train-data-path), --demo-corpus "
                            "and --mock-data")
        if self.data_path or per_split:
            check_tokenizer_flags(self.tokenizer_type, self.tokenizer_model, self.vocab_file,
                                  self.merge_file, "used to preprocess the data")
            if self.tokenizer_type == "NullTokenizer" and not self.vocab_size:
                raise DataError("--tokenizer-type NullTokenizer needs --vocab-size N (the ids in "
                                "the data are below N)")
            if self.data_path:
                parse_data_path(list(self.data_path))
            for name, path in zip(("train", "valid", "test"), per_split or ()):
                if path:
                    parse_data_path(list(path), f"--{name}-data-path")
        if self.split is not None:
            parse_split(self.split)

    def with_built_corpus(self, prefix: str, tokenizer_model: str) -> "DataConfig":
        """--demo-corpus once built: from here on an ordinary --data-path with its
        SentencePiece model (what a checkpoint records and tools/generate.py reads)."""
        return dataclasses.replace(self, demo_corpus=None, data_path=(prefix,),
                                   tokenizer_model=tokenizer_model,
                                   tokenizer_type="SentencePieceTokenizer")
