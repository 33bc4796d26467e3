"""Every tokenizer type is first-class after training (issue 41).

A GPT-2 BPE run and a Hugging Face tokenizer run each train two steps on data
preprocessed with their tokenizer, save a checkpoint (which holds a copy of the
tokenizer's files), and export to transformers form; then the original tokenizer files
are deleted, as on another machine. `AutoTokenizer.from_pretrained(export)` must give
megaq's ids on a probe set (unicode, whitespace runs, newlines, the end-of-document
token), config.json / generation_config.json carry the bos / eos / pad ids, and
tools/generate.py samples from the checkpoint exactly what transformers' greedy
generate() gives. Llama2Tokenizer (Megatron's SentencePiece type with a BOS) is
accepted by preprocessing, pretraining and the export.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install the pins of "
                           "pyproject.toml's test extra)")

from data_fixtures import EDGE_TEXTS, random_texts, run_tool, tool, write_jsonl  # noqa: E402
from megaq.checkpoint.consolidate import load_consolidated_model  # noqa: E402
from megaq.checkpoint.paths import iteration_dir, read_tracker  # noqa: E402
from megaq import export_files  # noqa: E402
from megaq.data.indexed import IndexedDataset  # noqa: E402
from megaq.data.tokenizer import build_tokenizer  # noqa: E402
from megaq.testing.ranks import run_on_ranks  # noqa: E402
from megaq.pretrain import main as pretrain_main  # noqa: E402

transformers.utils.logging.disable_progress_bar()

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear"]


def _train(topo, argv):
    return pretrain_main(argv, topo=topo).losses


def _probe_texts(docs):
    """Unicode, whitespace runs, tabs, newlines, contractions, emoji; random strings;
    corpus text the tokenizers never saw. (The literal "<|endoftext|>" in text is the
    one designed difference: test_gpt2_bpe_run_exports_its_tokenizer.)"""
    return [t for t in EDGE_TEXTS if "<|endoftext|>" not in t] + random_texts(150, seed=5) \
        + [d[:500] for d in docs[100:106]]


def _run(d, docs, tok_flags, model_flags, tok):
    """Preprocess docs with the tokenizer, train TINY on it, save under d/ck."""
    from megaq.data.preprocess import preprocess
    src = write_jsonl(str(d / "in.jsonl"), docs[:40])
    kw = dict(tokenizer_type=tok.type, append_eod=True, log=lambda _m: None)
    if tok.type == "GPT2BPETokenizer":
        kw.update(vocab_file=tok.vocab_file, merge_file=tok.merge_file)
    preprocess(src, str(d / "data"), getattr(tok, "path", None), **kw)
    argv = TINY + model_flags + tok_flags + [
        "--data-path", str(d / "data_text_document"), "--split", "1,0,0",
        "--data-cache-path", str(d / "cache"), "--save", str(d / "ck")]
    run_on_ranks(_train, 1, args=(argv,))
    return str(d / "ck")


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory, tiny_corpus, gpt2_files):
    """(checkpoint, --save-hf export, megaq's tokenizer) of a GPT-2 BPE run whose
    --tokenizer-type was inferred from --vocab-file/--merge-file; the files it was given
    are deleted afterwards."""
    d = tmp_path_factory.mktemp("gpt2_run")
    os.makedirs(d / "tok")
    vocab, merges = (shutil.copy(f, d / "tok") for f in gpt2_files)
    tok = build_tokenizer("GPT2BPETokenizer", None, *gpt2_files)
    ck = _run(d, tiny_corpus[1], ["--vocab-file", vocab, "--merge-file", merges,
                                  "--save-hf", str(d / "hf")], [], tok)
    shutil.rmtree(d / "tok")
    return ck, str(d / "hf"), tok


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, tiny_corpus, hf_dir):
    """(checkpoint, export by tools/convert_checkpoint.py, megaq's tokenizer) of a
    Llama-style run with a Hugging Face tokenizer directory (BOS added), deleted after
    the run."""
    d = tmp_path_factory.mktemp("hf_run")
    shutil.copytree(hf_dir, d / "tok")
    tok = build_tokenizer("HuggingFaceTokenizer", hf_dir)
    ck = _run(d, tiny_corpus[1], ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                  str(d / "tok")], LLAMA, build_tokenizer("HuggingFaceTokenizer",
                                                                          str(d / "tok")))
    shutil.rmtree(d / "tok")
    assert tool("convert_checkpoint").main(["--to", "hf", "--input", ck,
                                            "--output", str(d / "hf")]) == 0
    return ck, str(d / "hf"), tok


def _check_ids(export, tok, texts):
    """AutoTokenizer on the export gives megaq's ids: each text alone, followed by the
    end-of-document token (a document's end in the training stream), and decoded."""
    at = transformers.AutoTokenizer.from_pretrained(export)
    at.model_max_length = 10**9
    assert len(at) == tok.vocab_size and at.eos_token_id == tok.eod
    for text in texts:
        ours = tok.tokenize(text)
        assert at(text).input_ids == ours, repr(text)
        assert at(text + at.eos_token).input_ids == ours + [tok.eod], repr(text)
        plain = [i for i in ours if i not in (tok.eod, getattr(tok, "bos", None))]
        assert at.decode(plain) == tok.detokenize(plain), repr(text)
    return at


def _check_configs(export, bos, eos, pad):
    cfg = json.load(open(os.path.join(export, "config.json")))
    gen = json.load(open(os.path.join(export, "generation_config.json")))
    for c in (cfg, gen):
        assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (bos, eos, pad)


def _greedy_matches_generate_py(ckpt_root, export, prompt_ids, capsys):
    """tools/generate.py (its CLI and its sampler) against transformers' greedy generate()
    on the export: the same ids."""
    gen = tool("generate")
    capsys.readouterr()
    assert gen.main(["--load", ckpt_root, "--prompt", "def main(", "--max-new-tokens", "6",
                     "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "[generate]" in out and "the checkpoint's copy" in out, out
    it = read_tracker(ckpt_root)
    model, _ = load_consolidated_model(iteration_dir(ckpt_root, it))
    vocab = model.config.vocab_size
    expect = gen.sample(model.eval(), prompt_ids, 12, vocab, model.config.seq_length, 0.0, 0,
                        torch.Generator())
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    gcfg = hf.generation_config
    gcfg.eos_token_id = None  # generate.py does not stop at end-of-document either
    prompt = torch.tensor([prompt_ids])
    with torch.no_grad():
        got = hf.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                          generation_config=gcfg, max_new_tokens=12, do_sample=False)
    assert got[0].tolist() == expect


def test_gpt2_bpe_run_exports_its_tokenizer(gpt2_run, gpt2_files, tiny_corpus, tmp_path, capsys):
    ck, export, tok = gpt2_run
    it = iteration_dir(ck, read_tracker(ck))
    for name, src in zip(("vocab.json", "merges.txt"), gpt2_files):  # the copy in the checkpoint
        assert open(os.path.join(it, "tokenizer", name), "rb").read() == open(src, "rb").read()
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
            "merges.txt"} <= set(os.listdir(export))
    assert export_files.is_export(export)  # a later --save-hf / --overwrite may replace it
    _check_configs(export, tok.eod, tok.eod, tok.eod)  # GPT-2's: <|endoftext|> for all three
    at = _check_ids(export, tok, _probe_texts(tiny_corpus[1]))
    assert at.bos_token_id == at.pad_token_id == tok.eod
    # By design: transformers splits a special token's text out of the input, megaq's GPT-2
    # BPE (as Megatron's preprocessing) encodes it as text.
    text = "a<|endoftext|>b"
    assert at(text).input_ids == tok.tokenize("a") + [tok.eod] + tok.tokenize("b")
    assert tok.tokenize(text) != at(text).input_ids and tok.detokenize(tok.tokenize(text)) == text

    # the tool, with the files the run read deleted: the checkpoint's copy, same files
    rc = tool("convert_checkpoint").main(["--to", "hf", "--input", ck, "--output",
                                          str(tmp_path / "again")])
    assert rc == 0 and "tokenizer GPT2BPETokenizer" in capsys.readouterr().out
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        assert open(tmp_path / "again" / name, "rb").read() == \
            open(os.path.join(export, name), "rb").read()
    _greedy_matches_generate_py(ck, export, tok.tokenize("def main("), capsys)
    # the format converter keeps the copy (and the manifest covers it)
    from megaq.checkpoint import integrity
    from megaq.interop.ckpt_format import convert_format
    out = convert_format(ck, str(tmp_path / "torch"), "torch")["dir"]
    assert "tokenizer/vocab.json" in integrity.verify_all(out)


def test_hf_tokenizer_run_exports_its_tokenizer(hf_run, tiny_corpus, capsys):
    ck, export, tok = hf_run
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(export))
    bos = tok.tokenize("")[0]
    _check_configs(export, bos, tok.eod, tok.pad)  # <s>, </s>, <pad>
    assert bos == tok.bos and len({bos, tok.eod, tok.pad}) == 3
    _check_ids(export, tok, _probe_texts(tiny_corpus[1]))
    _greedy_matches_generate_py(ck, export, tok.tokenize("def main("), capsys)


def test_checkpoint_without_a_copy_asks_for_the_files_by_flag(gpt2_run, gpt2_files, tmp_path,
                                                               capsys):
    """A checkpoint saved before the copy existed, whose recorded paths are gone: one line
    naming the flags; given them, it samples. A symlink in the copy is refused."""
    ck, _, _ = gpt2_run
    old = tmp_path / "old"
    shutil.copytree(ck, old)
    it = iteration_dir(str(old), read_tracker(str(old)))
    gen = tool("generate")
    os.remove(os.path.join(it, "tokenizer", "vocab.json"))
    os.symlink(gpt2_files[0], os.path.join(it, "tokenizer", "vocab.json"))
    capsys.readouterr()
    assert gen.main(["--load", str(old), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vocab.json is a symbolic link" in err, err
    shutil.rmtree(os.path.join(it, "tokenizer"))
    assert gen.main(["--load", str(old), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {it} holds no copy of its run's tokenizer (GPT2BPETokenizer), "
                          f"and the path the run recorded, ") and err.count("\n") == 1, err
    assert err.endswith("pass --vocab-file and --merge-file (GPT-2's vocab.json and "
                        "merges.txt)\n"), err
    assert gen.main(["--load", str(old), "--max-new-tokens", "1", "--vocab-file", gpt2_files[0],
                     "--merge-file", gpt2_files[1]]) == 0
    assert "given by flag" in capsys.readouterr().out


def test_llama2_tokenizer_preprocess_train_export(tmp_path, capsys, tiny_tokenizer, tiny_corpus):
    """Megatron's Llama2Tokenizer: <s> before every document (</s> after it with
    --append-eod), an empty document included; pretrain_gpt.py trains on such data (its
    vocabulary: the model's pieces), and the export's tokenizer adds the BOS as megaq does."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=tiny_tokenizer)
    docs = ["def f(x):\n    return x", "", "  two  spaces\nand more"] + tiny_corpus[1][:20]
    src = write_jsonl(str(tmp_path / "in.jsonl"), docs)
    rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix", tmp_path / "d",
                                           "--tokenizer-type", "Llama2Tokenizer",
                                           "--tokenizer-model", tiny_tokenizer, "--append-eod"],
                       capsys)
    assert rc == 0, err
    ds = IndexedDataset(str(tmp_path / "d_text_document"))
    got = [np.asarray(ds[i]).tolist() for i in range(len(ds))]
    assert got == [[sp.bos_id()] + sp.encode(d) + [sp.eos_id()] for d in docs]
    tok = build_tokenizer("Llama2Tokenizer", tiny_tokenizer)
    assert (tok.vocab_size, tok.eod, tok.bos) == (sp.get_piece_size(), sp.eos_id(), sp.bos_id())

    argv = TINY + LLAMA + ["--data-path", str(tmp_path / "d_text_document"), "--split", "1,0,0",
                           "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                           tiny_tokenizer, "--save", str(tmp_path / "ck"),
                           "--data-cache-path", str(tmp_path / "cache")]
    losses = run_on_ranks(_train, 1, args=(argv,))[0]
    assert abs(losses[1] - np.log(tok.vocab_size)) < 0.5  # the model's vocab: the 384 pieces
    assert tool("convert_checkpoint").main(["--to", "hf", "--input", str(tmp_path / "ck"),
                                            "--output", str(tmp_path / "hf")]) == 0
    _check_configs(str(tmp_path / "hf"), sp.bos_id(), sp.eos_id(), sp.pad_id())
    _check_ids(str(tmp_path / "hf"), tok, _probe_texts(tiny_corpus[1])[:60])


def test_tokenizer_type_inferred_from_vocab_and_merge_files(tmp_path, capsys, gpt2_files):
    """Megatron requires --tokenizer-type GPT2BPETokenizer with --vocab-file/--merge-file;
    megaq infers it, says so in a note, and writes the same data."""
    from megaq.config.arguments import parse_config
    src = write_jsonl(str(tmp_path / "in.jsonl"), EDGE_TEXTS)
    files = ["--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1]]
    for name, extra in (("inferred", []), ("given", ["--tokenizer-type", "GPT2BPETokenizer"])):
        rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix", tmp_path / name,
                                               "--append-eod", *files, *extra], capsys)
        assert rc == 0 and ("GPT2BPETokenizer inferred" in err) == (name == "inferred"), err
    assert open(tmp_path / "inferred_text_document.bin", "rb").read() == \
        open(tmp_path / "given_text_document.bin", "rb").read()
    argv = TINY + ["--data-path", str(tmp_path / "given_text_document"), *files]
    assert parse_config(argv, world_size=1, print_notes=True).data.tokenizer_type == \
        "GPT2BPETokenizer"
    assert "note: --tokenizer-type GPT2BPETokenizer inferred from --vocab-file and --merge-file" \
        in capsys.readouterr().out
    rc, err = run_tool("preprocess_data", ["--input", src, "--output-prefix", tmp_path / "x",
                                           "--vocab-file", gpt2_files[0]], capsys)
    assert rc == 2 and err.strip().splitlines()[-1].startswith(
        "error: --vocab-file is the GPT-2 BPE's: pass --vocab-file and --merge-file together")


def test_a_save_notes_a_tokenizer_file_that_is_gone(tmp_path):
    from megaq.data import tokenizer_files
    notes = []
    data = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(tmp_path / "gone.json"),
            "merge_file": str(tmp_path / "gone.txt")}
    assert tokenizer_files.copy_into(str(tmp_path), data, log=notes.append) == []
    assert len(notes) == 1 and "gone.json is gone, so this checkpoint holds no copy" in notes[0]
    assert not (tmp_path / "tokenizer").exists()


def test_hf_import_carries_a_tokenizer_json(gpt2_run, tiny_corpus, tmp_path, capsys):
    """A transformers model whose directory has tokenizer.json (and no tokenizer.model)
    imports with HuggingFaceTokenizer flags and a copy in the checkpoint: generate.py
    samples from the import as it is, and the export of the import ships the tokenizer."""
    _, export, tok = gpt2_run
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=1, n_head=4,
                                  n_positions=64, activation_function="gelu")
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(tmp_path / "src"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(export, name), tmp_path / "src")
    convert = tool("convert_checkpoint")
    assert convert.main(["--from", "hf", "--to", "megaq", "--input", str(tmp_path / "src"),
                         "--output", str(tmp_path / "mq")]) == 0
    copy = os.path.join(iteration_dir(str(tmp_path / "mq"), 0), "tokenizer")
    assert open(tmp_path / "mq" / "megaq_args.txt").read().split()[-4:] == [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", copy]
    capsys.readouterr()
    assert tool("generate").main(["--load", str(tmp_path / "mq"), "--max-new-tokens", "3"]) == 0
    assert "HuggingFaceTokenizer" in capsys.readouterr().out
    assert convert.main(["--to", "hf", "--input", str(tmp_path / "mq"),
                         "--output", str(tmp_path / "back")]) == 0
    _check_ids(str(tmp_path / "back"), tok, _probe_texts(tiny_corpus[1])[:40])
