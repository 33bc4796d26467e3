#!/usr/bin/env python
"""Peak memory of tools/preprocess_data.py on one long document.

  python tools/bench/bench_long_document.py [--mb 50] [--workers 1 2]
      [--tokenizer-model tok.model] [--repo OTHER_CHECKOUT] [--out bench.json]

Builds one jsonl line holding an --mb megabyte document (the built-in corpus's text,
repeated: code and prose, some non-ASCII), between two short documents, and runs the
preprocessing tool of --repo (default: this checkout; pass an older checkout to measure
"before") on it in a fresh process per run. The peak RSS is the tool process's
(getrusage RUSAGE_CHILDREN of a wrapper whose only child it is); the baseline is the
same tool on a tiny input (interpreter, numpy, the tokenizer). Prints peak / document
size and (peak - baseline) / document size; writes JSON with --out.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
REPO = _checkout.ROOT

WRAPPER = ("import resource, subprocess, sys; "
           "subprocess.run([sys.executable] + sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
           "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def peak_rss(repo: str, argv: list) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of `repo`'s tools/preprocess_data.py on argv."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", WRAPPER, os.path.join(repo, "tools", "preprocess_data.py"),
                          *map(str, argv)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": repo})
    return int(out.stdout.split()[-1]) * 1024, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=50.0, help="document size in MB (10^6 bytes)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokenizer-model", help="SentencePiece model (default: the built-in one)")
    p.add_argument("--repo", default=REPO, help="checkout whose tools/preprocess_data.py runs")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)

    from megaq.data.builtin import ensure_builtin_corpus
    prefix, model = ensure_builtin_corpus()
    model = a.tokenizer_model or model
    corpus = os.path.join(os.path.dirname(prefix), "corpus.jsonl")
    text = "".join(json.loads(line)["text"] for line in open(corpus, "rb"))
    size = int(a.mb * 1e6)
    tmp = tempfile.mkdtemp(prefix="megaq_bench_long_")
    rows = []
    try:
        long_path, tiny_path = os.path.join(tmp, "long.jsonl"), os.path.join(tmp, "tiny.jsonl")
        with open(long_path, "w") as f:
            doc = (text * (size // len(text) + 1))[:size]
            for d in ("a short first document", doc, "a short last document"):
                f.write(json.dumps({"text": d}) + "\n")
        nbytes = len(doc.encode("utf-8"))
        del doc, text
        with open(tiny_path, "w") as f:
            f.write(json.dumps({"text": "a b c"}) + "\n")
        for w in a.workers:
            common = ["--tokenizer-model", model, "--append-eod", "--workers", w]
            base, _ = peak_rss(a.repo, ["--input", tiny_path, "--output-prefix",
                                        os.path.join(tmp, "tiny"), *common])
            peak, secs = peak_rss(a.repo, ["--input", long_path, "--output-prefix",
                                           os.path.join(tmp, "long"), *common])
            rows.append({"workers": w, "document_bytes": nbytes, "peak_rss": peak,
                         "baseline_rss": base, "seconds": secs, "peak_over_size": peak / nbytes,
                         "above_baseline_over_size": (peak - base) / nbytes})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"document: {nbytes / 1e6:.1f} MB (UTF-8); tokenizer {model}; tool of {a.repo}")
    print(f"{'workers':>8}{'peak MiB':>10}{'baseline MiB':>14}{'peak/size':>11}"
          f"{'(peak-base)/size':>18}{'seconds':>9}")
    for r in rows:
        print(f"{r['workers']:>8}{r['peak_rss'] / 2**20:>10.0f}{r['baseline_rss'] / 2**20:>14.0f}"
              f"{r['peak_over_size']:>10.1f}x{r['above_baseline_over_size']:>17.1f}x"
              f"{r['seconds']:>9.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"repo": a.repo, "tokenizer_model": model, "machine": platform.platform(),
                       "python": sys.version.split()[0], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
