"""tools/preprocess_data.py: round trip, workers/partitions, gzip, bad input."""

import gzip
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm

from data_fixtures import REPO, quiet, run_tool, write_jsonl
from megaq.data.errors import DataError
from megaq.data.indexed import IndexedDataset, resolve_dtype
from megaq.data.preprocess import preprocess


def read_all(prefix):
    ds = IndexedDataset(prefix)
    return [np.asarray(ds[i]).tolist() for i in range(len(ds))], ds


def test_round_trip_matches_sentencepiece(tmp_path, capsys, tiny_corpus, tiny_tokenizer):
    src, docs = tiny_corpus
    sp = spm.SentencePieceProcessor(model_file=tiny_tokenizer)
    eod = sp.piece_to_id("<EOD>")
    rc, err = run_tool("preprocess_data", [
        "--input", src, "--json-keys", "text", "--output-prefix", tmp_path / "out",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tiny_tokenizer,
        "--append-eod", "--workers", 1, "--log-interval", 20], capsys)
    assert rc == 0, err
    got, ds = read_all(str(tmp_path / "out_text_document"))
    assert got == [sp.encode(d) + [eod] for d in docs]
    assert ds.dtype == np.uint16  # Megatron's choice for a vocab under 65,500
    assert "docs/s" in err and "MB/s" in err and "tokens/s" in err
    assert err.count("Processed") >= len(docs) // 20 - 1  # progress every --log-interval docs
    # Without --append-eod: exactly SentencePiece's encoding.
    preprocess(src, str(tmp_path / "plain"), tiny_tokenizer, log=quiet)
    assert read_all(str(tmp_path / "plain_text_document"))[0] == [sp.encode(d) for d in docs]


def test_workers_partitions_gzip_give_identical_bytes(tmp_path, tiny_corpus, tiny_tokenizer):
    src, _ = tiny_corpus
    gz = str(tmp_path / "c.jsonl.gz")
    with open(src, "rb") as f, gzip.open(gz, "wb") as g:
        g.write(f.read())
    runs = {"ref": (src, 1, 1), "w2": (src, 2, 1), "p3": (src, 1, 3), "gz": (gz, 2, 2)}
    blobs = {}
    for name, (inp, workers, parts) in runs.items():
        preprocess(inp, str(tmp_path / name), tiny_tokenizer, append_eod=True, workers=workers,
                   partitions=parts, log=quiet)
        blobs[name] = tuple(open(str(tmp_path / f"{name}_text_document{e}"), "rb").read()
                            for e in (".bin", ".idx"))
    assert all(b == blobs["ref"] for b in blobs.values())
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["c.jsonl.gz"] + [f"{n}_text_document{e}" for n in runs for e in (".bin", ".idx")])


def test_multiple_keys_and_empty_documents(tmp_path, tiny_tokenizer):
    sp = spm.SentencePieceProcessor(model_file=tiny_tokenizer)
    rows = [{"title": "alpha", "body": "one two"}, {"title": "", "body": "three"},
            {"title": "beta", "body": ""}]
    src = write_jsonl(str(tmp_path / "k.jsonl"), rows)
    with open(src, "a") as f:
        f.write("\n")  # a blank line: an empty document, not an error
    stats = preprocess(src, str(tmp_path / "k"), tiny_tokenizer, json_keys=["title", "body"],
                       log=quiet)
    assert stats.documents == 3 and stats.empty == {"title": 2, "body": 2}
    assert read_all(stats.outputs["title"])[0] == [sp.encode("alpha"), sp.encode("beta")]
    assert read_all(stats.outputs["body"])[0] == [sp.encode("one two"), sp.encode("three")]


BAD_INPUTS = {
    "malformed": ('{"text": "fine"}\n{"text": "fine"}\n{"text": broken\n', "bad.jsonl:3: malformed JSON"),
    "missing_key": ('{"text": "a"}\n{"txt": "b"}\n', "bad.jsonl:2: missing json key 'text'"),
    "not_string": ('{"text": 5}\n', "bad.jsonl:1: json key 'text' holds int"),
    "empty_file": ("", "empty input"),
    "only_blank": ("\n\n", "empty input"),
    "all_empty_text": ('{"text": ""}\n', "all 1 documents have empty text"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_one_line_no_output(tmp_path, capsys, tiny_tokenizer, case):
    content, expect = BAD_INPUTS[case]
    src = tmp_path / "bad.jsonl"
    src.write_text(content)
    out = tmp_path / "out"
    out.mkdir()
    for workers in (1, 2):
        rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix", out / "x",
                                               "--tokenizer-model", tiny_tokenizer,
                                               "--workers", workers], capsys)
        assert rc == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], err
        assert os.listdir(out) == []  # no partial output, not even temp files


def _python_in_own_session(code: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -c code` in a session of its own; past `timeout`, SIGKILL (which no handler
    catches) to the whole session, so a hung pool's workers do not outlive the test."""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hung for {timeout} s: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_workers_end_under_a_callers_sigterm_handler(tmp_path, tiny_tokenizer):
    """A caller's SIGTERM handler that does not exit (a training loop's, say) is inherited
    by the pool's forked workers; the pool must still end them when the input is bad.
    Before the workers reset SIGTERM, about one run in ten hung (a worker killed while it
    held the task queue's lock); 30 runs in one process make a regression all but certain
    to show, as a timeout."""
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "a"}\n{"txt": "b"}\n')
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "x"), "--tokenizer-model",
            tiny_tokenizer, "--workers", "2"]
    code = ("import signal, sys; signal.signal(signal.SIGTERM, lambda *a: None); "
            "from megaq.cli.preprocess_data import main; from megaq.data.errors import run_cli; "
            f"sys.exit(max(run_cli(main, {argv!r}) for _ in range(30)))")
    r = _python_in_own_session(code, timeout=120)
    assert r.returncode == 2 and r.stderr.count("missing json key 'text'") == 30, r.stderr[-2000:]


def test_pool_ended_at_once_ends_under_a_callers_sigterm_handler(tiny_corpus, tiny_tokenizer):
    """The window the test above reaches only under load, held open: each worker sleeps
    0.3 s before its initializer (which installs its own handlers), and the pool is
    terminated at once, so every SIGTERM lands while the workers still have the caller's
    handler, one that does not exit. terminate() must end them all the same (the signal
    blocked until the initializer, preprocess._start_pool). Without that mask every run
    hangs; the parent is killed at 60 s."""
    src, _ = tiny_corpus
    enc = (src, ["text"], "SentencePieceTokenizer", tiny_tokenizer, False, None, None, None)
    code = ("import multiprocessing as mp, signal, time; signal.signal(signal.SIGTERM, lambda *a: None)\n"
            "from megaq.data import preprocess\n"
            "init = preprocess._init_worker\n"
            "preprocess._init_worker = lambda args: (time.sleep(0.3), init(args))\n"
            "for _ in range(3):\n"
            f"    pool = preprocess._start_pool(mp.get_context('fork'), 2, {enc!r})\n"
            "    pool.terminate()\n"
            "    pool.join()\n"
            "print('ended')\n")
    r = _python_in_own_session(code, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ended", r.stderr[-2000:]


def test_bad_tokenizer_and_dtype(tmp_path, capsys, tiny_corpus, tiny_tokenizer):
    src, _ = tiny_corpus
    rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix", tmp_path / "x",
                                           "--tokenizer-model", tmp_path / "nope.model"], capsys)
    assert rc == 2 and "nope.model: tokenizer model not found" in err
    rc, err = run_tool("preprocess_data", ["--input", tmp_path / "none.jsonl", "--output-prefix",
                                           tmp_path / "x", "--tokenizer-model", tiny_tokenizer], capsys)
    assert rc == 2 and "none.jsonl: input not found" in err
    assert not list(tmp_path.glob("x*"))
    # A vocab too large for the chosen dtype is refused before anything is written.
    with pytest.raises(DataError, match="vocab of 70000 ids does not fit"):
        resolve_dtype("uint16", 70000)
    assert resolve_dtype("auto", 70000) == np.int32 and resolve_dtype("auto", 65499) == np.uint16
    preprocess(src, str(tmp_path / "i32"), tiny_tokenizer, dtype="int32", log=quiet)
    assert IndexedDataset(str(tmp_path / "i32_text_document")).dtype == np.int32


def test_cli_exit_code_end_to_end(tmp_path):
    """The real entry point: non-zero exit and one stderr line."""
    src = tmp_path / "bad.jsonl"
    src.write_text("not json\n")
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
                        "--input", str(src), "--output-prefix", str(tmp_path / "o"),
                        "--tokenizer-model", str(tmp_path / "missing.model")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "missing.model" in p.stderr


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_output_directory_blocked_by_a_file(tmp_path, capsys, tiny_corpus, tiny_tokenizer):
    """A file where the output directory should be: one line naming it, no traceback."""
    src, _ = tiny_corpus
    (tmp_path / "afile").write_text("")
    rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix",
                                           tmp_path / "afile" / "x", "--tokenizer-model",
                                           tiny_tokenizer], capsys)
    line = one_error_line(err)
    assert rc == 2 and f"{tmp_path / 'afile'}: File exists; a file stands where a directory" in line
    assert os.listdir(tmp_path) == ["afile"] and (tmp_path / "afile").read_text() == ""


def test_output_prefix_ending_in_a_separator_is_refused(tmp_path, capsys, tiny_corpus,
                                                        tiny_tokenizer):
    src, _ = tiny_corpus
    out = tmp_path / "out"
    out.mkdir()
    rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix", f"{out}/",
                                           "--tokenizer-model", tiny_tokenizer], capsys)
    line = one_error_line(err)
    assert rc == 2 and "ends in a path separator" in line and f"e.g. {out}/corpus" in line
    assert os.listdir(out) == []  # not out/_text_document.bin


@pytest.mark.parametrize("argv,expect", [
    (["--workers", "x"], "error: argument --workers: invalid int value: 'x' (see --help)"),
    (["--dtype", "int8"], "error: argument --dtype: invalid choice: 'int8'"),
    (["--output-prefix"], "error: argument --output-prefix: expected one argument (see --help)"),
])
def test_bad_flag_is_one_error_line(tmp_path, capsys, argv, expect):
    base = ["--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "x"]
    rc, err = run_tool("preprocess_data", base + argv, capsys)
    assert rc == 2 and one_error_line(err).startswith(expect) and "usage:" not in err
    assert os.listdir(tmp_path) == []


def test_run_cli_keeps_the_traceback_of_an_oserror_without_a_path():
    """Only an OSError about a path is a user mistake; any other is a bug to show whole."""
    from megaq.data.errors import run_cli

    def main(argv):
        raise OSError("internal failure")
    with pytest.raises(OSError, match="internal failure"):
        run_cli(main, [])


def _peak_rss_of_tool(argv) -> int:
    """Peak RSS (bytes) of tools/preprocess_data.py run on `argv`, measured by a fresh
    wrapper process whose only child it is (RUSAGE_CHILDREN: the largest child waited for)."""
    code = ("import resource, subprocess, sys; "
            "subprocess.run([sys.executable] + sys.argv[1:], check=True, capture_output=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "tools", "preprocess_data.py"),
                          *map(str, argv)], capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.split()[-1]) * 1024  # Linux reports KiB


@pytest.mark.parametrize("workers", [1, 2])
def test_long_document_streams_in_bounded_memory_with_the_same_ids(tmp_path, tiny_corpus,
                                                                   tiny_tokenizer, workers):
    """A 4 MB document between two short ones: the output holds exactly SentencePiece's
    whole-document ids (the tokenizer cuts it where ids provably stay the same), and the
    tool's peak memory above its own baseline (the same run on a tiny input) stays
    within 8x the document (measured ~5x, most of it a fixed cost at this size): it was
    ~55x (the encoder's whole-document working memory and a Python int per token).
    docs/PERFORMANCE.md has the 50 MB figure."""
    prose = "".join(tiny_corpus[1])
    text = (prose * (4_000_000 // len(prose) + 1))[:4_000_000]
    src = write_jsonl(str(tmp_path / "long.jsonl"), ["first", text, "last"])
    tiny = write_jsonl(str(tmp_path / "tiny.jsonl"), ["a b c"])
    common = ["--tokenizer-model", tiny_tokenizer, "--append-eod", "--workers", workers]
    peak = _peak_rss_of_tool(["--input", src, "--output-prefix", tmp_path / "long", *common])
    base = _peak_rss_of_tool(["--input", tiny, "--output-prefix", tmp_path / "tiny", *common])
    assert peak - base < 8 * len(text), (peak, base)
    docs, _ = read_all(str(tmp_path / "long_text_document"))
    sp = spm.SentencePieceProcessor(model_file=tiny_tokenizer)
    eod = sp.piece_to_id("<EOD>")
    assert docs == [sp.encode("first") + [eod], sp.encode(text) + [eod], sp.encode("last") + [eod]]


def test_megatron_preprocessing_flags_noted_in_one_line_or_refused(tmp_path, capsys,
                                                                    tiny_corpus, tiny_tokenizer):
    """Megatron-LM's --lang, --keep-sequential-samples, --vocab-size and --dataset-impl mmap
    change nothing here: the output equals the run without them, and one note names them;
    --dataset-impl lazy asks for a format megaq does not write: one error line, no output."""
    src, _ = tiny_corpus
    base = ["--input", src, "--tokenizer-model", tiny_tokenizer, "--append-eod",
            "--workers", 1, "--partitions", 2]
    rc, err = run_tool("preprocess_data", base + ["--output-prefix", tmp_path / "a"], capsys)
    assert rc == 0, err
    rc, err = run_tool("preprocess_data", base + [
        "--output-prefix", tmp_path / "b", "--lang", "english", "--keep-sequential-samples",
        "--vocab-size", 1000, "--dataset-impl", "mmap"], capsys)
    assert rc == 0, err
    assert [x for x in err.splitlines() if x.startswith("note:")] == [
        "note: 4 Megatron-LM flag(s) accepted without effect: --lang, --keep-sequential-samples, "
        "--vocab-size, --dataset-impl (why: --help)"]
    for ext in (".bin", ".idx"):
        assert (open(tmp_path / f"a_text_document{ext}", "rb").read()
                == open(tmp_path / f"b_text_document{ext}", "rb").read())
    rc, err = run_tool("preprocess_data", base + ["--output-prefix", tmp_path / "c",
                                                  "--dataset-impl", "lazy"], capsys)
    assert rc != 0 and err.strip().splitlines() == [
        "error: --dataset-impl lazy: megaq writes only Megatron's mmap format (.bin/.idx, what "
        "current Megatron-LM reads); drop the flag"]
    assert not any(p.name.startswith("c_") for p in tmp_path.iterdir())
