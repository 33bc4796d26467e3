"""tools/plot_metrics.py: bad input is one `error:` line, exit 2, and no PNG written."""

import json
import os

import pytest

from data_fixtures import run_tool


def metrics(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def plot(argv, capsys):
    rc, err = run_tool("plot_metrics", argv, capsys)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return rc, lines[0]


TRAIN = [{"type": "train", "iteration": 1, "lm_loss": 2.0}]


def test_output_under_a_file(tmp_path, capsys):
    m = metrics(tmp_path / "m.jsonl", TRAIN)
    (tmp_path / "afile").write_text("")
    rc, line = plot([m, "-o", tmp_path / "afile" / "p.png"], capsys)
    assert rc == 2 and f"{tmp_path}/afile: File exists; a file stands where a directory" in line
    assert sorted(os.listdir(tmp_path)) == ["afile", "m.jsonl"]


@pytest.mark.parametrize("content,expect", [
    ("not json\n", "m.jsonl:1: not JSON"),
    (json.dumps({"note": "no records"}) + "\n", "m.jsonl: no train or validation records"),
    ("", "m.jsonl: no train or validation records"),
])
def test_unusable_metrics_file(tmp_path, capsys, content, expect):
    (tmp_path / "m.jsonl").write_text(content)
    rc, line = plot([tmp_path / "m.jsonl", "-o", tmp_path / "p.png"], capsys)
    assert rc == 2 and expect in line and "--metrics-file" in line
    assert os.listdir(tmp_path) == ["m.jsonl"]  # no empty PNG


@pytest.mark.parametrize("argv,expect", [
    ([], "error: the following arguments are required: files (see --help)"),
    (["m.jsonl", "--bogus"], "error: unrecognized arguments: --bogus (see --help)"),
    (["m.jsonl", "--labels", "a", "b"], "error: --labels has 2 labels for 1 files; give one "
                                        "label per file"),
    (["none.jsonl"], "error: none.jsonl: no such metrics file"),
])
def test_bad_arguments(tmp_path, capsys, monkeypatch, argv, expect):
    monkeypatch.chdir(tmp_path)
    metrics(tmp_path / "m.jsonl", TRAIN)
    rc, line = plot(argv, capsys)
    assert rc == 2 and line.startswith(expect)
    assert os.listdir(tmp_path) == ["m.jsonl"]


def test_validation_only_file_still_plots(tmp_path, capsys):
    m = metrics(tmp_path / "m.jsonl", [{"type": "validation", "iteration": 4, "val_loss": 1.0}])
    rc, err = run_tool("plot_metrics", [m, "-o", tmp_path / "p.png"], capsys)
    assert rc == 0 and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
