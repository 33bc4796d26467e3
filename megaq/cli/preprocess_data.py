"""Tokenize jsonl into Megatron-LM's indexed dataset (.bin/.idx), Megatron's CLI.

  python tools/preprocess_data.py --input corpus.jsonl[.gz] --json-keys text \
      --output-prefix out/corpus --tokenizer-type SentencePieceTokenizer \
      --tokenizer-model tok.model --append-eod --workers 8

  (or --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file
   gpt2-merges.txt, or --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR, or
   --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model: <s> before each
   document)

Writes out/corpus_text_document.bin/.idx (readable by Megatron-LM's IndexedDataset);
train with --data-path out/corpus_text_document. See docs/DATA.md.
"""

import sys

from megaq.data.errors import ArgumentParser, DataError, run_cli
from megaq.data.preprocess import preprocess
from megaq.data.tokenizer import (
    DEFAULT_TYPE, SUPPORTED_TYPES, check_tokenizer_flags, infer_tokenizer_type, inferred_type_note)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="jsonl file, one JSON object per line (.gz ok)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize")
    g.add_argument("--split-sentences", action="store_true", help="not supported (Megatron flag)")
    g.add_argument("--keep-newlines", action="store_true", help="accepted; newlines are always kept")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None, choices=SUPPORTED_TYPES,
                   help=f"Megatron's tokenizer types (default {DEFAULT_TYPE}, or GPT2BPETokenizer "
                        "when --vocab-file and --merge-file are given: inferred, with a note)")
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model file, or a local HuggingFace tokenizer directory "
                        "(HuggingFaceTokenizer)")
    g.add_argument("--vocab-file", default=None,
                   help="GPT2BPETokenizer: GPT-2's vocab (encoder.json: token -> id)")
    g.add_argument("--merge-file", default=None,
                   help="GPT2BPETokenizer: GPT-2's merges (vocab.bpe)")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document id (<EOD>, </s> or <|endoftext|>: the "
                        "tokenizer's) to each document")
    g.add_argument("--dtype", default="auto", choices=["auto", "uint16", "int32", "int64"],
                   help="token dtype in .bin; auto = uint16 below 65,500 ids else int32 (Megatron)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--partitions", type=int, default=1,
                   help="encode the input in this many contiguous parts and merge them")
    g.add_argument("--log-interval", type=int, default=1000, help="progress every N documents")
    g = p.add_argument_group("Megatron-LM flags accepted for compatibility")
    for name, why, takes in _NOTED:
        g.add_argument(name, default=None, help=f"accepted, no effect: {why}",
                       **({"action": "store_true"} if takes is None else {}))
    g.add_argument("--dataset-impl", default=None, help="mmap only (older Megatron-LM's "
                   "flag): megaq writes the memory-mapped .bin/.idx format; lazy / cached "
                   "are refused")
    return p.parse_args(argv)


# Megatron-LM's preprocessing flags that change nothing here: (flag, why, takes)
_NOTED = (
    ("--lang", "it picks the sentence splitter of --split-sentences, which megaq refuses",
     "str"),
    ("--keep-sequential-samples", "megaq's --partitions are contiguous parts of the input, "
     "merged in order: documents always keep their input order", None),
    ("--vocab-size", "the tokenizer's files give the vocabulary (Megatron reads it for the "
     "NullTokenizer only, which preprocessing has no use for)", "int"),
    ("--legacy-tokenizer", "megaq has one implementation of each tokenizer type", None),
)


def _megatron_notes(a) -> str | None:
    """Refuse --dataset-impl other than mmap; the one note line naming the flags given
    that change nothing (None when there are none)."""
    if a.dataset_impl not in (None, "mmap"):
        raise DataError(f"--dataset-impl {a.dataset_impl}: megaq writes only Megatron's mmap "
                        f"format (.bin/.idx, what current Megatron-LM reads); drop the flag")
    given = [name for name, _, _ in _NOTED
             if getattr(a, name[2:].replace("-", "_")) not in (None, False)]
    given += ["--dataset-impl"] if a.dataset_impl else []
    return (f"note: {len(given)} Megatron-LM flag(s) accepted without effect: "
            f"{', '.join(given)} (why: --help)") if given else None


def main(argv=None):
    a = parse_args(argv)
    if a.split_sentences:
        raise DataError("--split-sentences is not supported (documents are kept whole); drop it")
    note = _megatron_notes(a)
    if note:
        print(note, file=sys.stderr, flush=True)
    given = (a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file)
    a.tokenizer_type = infer_tokenizer_type(*given)
    note = inferred_type_note(*given)
    if note:
        print(note, file=sys.stderr, flush=True)
    check_tokenizer_flags(a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file)
    preprocess(a.input, a.output_prefix, a.tokenizer_model, a.json_keys, a.tokenizer_type,
               a.append_eod, a.workers, a.partitions, a.log_interval, a.dtype,
               vocab_file=a.vocab_file, merge_file=a.merge_file)


def cli() -> int:
    """The `megaq-preprocess_data` command and tools/preprocess_data.py."""
    return run_cli(main)
