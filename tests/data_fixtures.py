"""Shared helpers and session fixtures for the data-pipeline tests (tests/test_data_*.py).

A tiny SentencePiece model (vocab 384, trained on ~150 KB of stdlib text in well under a
second) is built once per test session, with a small jsonl corpus next to it; so are a
GPT-2 byte-level BPE (encoder.json + vocab.bpe, vocab 600) and a Hugging Face tokenizer
directory (vocab 500, BOS added), trained with the `tokenizers` library.
"""

import json
import multiprocessing as mp
import os
import random

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
    from megaq.testing.ranks import forked_child  # imported here: this module stays light
    forked_child()
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


USER_CLIS = ("preprocess_data", "train_tokenizer", "build_corpus", "generate",
             "convert_checkpoint", "plot_metrics")


def tool(name):
    """A user command's module (megaq.cli.<name>, behind tools/<name>.py), or another tool
    imported from tools/<name>.py (tools/ is not a package)."""
    import importlib
    import importlib.util

    if name in USER_CLIS:
        return importlib.import_module(f"megaq.cli.{name}")

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


# Text that exercises every branch of GPT-2's pre-tokenizer: contractions (and an
# apostrophe that is not one), letters of several scripts, numbers including non-decimal
# ones (superscripts, roman numerals), punctuation runs, whitespace runs before words, at
# the end, tabs/newlines, Unicode spaces, emoji (4-byte UTF-8), combining marks, a
# U+001C separator (whitespace for str.isspace, not for GPT-2), and the EOD string.
EDGE_TEXTS = [
    "Hello world! It's John's 'quoted' they're we've I'm you'll he'd 'S",
    "  two  spaces\tand tab\n\nnew lines   \n trailing   ",
    "numbers 12345 x² Ⅻ ٣٤ 3.14159 and_underscores __init__",
    "naïve café Ωμέγα Привет 数据 日本語 한국어 🙂🚀 e\u0301 ok",
    "nbsp\u00a0here thin\u2009space ideographic\u3000space sep\x1cfile",
    "<|endoftext|> is text here, not a special token",
    "def f(x):\n    return x ** 2  # comment!!!\n",
    "", " ", "\n", "'", "''s", "a'b", "!!!??", "ⅫⅫ²³ 123",
]


def random_texts(n, seed=0):
    """n random strings of letters of several scripts, digits, whitespace of every kind,
    punctuation, emoji and combining marks."""
    pools = ["abcXYZ", "ÀéïøßΩжЖ中文字ひらカナ한", "0123456789²³¼Ⅻ٣", " \t\n\r\u00a0\u2003\u3000\x1c",
             "'''.,;:!?-_()[]{}\"/\\@#$%^&*+=<>|~`", "🙂🚀💡", "\u0301\u0308"]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(0, 40)
        out.append("".join(rng.choice(rng.choice(pools)) for _ in range(k)))
    return out


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory, tiny_corpus):
    """(encoder.json, vocab.bpe) of a byte-level BPE (vocab 600) trained on the tiny corpus
    with the `tokenizers` library (nothing downloaded)."""
    pytest.importorskip("tokenizers")
    from tokenizers import ByteLevelBPETokenizer

    _, docs = tiny_corpus
    d = tmp_path_factory.mktemp("gpt2")
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(docs[:60], vocab_size=600, min_frequency=2,
                                special_tokens=["<|endoftext|>"], show_progress=False)
    vocab, merges = trainer.save_model(str(d))
    os.rename(vocab, d / "encoder.json")
    os.rename(merges, d / "vocab.bpe")
    return str(d / "encoder.json"), str(d / "vocab.bpe")


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory, tiny_corpus):
    """A saved HuggingFace tokenizer directory: tokenizer.json (BPE with a BOS
    post-processor, like Llama's) + tokenizer_config.json naming bos/eos/pad."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    _, docs = tiny_corpus
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(docs[:60], trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bos = tk.token_to_id("<s>")
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    d = tmp_path_factory.mktemp("hf_tok")
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "<unk>"}))
    return str(d)


def token_stream(indexed, doc_order):
    return np.concatenate([np.asarray(indexed[int(d)], dtype=np.int64) for d in doc_order])


__all__ = ["tiny_corpus", "tiny_tokenizer", "tiny_dataset", "gpt2_files", "hf_dir", "write_jsonl",
           "run_tool", "quiet", "REPO", "TINY_VOCAB", "EDGE_TEXTS", "random_texts", "token_stream",
           "in_forked_children"]
