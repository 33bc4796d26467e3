"""Empty or degenerate data gives one clear line (issue 17), through the real entry points:
megaq.pretrain's CLI on a forked rank and tools/preprocess_data.py."""

import numpy as np
import pytest

from megaq import pretrain
from data_fixtures import run_tool
from megaq.data.indexed import IndexedDatasetWriter
from megaq.testing.ranks import run_cli_on_ranks


def train_argv(tmp_path, data_path, *extra):
    return ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "400", "--log-interval", "1",
            "--data-cache-path", str(tmp_path / "cache"), "--data-path", *data_path, *extra]


def one_error_line(r):
    lines = [x for x in r["stderr"].splitlines() if x.strip()]
    assert r["codes"] == [2] and len(lines) == 1 and lines[0].startswith("error: "), r
    return lines[0]


def empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.finish()
    w.commit()
    return prefix


@pytest.mark.parametrize("split, name", [("0,100,0", "train"), ("100,0,0", "valid")])
def test_split_asked_for_but_empty(tmp_path, tiny_dataset, split, name):
    r = run_cli_on_ranks(pretrain.cli, train_argv(tmp_path, [tiny_dataset], "--split", split,
                                                      "--eval-iters", "1"), 1)
    line = one_error_line(r)
    assert f"--split '{split}' leaves the {name} split no documents of {tiny_dataset}" in line
    assert "TypeError" not in r["stderr"]
    if name == "valid":
        assert "--eval-iters 0" in line
        ok = run_cli_on_ranks(pretrain.cli, train_argv(tmp_path, [tiny_dataset], "--split",
                                                           split, "--eval-iters", "0"), 1)
        assert ok["codes"] == [0], ok["stderr"]


def test_blend_with_an_empty_dataset(tmp_path, tiny_dataset):
    empty = empty_dataset(tmp_path)
    r = run_cli_on_ranks(pretrain.cli, train_argv(tmp_path, ["0.5", tiny_dataset, "0.5", empty],
                                                      "--eval-iters", "0"), 1)
    line = one_error_line(r)
    assert f"{empty}: the dataset is empty (0 documents, 0 tokens)" in line


def test_lone_surrogate_in_jsonl_is_file_line_invalid_text(tmp_path, capsys, tiny_tokenizer):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "broken \\ud800 here"}\n')
    out = tmp_path / "out"
    out.mkdir()
    rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix", out / "x",
                                           "--tokenizer-model", tiny_tokenizer], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {src}:2: invalid text") and "surrogate" in lines[0]
    assert list(out.iterdir()) == []
