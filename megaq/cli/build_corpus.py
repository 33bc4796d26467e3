"""Build the built-in corpus (Python standard-library text, no download).

  python tools/build_corpus.py                       # corpus + tokenizer + .bin/.idx in the cache
  python tools/build_corpus.py --cache-dir DIR --vocab-size 4096 --max-bytes 4000000
  python tools/build_corpus.py --jsonl out.jsonl     # only the jsonl

The training job calls megaq.data.builtin.ensure_builtin_corpus(), which does the
same on first use. Prints the --data-path prefix and --tokenizer-model to use.
"""

from megaq.data import builtin
from megaq.data.errors import ArgumentParser, DataError, run_cli


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", default=None,
                   help="default $MEGAQ_DATA_CACHE or <repo>/data_cache")
    p.add_argument("--vocab-size", type=int, default=builtin.DEFAULT_VOCAB)
    p.add_argument("--max-bytes", type=int, default=builtin.DEFAULT_MAX_BYTES)
    p.add_argument("--jsonl", default=None, help="only write the corpus as jsonl to this path")
    a = p.parse_args(argv)
    if a.max_bytes <= 0:  # would build an empty corpus, or one of a single file
        raise DataError(f"--max-bytes {a.max_bytes}: give a positive number of bytes of text "
                        f"(default {builtin.DEFAULT_MAX_BYTES})")
    if a.jsonl:
        info = builtin.write_corpus_jsonl(a.jsonl, a.max_bytes)
        print(f"wrote {a.jsonl}: {info['documents']} documents, {info['bytes'] / 1e6:.2f} MB")
        return
    prefix, model = builtin.ensure_builtin_corpus(a.cache_dir, a.vocab_size, a.max_bytes)
    print(f"--data-path {prefix} --tokenizer-type SentencePieceTokenizer --tokenizer-model {model}")


def cli() -> int:
    """The `megaq-build_corpus` command and tools/build_corpus.py."""
    return run_cli(main)
