"""Train a SentencePiece tokenizer (BPE or unigram) from jsonl or text files.

  python tools/train_tokenizer.py --input corpus.jsonl --json-keys text \
      --model-prefix tok --vocab-size 8000 [--model-type bpe|unigram] [--no-byte-fallback] \
      [--user-defined-symbols '<EOD>' '<MASK>']

Writes tok.model and tok.vocab. See docs/DATA.md.
"""

import os

from megaq.data.errors import ArgumentParser, run_cli
from megaq.data.tokenizer_training import train_sentencepiece


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="jsonl (.jsonl/.json, optionally .gz) or plain text files")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys read from jsonl inputs")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false",
                   help="disable byte fallback (unknown characters then map to <unk>)")
    p.add_argument("--user-defined-symbols", nargs="*", default=["<EOD>"],
                   help="special tokens kept whole; <EOD> is the end-of-document id")
    p.add_argument("--normalization", default="identity",
                   choices=["identity", "nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf"],
                   help="identity keeps text byte-exact (decode(encode(x)) == x)")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="sample at most this many lines for training")
    p.add_argument("--max-sentence-length", type=int, default=4192,
                   help="lines longer than this many bytes are cut into pieces")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's own log")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    train_sentencepiece(a.input, a.model_prefix, a.vocab_size, a.model_type, a.json_keys,
                        a.byte_fallback, a.user_defined_symbols, a.character_coverage,
                        a.input_sentence_size, a.max_sentence_length, a.threads, a.seed,
                        a.verbose, a.normalization)


def cli() -> int:
    """The `megaq-train_tokenizer` command and tools/train_tokenizer.py."""
    return run_cli(main)
