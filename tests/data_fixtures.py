"""Shared helpers and session fixtures for the data-pipeline tests (tests/test_data_*.py).

A tiny SentencePiece model (vocab 384, trained on ~150 KB of stdlib text in well under a
second) is built once per test session, with a small jsonl corpus next to it.
"""

import json
import multiprocessing as mp
import os

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_VOCAB = 384


def quiet(_msg):
    """A progress callback that prints nothing (keeps test output readable)."""


def write_jsonl(path, docs, key="text"):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps(d if isinstance(d, dict) else {key: d}) + "\n")
    return path


def _put_result(fn, q):
    q.put(fn())


def in_forked_children(fn, n: int = 3, timeout: float = 60) -> list:
    """Call fn() in n forked processes at once (concurrent first users of a cache);
    -> their return values, in the order they finished. Each child must exit cleanly."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_put_result, args=(fn, q)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [q.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


def tool(name):
    """Import tools/<name>.py as a module (tools/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"megaq_tool_{name}",
                                                  os.path.join(REPO, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_tool(name, argv, capsys):
    """Run a tool's main in-process like its __main__ does; -> (exit code, stderr)."""
    from megaq.data.errors import run_cli

    rc = run_cli(tool(name).main, [str(a) for a in argv])
    return rc, capsys.readouterr().err


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """(jsonl path, list of document texts): stdlib sources, split into ~2 KB documents."""
    from megaq.data.builtin import stdlib_files

    d = tmp_path_factory.mktemp("tiny_corpus")
    docs = []
    for _, text in stdlib_files(max_bytes=150_000):
        docs += [text[i:i + 2000] for i in range(0, len(text), 2000)]
    return write_jsonl(str(d / "corpus.jsonl"), docs), docs


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_corpus):
    """Path of a SentencePiece BPE model (vocab TINY_VOCAB, <EOD> piece, byte fallback)."""
    from megaq.data.tokenizer_training import train_sentencepiece

    path, _ = tiny_corpus
    prefix = os.path.join(os.path.dirname(path), "tok")
    return train_sentencepiece([path], prefix, TINY_VOCAB, log=quiet)


@pytest.fixture(scope="session")
def tiny_dataset(tiny_corpus, tiny_tokenizer):
    """Prefix of the tiny corpus preprocessed with --append-eod."""
    from megaq.data.preprocess import preprocess

    path, _ = tiny_corpus
    out = os.path.join(os.path.dirname(path), "tiny")
    stats = preprocess(path, out, tiny_tokenizer, append_eod=True, log=quiet)
    return stats.outputs["text"]


def token_stream(indexed, doc_order):
    return np.concatenate([np.asarray(indexed[int(d)], dtype=np.int64) for d in doc_order])


__all__ = ["tiny_corpus", "tiny_tokenizer", "tiny_dataset", "write_jsonl", "run_tool", "quiet",
           "REPO", "TINY_VOCAB", "token_stream", "in_forked_children"]
