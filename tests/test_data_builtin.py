"""Built-in corpus: built once on first use, reused, safe under concurrent callers."""

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data_fixtures import REPO, in_forked_children, quiet
from megaq.data.builtin import ensure_builtin_corpus, stdlib_files
from megaq.data.gpt_dataset import build_train_valid_test_datasets
from megaq.data.indexed import IndexedDataset
from megaq.data.tokenizer import build_tokenizer

SMALL = {"vocab_size": 400, "max_bytes": 120_000}


def test_concurrent_first_use_builds_once_and_reuses(tmp_path):
    cache = str(tmp_path / "cache")
    results = in_forked_children(functools.partial(ensure_builtin_corpus, cache, log=quiet, **SMALL),
                                 timeout=120)
    assert len(set(results)) == 1
    prefix, model = results[0]
    build_dir = os.path.dirname(prefix)
    assert sorted(os.listdir(cache)) == [".builtin.lock", os.path.basename(build_dir)]
    manifest = json.load(open(os.path.join(build_dir, "manifest.json")))
    stamp = os.stat(model).st_mtime_ns
    assert ensure_builtin_corpus(cache, log=quiet, **SMALL) == (prefix, model)  # reused
    assert os.stat(model).st_mtime_ns == stamp
    # Contents: the tokenizer decodes the preprocessed documents back to the stdlib text.
    tok = build_tokenizer("SentencePieceTokenizer", model)
    ix = IndexedDataset(prefix)
    files = stdlib_files(SMALL["max_bytes"])
    assert len(ix) == len(files) == manifest["documents"] and tok.vocab_size == 400 + 3  # + Megatron's <CLS> <SEP> <MASK>
    for i in (0, len(ix) - 1):
        doc = np.asarray(ix[i]).tolist()
        assert doc[-1] == tok.eod and tok.detokenize(doc[:-1]) == files[i][1]
    train = build_train_valid_test_datasets([prefix], "98,2,0", 32, 1, (50, 0, 0),
                                            os.path.join(cache, "index"))[0]
    assert train[0]["tokens"].shape == (33,)


def test_build_corpus_tool_writes_deterministic_jsonl(tmp_path):
    out = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for o in out:
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "build_corpus.py"),
                        "--jsonl", str(o), "--max-bytes", "50000"], check=True,
                       capture_output=True, timeout=60)
    assert out[0].read_bytes() == out[1].read_bytes()
    rows = [json.loads(x) for x in out[0].read_text().splitlines()]
    assert rows and all(set(r) == {"text", "path"} for r in rows)
    assert [r["path"] for r in rows] == [p for p, _ in stdlib_files(50000)]


def build_corpus(argv, capsys):
    from data_fixtures import run_tool

    rc, err = run_tool("build_corpus", argv, capsys)
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in err, err
    return rc, lines[-1]


def test_build_corpus_jsonl_under_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    rc, line = build_corpus(["--jsonl", tmp_path / "afile" / "x.jsonl", "--max-bytes", 1000],
                            capsys)
    assert rc == 2 and line == (f"error: {tmp_path}/afile/x.jsonl: Not a directory; a file "
                                "stands where a directory is needed; pass another path or move "
                                "that file")  # the user's path, not the temp file's
    assert os.listdir(tmp_path) == ["afile"]


@pytest.mark.parametrize("argv,expect", [
    (["--max-bytes", "0"], "error: --max-bytes 0: give a positive number of bytes"),
    (["--max-bytes", "-1"], "error: --max-bytes -1: give a positive number of bytes"),
    (["--vocab-size", "lots"], "error: argument --vocab-size: invalid int value: 'lots' "
                               "(see --help)"),
])
def test_build_corpus_bad_flags(tmp_path, capsys, argv, expect):
    rc, line = build_corpus(["--jsonl", tmp_path / "x.jsonl", "--cache-dir", tmp_path] + argv,
                            capsys)
    assert rc == 2 and line.startswith(expect)
    assert os.listdir(tmp_path) == []


def test_build_corpus_too_small_vocab_names_the_users_flag(tmp_path, capsys):
    rc, line = build_corpus(["--cache-dir", tmp_path, "--vocab-size", 10, "--max-bytes", 20000],
                            capsys)
    assert rc == 2 and line.startswith("error: --vocab-size 10 is too small for the built-in "
                                       "corpus: its characters and byte fallback need at least ")
    assert line.endswith("ids; pass a larger --vocab-size (default 4096)")
    assert "character-coverage" not in line and ".tmp-" not in line
    assert os.listdir(tmp_path) == [".builtin.lock"]  # no half-built corpus
