"""A held-out text corpus from this machine: Perl's own documentation (POD) under
/usr/share/perl/<version>, rendered to plain text with pod2text (nothing downloaded).

    python tools/bench/pod_corpus.py --out /tmp/pod/pod.jsonl
    python tools/train_tokenizer.py --input /tmp/pod/pod.jsonl --json-keys text \\
        --model-prefix /tmp/pod/tok --vocab-size 4096
    python tools/preprocess_data.py --input /tmp/pod/pod.jsonl --json-keys text \\
        --output-prefix /tmp/pod/pod --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model /tmp/pod/tok.model --append-eod --workers 1
    # then: tools/bench/convergence.py --data-path /tmp/pod/pod_text_document \\
    #           --tokenizer-model /tmp/pod/tok.model

Used by docs/FIDELITY.md ("qgZ square-law code") as a corpus the qgZ code was never
tuned on: English technical prose with code examples, one document per module, unlike
the built-in corpus and unlike the repetitive license texts of usrshare_corpus.py.
Every *.pod and *.pm file under --root in sorted path order; a file whose rendered text
is under 200 characters (no POD) is skipped; stops at --max-bytes of text
(deterministic for a given system image and pod2text).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys

from corpus_jsonl import write_text_jsonl  # noqa: E402


def sources(root: str) -> list[str]:
    files = []
    for dirpath, _, names in os.walk(root):
        files += [os.path.join(dirpath, n) for n in names if n.endswith((".pod", ".pm"))]
    return sorted(f for f in files if os.path.isfile(f) and not os.path.islink(f))


def default_root() -> str | None:
    found = sorted(glob.glob("/usr/share/perl/5.*"))
    return found[-1] if found else None


def pod_text(path: str) -> str | None:
    res = subprocess.run(["pod2text", path], capture_output=True, text=True, errors="replace")
    return res.stdout.strip() if res.returncode == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="jsonl to write")
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--root", default=None, help="default: the newest /usr/share/perl/5.*")
    a = p.parse_args(argv)
    root = a.root or default_root()
    if shutil.which("pod2text") is None:
        print("error: pod2text not found: install perl (it ships pod2text)", file=sys.stderr)
        return 2
    files = sources(root) if root and os.path.isdir(root) else []
    if not files:
        print(f"error: no .pod or .pm files under {root}; pass --root", file=sys.stderr)
        return 2
    docs, total = write_text_jsonl(a.out, files, pod_text, a.max_bytes)
    print(f"wrote {a.out}: {docs} documents, {total / 1e6:.2f} MB from {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
