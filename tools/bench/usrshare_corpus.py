"""A held-out text corpus from this machine: /usr/share/common-licenses and the
/usr/share/doc/*/copyright files (license and copyright prose, nothing downloaded).

    python tools/bench/usrshare_corpus.py --out /tmp/usrshare/usrshare.jsonl
    python tools/train_tokenizer.py --input /tmp/usrshare/usrshare.jsonl --json-keys text \\
        --model-prefix /tmp/usrshare/tok --vocab-size 4096
    python tools/preprocess_data.py --input /tmp/usrshare/usrshare.jsonl --json-keys text \\
        --output-prefix /tmp/usrshare/usrshare --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model /tmp/usrshare/tok.model --append-eod --workers 1
    # then: tools/bench/convergence.py --data-path /tmp/usrshare/usrshare_text_document \\
    #           --tokenizer-model /tmp/usrshare/tok.model

Used by docs/FIDELITY.md ("qgZ fidelity: the harness") as the corpus the qgZ defaults were not
tuned on. Files in sorted order, one JSON document each, texts under 200 characters
skipped, until --max-bytes of text (deterministic for a given system image).
"""

from __future__ import annotations

import argparse
import os
import sys

from corpus_jsonl import write_text_jsonl  # noqa: E402


def sources(root: str = "/usr/share") -> list[str]:
    lic = os.path.join(root, "common-licenses")
    files = [os.path.join(lic, f) for f in sorted(os.listdir(lic))] if os.path.isdir(lic) else []
    doc = os.path.join(root, "doc")
    if os.path.isdir(doc):
        files += [os.path.join(doc, d, "copyright") for d in sorted(os.listdir(doc))]
    return [f for f in files if os.path.isfile(f) and not os.path.islink(f)]


def file_text(path: str) -> str:
    with open(path, errors="replace") as fh:
        return fh.read().strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="jsonl to write")
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--root", default="/usr/share")
    a = p.parse_args(argv)
    files = sources(a.root)
    if not files:
        print(f"error: no license or copyright files under {a.root}; pass --root", file=sys.stderr)
        return 2
    docs, total = write_text_jsonl(a.out, files, file_text, a.max_bytes)
    print(f"wrote {a.out}: {docs} documents, {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
