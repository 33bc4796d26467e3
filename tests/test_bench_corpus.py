"""The held-out corpus builders' shared write loop (tools/bench/corpus_jsonl.py), through
usrshare_corpus.py on a made-up /usr/share: stubs skipped, the byte cap honoured, the
output written whole (no temporary file left behind)."""

import json
import os

import usrshare_corpus  # tools/bench (pyproject.toml: pytest's pythonpath)


def test_usrshare_corpus_skips_stubs_and_stops_at_the_cap(tmp_path, capsys):
    root = tmp_path / "share"
    (root / "common-licenses").mkdir(parents=True)
    (root / "common-licenses" / "A").write_text("a" * 300 + "\n")
    (root / "common-licenses" / "B").write_text("too short\n")  # under 200 characters: skipped
    (root / "common-licenses" / "C").write_text("c" * 250)
    (root / "doc" / "pkg").mkdir(parents=True)
    (root / "doc" / "pkg" / "copyright").write_text("d" * 400)  # past the cap: never written
    out = tmp_path / "out" / "corpus.jsonl"
    assert usrshare_corpus.main(["--out", str(out), "--root", str(root), "--max-bytes", "500"]) == 0
    docs = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert docs == ["a" * 300, "c" * 250]  # 300 < 500 so C is read; 550 >= 500 so pkg is not
    assert os.listdir(out.parent) == ["corpus.jsonl"]
    assert "2 documents" in capsys.readouterr().out
