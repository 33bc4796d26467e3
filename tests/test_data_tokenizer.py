"""Tokenizer training tool and the tokenizer wrapper."""

import os

import pytest
import sentencepiece as spm

from data_fixtures import TINY_VOCAB, quiet, run_tool, write_jsonl
from megaq.data.errors import DataError
from megaq.data.tokenizer import build_tokenizer
from megaq.data.tokenizer_training import train_sentencepiece


def test_wrapper_ids_and_round_trip(tiny_tokenizer, tiny_corpus):
    tok = build_tokenizer("SentencePieceTokenizer", tiny_tokenizer)
    sp = spm.SentencePieceProcessor(model_file=tiny_tokenizer)
    # Megatron's SentencePieceTokenizer appends <CLS>, <SEP>, <MASK> (the model lacks them).
    assert sp.get_piece_size() == TINY_VOCAB and tok.vocab_size == TINY_VOCAB + 3
    assert sp.id_to_piece(tok.eod) == "<EOD>"   # the user-defined end-of-document piece
    assert sp.id_to_piece(tok.pad) == "<pad>"
    assert tok.eod != tok.pad
    text = tiny_corpus[1][3]
    ids = tok.tokenize(text)
    assert ids == sp.encode(text)
    assert tok.detokenize(ids) == sp.decode(ids)
    # Byte fallback: characters never seen in training still round-trip exactly.
    odd = "naïve ☃ 数据 🙂"
    assert tok.detokenize(tok.tokenize(odd)) == odd
    assert sp.unk_id() not in tok.tokenize(odd)


def test_model_without_eod_piece_megatron_ids(tmp_path, tiny_corpus):
    """Megatron-LM's rules: SentencePieceTokenizer appends <CLS>, <SEP>, <EOD>, <MASK> after
    the model's pieces (eod = pieces + 2); GPTSentencePieceTokenizer uses </s>."""
    from megaq.data.indexed import IndexedDataset
    from megaq.data.preprocess import preprocess

    model = train_sentencepiece([tiny_corpus[0]], str(tmp_path / "t"), 400,
                                user_defined_symbols=(), log=quiet)
    n = spm.SentencePieceProcessor(model_file=model).get_piece_size()
    tok = build_tokenizer("SentencePieceTokenizer", model)
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.vocab_size) == (n, n + 1, n + 2, n + 3, n + 4)
    assert (tok.pad, tok.bos, tok.eos) == (3, 1, 2)  # the model's own pieces
    assert tok.detokenize(tok.tokenize("a b") + [tok.eod]) == "a b<EOD>"
    gpt = build_tokenizer("GPTSentencePieceTokenizer", model)
    assert (gpt.eod, gpt.pad, gpt.vocab_size) == (2, 3, n)
    # --append-eod writes the appended id, as Megatron's preprocess_data.py does.
    src = write_jsonl(str(tmp_path / "d.jsonl"), ["some text"])
    out = preprocess(src, str(tmp_path / "o"), model, append_eod=True, log=quiet).outputs["text"]
    assert IndexedDataset(out)[0].tolist()[-1] == n + 2


def test_train_tool_text_files_unigram_and_special_tokens(tmp_path, capsys, tiny_corpus):
    texts = tiny_corpus[1][:40]
    a = tmp_path / "a.txt"
    a.write_text("\n".join(texts[:20]))
    b = tmp_path / "b.txt"
    b.write_text("\n".join(texts[20:]))
    rc, err = run_tool("train_tokenizer", ["--input", a, b, "--model-prefix", tmp_path / "u",
                                           "--vocab-size", 420, "--model-type", "unigram",
                                           "--user-defined-symbols", "<EOD>", "<MASK>",
                                           "--threads", 1], capsys)
    assert rc == 0, err
    assert "wrote" in err and "documents" in err  # progress / summary output
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "u.model"))
    assert sp.get_piece_size() == 420
    mask = sp.piece_to_id("<MASK>")
    assert sp.encode("x <MASK> y").count(mask) == 1  # special token kept whole
    assert (tmp_path / "u.vocab").read_text().count("\n") == 420


def test_train_tool_jsonl_keys_and_no_byte_fallback(tmp_path, capsys, tiny_corpus):
    src = write_jsonl(str(tmp_path / "c.jsonl"),
                      [{"body": t, "id": i} for i, t in enumerate(tiny_corpus[1][:40])])
    rc, err = run_tool("train_tokenizer", ["--input", src, "--json-keys", "body",
                                           "--model-prefix", tmp_path / "j", "--vocab-size", 200,
                                           "--no-byte-fallback", "--threads", 1], capsys)
    assert rc == 0, err
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "j.model"))
    assert sp.piece_to_id("<0x00>") == sp.unk_id()  # no byte pieces


@pytest.mark.parametrize("case", ["missing_key", "bad_json", "empty", "missing_file"])
def test_train_tool_bad_input(tmp_path, capsys, case):
    src = tmp_path / "in.jsonl"
    if case == "missing_key":
        write_jsonl(str(src), [{"text": "a b c"}, {"body": "d"}])
    elif case == "bad_json":
        src.write_text('{"text": "ok"}\n{"text": oops}\n')
    elif case == "empty":
        src.write_text("")
    rc, err = run_tool("train_tokenizer", ["--input", src, "--model-prefix", tmp_path / "m",
                                           "--vocab-size", 100], capsys)
    assert rc == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and str(src) in line
    assert {"missing_key": "in.jsonl:2: missing json key 'text'", "bad_json": "in.jsonl:2: malformed",
            "empty": "empty input", "missing_file": "not found"}[case] in line
    assert not (tmp_path / "m.model").exists()


def test_wrapper_bad_model(tmp_path):
    with pytest.raises(DataError, match="not found"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "none.model"))
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a valid SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", str(junk))
    if os.geteuid() != 0:  # root reads anything
        junk.chmod(0)
        with pytest.raises(DataError, match="not readable"):
            build_tokenizer("SentencePieceTokenizer", str(junk))
    with pytest.raises(DataError, match="not supported"):
        build_tokenizer("BertWordPieceCase", str(junk))


@pytest.mark.parametrize("prefix,expect", [
    ("afile/tok", "afile: File exists; a file stands where a directory is needed"),
    ("out/", "--model-prefix '{tmp}/out/' ends in a path separator; give a file name prefix, "
             "e.g. {tmp}/out/tok"),
])
def test_unusable_model_prefix_fails_before_training(tmp_path, capsys, tiny_corpus, prefix,
                                                     expect):
    """A blocked output directory is one line at the start, not a traceback after training."""
    src, _ = tiny_corpus
    (tmp_path / "afile").write_text("")
    (tmp_path / "out").mkdir()
    rc, err = run_tool("train_tokenizer", ["--input", src, "--model-prefix",
                                           f"{tmp_path}/{prefix}", "--vocab-size", 300], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert expect.format(tmp=tmp_path) in lines[0]
    assert "[train_tokenizer] training" not in err
    assert sorted(os.listdir(tmp_path)) == ["afile", "out"] and os.listdir(tmp_path / "out") == []


def test_bad_flag_is_one_error_line(tmp_path, capsys):
    rc, err = run_tool("train_tokenizer", ["--input", tmp_path / "a.txt", "--model-prefix",
                                           tmp_path / "m", "--vocab-size", "8k"], capsys)
    assert rc == 2 and err.strip() == ("error: argument --vocab-size: invalid int value: '8k' "
                                       "(see --help)")


# ------------------------------------------------------------ long documents in pieces
def varied_text(docs, seed=0, n=60_000):
    """~400 K characters that stress the cut rule: the corpus's code and prose, then a
    stretch of mixed scripts, digits, whitespace runs (tabs, NBSP, ideographic space),
    punctuation, emoji and combining marks, sprinkled with cut candidates (" a ")."""
    import random
    pools = ["abcXYZ", "ÀéïøßΩжЖ中文字ひらカナ한", "0123456789²³¼Ⅻ٣", " \t\n\r\u00a0\u2003\u3000\x1c",
             "'''.,;:!?-_()[]{}\"/\\@#$%^&*+=<>|~`", "🙂🚀💡", "\u0301\u0308"]
    rng = random.Random(seed)
    noise = "".join(rng.choice(rng.choice(pools)) + (" a " if rng.random() < 0.1 else "")
                    for _ in range(n))
    prose = "".join(docs)
    return prose + noise + prose


@pytest.fixture(scope="module")
def extra_models(tmp_path_factory, tiny_corpus):
    """An NFKC BPE model (SentencePiece's default normalizer: whitespace folded) and a
    unigram model, trained on the tiny corpus."""
    d = tmp_path_factory.mktemp("models")
    return {"nfkc_bpe": train_sentencepiece([tiny_corpus[0]], str(d / "nfkc"), 512,
                                            normalization="nmt_nfkc", log=quiet),
            "unigram": train_sentencepiece([tiny_corpus[0]], str(d / "uni"), 512,
                                           model_type="unigram", log=quiet)}


@pytest.mark.parametrize("kind", ["identity_bpe", "nfkc_bpe", "unigram"])
def test_long_document_in_pieces_gives_the_whole_documents_ids(kind, tiny_tokenizer, tiny_corpus,
                                                               extra_models):
    """Cut every ~2 KB (hundreds of cuts over varied text): BPE models give exactly the
    whole document's ids. A unigram model may differ only where SentencePiece's float32
    search picks between segmentations of equal score: same text, same total score."""
    from megaq.data.tokenizer import tokenize_in_pieces
    model = tiny_tokenizer if kind == "identity_bpe" else extra_models[kind]
    tok = build_tokenizer("SentencePieceTokenizer", model)
    text = varied_text(tiny_corpus[1])
    parts = list(tokenize_in_pieces(tok, text, piece_chars=2048))
    assert len(parts) > 200  # the rule found cuts all along (else nothing was tested)
    pieces = [i for p in parts for i in p]
    whole = tok.tokenize(text)
    if kind != "unigram":
        assert pieces == whole
        return
    assert len(pieces) == len(whole)
    differ = [i for i, (a, b) in enumerate(zip(pieces, whole)) if a != b]
    assert len(differ) < len(whole) // 1000, len(differ)
    sp = tok.sp
    score = lambda ids: sum(sp.get_score(i) for i in ids)  # noqa: E731
    assert sp.decode(pieces) == sp.decode(whole)
    assert abs(score(pieces) - score(whole)) < 1e-3 * max(1, len(differ))


def test_text_without_a_safe_cut_is_encoded_whole(tiny_tokenizer):
    """No single space between ASCII letters: one piece, the whole text's ids."""
    from megaq.data.tokenizer import tokenize_in_pieces
    tok = build_tokenizer("SentencePieceTokenizer", tiny_tokenizer)
    text = ("x" * 5000 + "  ") * 4 + "é " * 3000  # double spaces; a space after non-ASCII
    parts = list(tokenize_in_pieces(tok, text, piece_chars=1024))
    assert len(parts) == 1 and parts[0] == tok.tokenize(text)
