"""GPT2BPETokenizer (vocab/merge files) and HuggingFaceTokenizer (a local directory).

Every vocabulary is trained here, with the `tokenizers` library, on the tiny stdlib corpus:
nothing is downloaded. megaq's own byte-level BPE must give exactly the ids of
`tokenizers`' byte-level BPE (GPT-2's pre-tokenizer, byte map and merge order) read from
the same encoder.json / vocab.bpe files.
"""

import json
import importlib.util
import os

import numpy as np
import pytest

# tiny_corpus, gpt2_files, hf_dir: fixtures (data_fixtures, via conftest)
from data_fixtures import EDGE_TEXTS, random_texts, run_tool, write_jsonl
from megaq.data.errors import DataError
from megaq.data.indexed import IndexedDataset
from megaq.data.tokenizer import build_tokenizer

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def reference_bpe(gpt2_files):
    """tokenizers' byte-level BPE on the same files (GPT-2's settings: no prefix space)."""
    from tokenizers import ByteLevelBPETokenizer
    return ByteLevelBPETokenizer(*gpt2_files, add_prefix_space=False)


def test_pretokenizer_matches_tokenizers_byte_level(gpt2_files):
    """The pre-token boundaries are GPT-2's, on edge cases and on 2,000 random strings."""
    from tokenizers.pre_tokenizers import ByteLevel

    from megaq.data.gpt2_bpe import bytes_to_unicode, pretokenize_pattern

    ref = ByteLevel(add_prefix_space=False, use_regex=True)
    table = bytes_to_unicode()
    pat = pretokenize_pattern()
    for text in EDGE_TEXTS + random_texts(2000):
        want = [p for p, _ in ref.pre_tokenize_str(text)]
        got = ["".join(table[b] for b in p.encode("utf-8")) for p in pat.findall(text)]
        assert got == want, repr(text)
    # A few boundaries spelled out (a whitespace run lends its last space to the next word).
    assert pat.findall("It's  a b\n\n") == ["It", "'s", " ", " a", " b", "\n\n"]
    assert pat.findall("x²3 a'b") == ["x", "²3", " a", "'", "b"]


def test_gpt2_bpe_ids_equal_tokenizers(gpt2_files, reference_bpe, tiny_corpus):
    tok = build_tokenizer("GPT2BPETokenizer", None, *gpt2_files)
    with open(gpt2_files[0]) as f:
        vocab = json.load(f)
    assert tok.vocab_size == len(vocab) == reference_bpe.get_vocab_size()
    assert tok.eod == tok.pad == vocab["<|endoftext|>"]
    _, docs = tiny_corpus
    texts = EDGE_TEXTS + random_texts(500, seed=1) + docs[60:90]  # docs the BPE never saw
    for text in texts:
        ids = tok.tokenize(text)
        assert ids == reference_bpe.encode(text).ids, repr(text[:80])
        assert tok.detokenize(ids) == text  # byte-level: every string round-trips
    assert tok.tokenize_batch(texts[:5]) == [tok.tokenize(t) for t in texts[:5]]
    # The merges do work: the corpus costs far fewer ids than bytes.
    n_ids = sum(len(tok.tokenize(d)) for d in docs[60:90])
    assert n_ids < 0.6 * sum(len(d.encode()) for d in docs[60:90])


def test_gpt2_bpe_bad_files(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    with pytest.raises(DataError, match="needs --vocab-file"):
        build_tokenizer("GPT2BPETokenizer", None, None, merges)
    with pytest.raises(DataError, match="nope.json: file not found; check --vocab-file"):
        build_tokenizer("GPT2BPETokenizer", None, str(tmp_path / "nope.json"), merges)
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"a": 0, "<|endoftext|>": 1}))
    with pytest.raises(DataError, match="not a byte-level BPE vocabulary"):
        build_tokenizer("GPT2BPETokenizer", None, str(small), merges)
    no_eod = tmp_path / "noeod.json"
    v = json.load(open(vocab))
    del v["<|endoftext|>"]
    no_eod.write_text(json.dumps(v))
    with pytest.raises(DataError, match="no '<\\|endoftext\\|>'"):
        build_tokenizer("GPT2BPETokenizer", None, str(no_eod), merges)
    bad = tmp_path / "bad.bpe"
    bad.write_text("#version: 0.2\na b c\n")
    with pytest.raises(DataError, match="bad.bpe:2: expected two symbols"):
        build_tokenizer("GPT2BPETokenizer", None, vocab, str(bad))


@pytest.mark.parametrize("backend", ["transformers", "tokenizers"])
def test_hf_tokenizer_directory_round_trip(hf_dir, tiny_corpus, monkeypatch, backend):
    """Same ids through transformers.AutoTokenizer (Megatron's way) and, when transformers
    is not installed, through tokenizers + tokenizer_config.json."""
    from tokenizers import Tokenizer

    from megaq.data import hf_tokenizer

    if backend == "transformers":
        pytest.importorskip("transformers")
    else:
        monkeypatch.setattr(hf_tokenizer, "_load_transformers", lambda path: None)
    ref = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", hf_dir)
    assert tok.backend == backend
    assert (tok.eod, tok.pad) == (ref.token_to_id("</s>"), ref.token_to_id("<pad>"))
    assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True) == 500
    _, docs = tiny_corpus
    for text in EDGE_TEXTS[:7] + docs[60:70]:
        ids = tok.tokenize(text)
        assert ids[0] == ref.token_to_id("<s>")  # the tokenizer's own BOS, as Megatron's
        assert ids == ref.encode(text).ids
        assert tok.detokenize(ids) == "<s>" + text  # special tokens are kept on decode
        assert tok.detokenize(ids[1:]) == text
    assert tok.tokenize_batch(docs[60:63]) == [tok.tokenize(d) for d in docs[60:63]]


def test_hf_tokenizer_bad_directory(tmp_path):
    with pytest.raises(DataError, match="needs --tokenizer-model DIR"):
        build_tokenizer("HuggingFaceTokenizer", None)
    with pytest.raises(DataError, match="not a local tokenizer directory.*downloads nothing"):
        build_tokenizer("HuggingFaceTokenizer", "org/some-model")
    if importlib.util.find_spec("transformers") is None:
        # the tokenizers path names the missing file
        with pytest.raises(DataError, match="no tokenizer.json"):
            build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    else:
        with pytest.raises(DataError, match="cannot load a tokenizer"):
            build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


@pytest.mark.parametrize("kind", ["gpt2", "hf"])
def test_preprocess_bin_idx_with_each(tmp_path, capsys, tiny_corpus, gpt2_files, hf_dir, kind):
    """tools/preprocess_data.py -> .bin/.idx holding exactly tokenize(doc) + eod per doc,
    with one worker and with two (the workers build their own tokenizer)."""
    _, docs = tiny_corpus
    docs = docs[:40]
    src = write_jsonl(str(tmp_path / "in.jsonl"), docs)
    if kind == "gpt2":
        flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files[0],
                 "--merge-file", gpt2_files[1]]
        tok = build_tokenizer("GPT2BPETokenizer", None, *gpt2_files)
    else:
        flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir]
        tok = build_tokenizer("HuggingFaceTokenizer", hf_dir)
    want = [tok.tokenize(d) + [tok.eod] for d in docs]
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix", out,
                                               "--append-eod", "--workers", workers, *flags],
                           capsys)
        assert rc == 0, err
        ds = IndexedDataset(f"{out}_text_document")
        assert ds.dtype == np.uint16
        assert [np.asarray(ds[i]).tolist() for i in range(len(ds))] == want


def test_preprocess_gpt2_needs_both_files(tmp_path, capsys, gpt2_files):
    src = write_jsonl(str(tmp_path / "in.jsonl"), ["a b"])
    rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix", tmp_path / "o",
                                           "--tokenizer-type", "GPT2BPETokenizer",
                                           "--vocab-file", gpt2_files[0]], capsys)
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "error: --tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file "
        "(GPT-2's encoder.json and vocab.bpe)")
    assert not list(tmp_path.glob("o*"))


def _train(topo, argv):
    from megaq.pretrain import main
    return main(argv, topo=topo).losses


def test_pretrain_gpt_trains_on_gpt2_bpe_data(tmp_path, capsys, tiny_corpus, gpt2_files):
    """pretrain_gpt.py builds the tokenizer from --vocab-file/--merge-file (the model's
    vocab is the BPE's 600 ids) and trains on data preprocessed with it."""
    from megaq.config.arguments import ArgumentsError, parse_config
    from megaq.testing.ranks import run_on_ranks

    _, docs = tiny_corpus
    src = write_jsonl(str(tmp_path / "in.jsonl"), docs[:40])
    bpe = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files[0],
           "--merge-file", gpt2_files[1]]
    rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix", tmp_path / "d",
                                           "--append-eod", *bpe], capsys)
    assert rc == 0, err
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
            "--data-path", str(tmp_path / "d_text_document"), "--split", "1,0,0",
            "--data-cache-path", str(tmp_path / "cache"), *bpe]
    with pytest.raises(ArgumentsError, match="GPT2BPETokenizer needs --vocab-file and --merge-file"):
        parse_config(argv[:-2], world_size=1)
    losses = run_on_ranks(_train, 1, args=(argv,))[0]
    assert len(losses) == 2
    # An untrained model's loss is about ln(vocab): the 600-id vocabulary, not a default.
    assert abs(losses[1] - np.log(600)) < 0.5, losses


def test_gpt2_bpe_long_document_in_pieces_gives_the_whole_documents_ids(gpt2_files, tiny_corpus):
    """Cut every ~2 KB of the corpus and of GPT-2's edge cases: the ids are exactly the
    whole document's (megaq.data.tokenizer.tokenize_in_pieces)."""
    from megaq.data.tokenizer import tokenize_in_pieces
    tok = build_tokenizer("GPT2BPETokenizer", None, *gpt2_files)
    text = " ".join(tiny_corpus[1][:60] + EDGE_TEXTS * 20 + random_texts(2000))
    parts = list(tokenize_in_pieces(tok, text, piece_chars=2048))
    assert len(parts) > 50
    assert [i for p in parts for i in p] == tok.tokenize(text)
