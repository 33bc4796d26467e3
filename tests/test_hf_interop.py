"""Hugging Face transformers interop (megaq/interop/hf.py, tools/convert_checkpoint.py).

Export: tiny models of both families trained a few steps at TP=2 x PP=2 (gloo CPU
ranks), exported, loaded by transformers: logits equal megaq's own forward pass and
greedy generation equals tools/generate.py's. Import: a tiny random LlamaForCausalLM
built by transformers computes the same loss in megaq at TP=1 and TP=2 x PP=2. Round
trip HF -> megaq -> HF is bit-identical; refusals leave nothing behind.
"""

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install the pins of "
                           "pyproject.toml's test extra)")

from data_fixtures import tool  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

transformers.utils.logging.disable_progress_bar()

from megaq.checkpoint import paths, record  # noqa: E402
from megaq.checkpoint.consolidate import load_consolidated_model  # noqa: E402
from megaq.data.gpt_dataset import MockGPTDataset  # noqa: E402
from megaq.testing.ranks import run_on_ranks  # noqa: E402
from megaq.pretrain import main as pretrain_main  # noqa: E402

SEQ = 48  # >= prompt (8) + 32 generated tokens: generate.py never truncates the context
VOCAB = 100  # padded to 256 at TP=2 (make-vocab-size-divisible-by 128 x TP)

# name: (model flags, uses the tiny SentencePiece tokenizer)
FAMILIES = {
    # Llama, GQA (4 heads, 2 groups), untied head; exported by --save-hf
    "llama_gqa_untied": (["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                          "rope", "--group-query-attention", "--num-query-groups", "2",
                          "--disable-bias-linear", "--untie-embeddings-and-output-weights"], False),
    # Llama, MHA, tied embeddings (the last stage holds the head's copy)
    "llama_mha_tied": (["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                        "rope", "--disable-bias-linear"], False),
    # GPT-2, MHA, tied, learned positions, biases; ships the tiny tokenizer
    "gpt2_tied": ([], True),
}


def _train(topo, argv):
    return pretrain_main(argv, topo=topo).val_losses


def _convert(argv, capsys=None):
    if capsys is not None:
        capsys.readouterr()  # drop what the setup printed (transformers' progress bars)
    rc = tool("convert_checkpoint").main([str(a) for a in argv])
    return rc, (capsys.readouterr().err if capsys is not None else "")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_tokenizer):
    """{family: (checkpoint root, HF export dir, vocab)}: each model trained 3 steps at
    TP=2 x PP=2 and exported once, shared by the tests below."""
    from megaq.data.tokenizer import build_tokenizer
    out = {}
    for name, (flags, with_tok) in FAMILIES.items():
        d = tmp_path_factory.mktemp(name)
        vocab = build_tokenizer("SentencePieceTokenizer", tiny_tokenizer).vocab_size \
            if with_tok else VOCAB
        argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "4",
                "--train-iters", "3", "--lr", "1e-2", "--mock-data", "--vocab-size", str(vocab),
                "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
                "--attention-dropout", "0", "--tensor-model-parallel-size", "2",
                "--pipeline-model-parallel-size", "2", "--save", str(d / "ck"),
                "--data-cache-path", str(d / "cache"), *flags]
        if with_tok:
            argv += ["--tokenizer-model", tiny_tokenizer]
        if name == "llama_gqa_untied":
            argv += ["--save-hf", str(d / "save_hf")]
        run_on_ranks(_train, 4, tp=2, pp=2, args=(argv,))
        rc, _ = _convert(["--to", "hf", "--input", d / "ck", "--output", d / "hf"])
        assert rc == 0
        out[name] = (str(d / "ck"), str(d / "hf"), vocab)
    return out


def _megaq_model(ckpt_root):
    """megaq's own model from the checkpoint, on one process (tools/generate.py's path)."""
    model, saved = load_consolidated_model(paths.iteration_dir(ckpt_root, 3))
    return tool("generate"), model.eval(), saved


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item(), ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_logits_and_greedy_generation_match_megaq(trained, name):
    root, hf_dir, vocab = trained[name]
    gen, model, _ = _megaq_model(root)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    padded = model.padded_vocab_size
    assert padded > vocab and hf.config.vocab_size == padded  # padded rows are kept
    tokens = torch.stack([torch.from_numpy(MockGPTDataset(2, SEQ, 7, vocab, "valid")[i]["tokens"])
                          for i in range(2)])[:, :SEQ]
    with torch.no_grad():
        ours = model(input_ids=tokens)
        theirs = hf(input_ids=tokens).logits
    assert theirs.shape == ours.shape
    # fp32 both sides; only summation order differs (observed ~1e-7)
    norm_rel, max_rel = _rel(theirs, ours)
    assert norm_rel < 1e-5 and max_rel < 1e-5

    # greedy: generate.py samples among the real vocabulary; transformers must never
    # pick a padded id (generation_config.json suppresses them)
    prompt = tokens[:1, :8]
    expect = gen.sample(model, prompt[0].tolist(), 32, vocab, SEQ, 0.0, 0, torch.Generator())
    gcfg = hf.generation_config
    assert gcfg.suppress_tokens == list(range(vocab, padded))
    gcfg.eos_token_id = None  # generate.py does not stop at end-of-document either
    with torch.no_grad():
        got = hf.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                          generation_config=gcfg, max_new_tokens=32, do_sample=False)
    assert got[0].tolist() == expect


def test_save_hf_matches_the_tool(trained):
    """pretrain_gpt.py --save-hf (megaq.pretrain) writes the same tensors the tool writes."""
    root, hf_dir, _ = trained["llama_gqa_untied"]
    a = load_file(os.path.join(hf_dir, "model.safetensors"))
    b = load_file(os.path.join(os.path.dirname(root), "save_hf", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    assert cfg["num_key_value_heads"] == 2 and not cfg["tie_word_embeddings"]


def test_export_tokenizer_bf16_and_sharding(trained, tmp_path, tiny_tokenizer):
    """The tokenizer loads with AutoTokenizer and encodes as megaq's does; --dtype bf16
    writes bf16 weights; a small --max-shard-size gives shards + index."""
    from megaq.data.tokenizer import build_tokenizer
    root, hf_dir, vocab = trained["gpt2_tied"]
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = build_tokenizer("SentencePieceTokenizer", tiny_tokenizer)
    assert os.path.isfile(os.path.join(hf_dir, "tokenizer.json"))
    for text in ["def main(argv=None):\n    return  0\n", "  two leading spaces", "x<EOD>",
                 "\u00fcnic\u00f6de \u4e2d 42"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ours.tokenize(text), text
        assert tok.decode(ids) == ours.detokenize(ids)
    gcfg = json.load(open(os.path.join(hf_dir, "generation_config.json")))
    assert gcfg["eos_token_id"] == ours.eod

    out = tmp_path / "bf16"
    rc, _ = _convert(["--to", "hf", "--input", root, "--output", out, "--dtype", "bf16",
                      "--max-shard-size", "40KB"])
    assert rc == 0
    index = json.load(open(out / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    fp32 = load_file(os.path.join(hf_dir, "model.safetensors"))
    for f in files:
        for k, t in load_file(str(out / f)).items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, fp32[k].to(torch.bfloat16))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    assert hf.transformer.h[1].mlp.c_fc.weight.dtype == torch.bfloat16


# ------------------------------------------------------------------------- import
def _tiny_llama(path, vocab=99, tied=False, layers=2, bias=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied, rms_norm_eps=1e-5,
                                   attention_bias=bias, mlp_bias=bias)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    return model


def _tiny_gpt2(path, tied=True):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  activation_function="gelu", tie_word_embeddings=tied)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    if not tied:  # a head of its own, different from the embedding
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 0.02)
    model.save_pretrained(str(path))
    return model


RESUME = ("--no-load-rng",)  # megaq_args.txt's --load form: the checkpoint as a run's, at iteration 0
FINETUNE = ("--finetune",)  # docs/INTEROP.md's other form: weights only, a fresh run


@pytest.mark.parametrize("tp,pp,vp,variant,run_tp,run_pp,start", [
    (1, 1, 1, "gqa_untied", 1, 1, RESUME), (2, 2, 1, "gqa_untied", 2, 2, RESUME),
    (1, 2, 2, "gqa_untied", 1, 2, RESUME), (1, 1, 1, "bias_tied", 1, 1, FINETUNE),
    (2, 2, 1, "gqa_untied", 1, 1, RESUME),  # loaded by a run of another layout: resharded
])
def test_import_llama_loss_matches_transformers(tmp_path, tp, pp, vp, variant, run_tp, run_pp, start):
    # vocab 99: TP=2 pads one zero row
    hf = _tiny_llama(tmp_path / "hf", layers=4, tied=variant == "bias_tied",
                     bias=variant == "bias_tied")
    out = tmp_path / "mq"
    rc, _ = _convert(["--from", "hf", "--to", "megaq", "--input", tmp_path / "hf", "--output", out,
                      "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp,
                      "--virtual-pipeline-size", vp, "--seq-length", 16])
    assert rc == 0
    flags = open(out / "megaq_args.txt").read().split()
    if (run_tp, run_pp) != (tp, pp):
        flags += ["--tensor-model-parallel-size", str(run_tp),
                  "--pipeline-model-parallel-size", str(run_pp)]
    argv = flags + ["--load", str(out), *start, "--micro-batch-size", "2",
                    "--global-batch-size", "4", "--train-iters", "1", "--lr", "0", "--mock-data",
                    "--eval-iters", "1", "--eval-interval", "1", "--log-interval", "1",
                    "--data-cache-path", str(tmp_path / "cache")]
    # lr 0: the validation loss after one step is that of the weights as loaded
    val = run_on_ranks(_train, run_tp * run_pp, tp=run_tp, pp=run_pp, args=(argv,))[0][1]

    tokens = torch.stack([torch.from_numpy(MockGPTDataset(4, 16, 1234, 99, "valid")[i]["tokens"])
                          for i in range(4)])
    with torch.no_grad():
        logits = hf(input_ids=tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 99), tokens[:, 1:].reshape(-1))
    assert val == pytest.approx(loss.item(), rel=1e-5)


def test_converted_checkpoint_loads_without_rng_flag(tmp_path, capfd):
    """A converted checkpoint has no RNG streams: --load alone loads it, as with
    --no-load-rng, and says so in one note (a run's own save with its rng/ files still
    restores them: tests/test_dist_checkpoint.py)."""
    _tiny_llama(tmp_path / "hf", layers=2, tied=False, bias=False)
    out = tmp_path / "mq"
    rc, _ = _convert(["--from", "hf", "--to", "megaq", "--input", tmp_path / "hf", "--output",
                      out, "--seq-length", 16])
    assert rc == 0
    argv = open(out / "megaq_args.txt").read().split() + [
        "--load", str(out), "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "1", "--lr", "0", "--mock-data", "--eval-iters", "0",
        "--log-interval", "1", "--data-cache-path", str(tmp_path / "cache")]
    assert "--no-load-rng" not in argv
    capfd.readouterr()
    run_on_ranks(_train, 1, args=(argv,))
    out_lines = capfd.readouterr().out.splitlines()
    assert sum("holds no RNG state (a converted checkpoint); RNG streams start from --seed, "
               "as with --no-load-rng" in x for x in out_lines) == 1


@pytest.mark.parametrize("family", ["llama_tied", "llama_untied_bias", "gpt2_tied",
                                    "gpt2_untied"])
def test_round_trip_hf_megaq_hf_is_bit_identical(tmp_path, family):
    if family.startswith("gpt2"):
        hf = _tiny_gpt2(tmp_path / "hf", tied=family == "gpt2_tied")
    else:
        hf = _tiny_llama(tmp_path / "hf", vocab=96, tied=family == "llama_tied",
                         bias=family.endswith("bias"))
    rc, _ = _convert(["--from", "hf", "--to", "megaq", "--input", tmp_path / "hf", "--output",
                      tmp_path / "mq", "--tensor-model-parallel-size", "2",
                      "--pipeline-model-parallel-size", "2"])
    assert rc == 0
    rc, _ = _convert(["--to", "hf", "--input", tmp_path / "mq", "--output", tmp_path / "back"])
    assert rc == 0
    a = load_file(str(tmp_path / "hf" / "model.safetensors"))
    b = load_file(str(tmp_path / "back" / "model.safetensors"))
    a = {k: v for k, v in a.items() if not k.endswith(".attn.bias")}
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    # and transformers reads the exported config as the same model
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)


# ----------------------------------------------------------------------- refusals
def _edit_config(hf_dir, **changes):
    path = os.path.join(hf_dir, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def _drop_tensor(hf_dir, name):
    path = os.path.join(hf_dir, "model.safetensors")
    sd = load_file(path)
    del sd[name]
    save_file(sd, path, metadata={"format": "pt"})


@pytest.mark.parametrize("case,expect", [
    ("rope_scaling", "rope_parameters.rope_type = 'linear'"),
    ("attention_bias", "attention_bias"),
    ("gelu_new", "activation_function = 'gelu_new'"),
    ("missing", "model.layers.1.mlp.up_proj.weight is missing"),
    ("shape", "has shape (48, 32), config.json implies (64, 32)"),
    ("extra", "has no megaq counterpart"),
    ("layer_split", "2 layers do not split into 2 stages x 2 virtual chunks"),
    # damaged downloads: one line naming the file, not the reader's traceback
    ("truncated", "model.safetensors cannot be read (SafetensorError"),
    ("config_json", "config.json cannot be read as JSON (JSONDecodeError"),
    ("config_field", "config.json has no field 'hidden_size'"),
])
def test_import_refusals_leave_nothing(tmp_path, capsys, case, expect):
    hf_dir = tmp_path / "hf"
    if case == "gelu_new":
        _tiny_gpt2(hf_dir)
        _edit_config(hf_dir, activation_function="gelu_new")
    else:
        _tiny_llama(hf_dir)
    if case == "rope_scaling":
        _edit_config(hf_dir, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                              "rope_theta": 10000.0})
    elif case == "attention_bias":
        _edit_config(hf_dir, attention_bias=True)
    elif case == "missing":
        _drop_tensor(hf_dir, "model.layers.1.mlp.up_proj.weight")
    elif case == "shape":
        _edit_config(hf_dir, intermediate_size=64)
    elif case == "extra":
        path = os.path.join(hf_dir, "model.safetensors")
        sd = load_file(path)
        sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
        save_file(sd, path, metadata={"format": "pt"})
    elif case == "truncated":
        path = os.path.join(hf_dir, "model.safetensors")
        data = open(path, "rb").read()
        open(path, "wb").write(data[:len(data) // 2])
    elif case == "config_json":
        (hf_dir / "config.json").write_text('{"model_type": "llama", "hidden_')
    elif case == "config_field":
        cfg = json.load(open(hf_dir / "config.json"))
        del cfg["hidden_size"]
        (hf_dir / "config.json").write_text(json.dumps(cfg))
    before = sorted(os.listdir(tmp_path))
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    if case == "layer_split":
        layout += ["--virtual-pipeline-size", "2"]
    rc, err = _convert(["--from", "hf", "--to", "megaq", "--input", hf_dir,
                        "--output", tmp_path / "out", *layout], capsys)
    assert rc == 2
    assert err.startswith("error:") and err.count("\n") == 1 and expect in err, err
    assert sorted(os.listdir(tmp_path)) == before  # no output, no temporary directory


def test_export_refusals(trained, tmp_path, capsys):
    root, hf_dir, _ = trained["gpt2_tied"]
    # an existing output directory is not replaced without --overwrite
    rc, err = _convert(["--to", "hf", "--input", root, "--output", hf_dir], capsys)
    assert rc == 2 and "already exists" in err and err.count("\n") == 1
    # not a checkpoint (an --output outside it: one inside is refused first)
    (tmp_path / "empty").mkdir()
    rc, err = _convert(["--to", "hf", "--input", tmp_path / "empty", "--output", tmp_path / "x"],
                       capsys)
    assert rc == 2 and "latest_checkpointed_iteration.txt" in err
    # a checkpoint whose shard file is missing: nothing written
    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    os.remove(os.path.join(paths.iteration_dir(str(broken), 3), "__3_0.distcp"))  # rank 3's
    rc, err = _convert(["--to", "hf", "--input", broken, "--output", tmp_path / "y"], capsys)
    assert rc == 2 and "is missing" in err and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["broken", "empty"]


def _imported(tmp_path):
    """(HF dir, megaq checkpoint root under tmp_path/RUN): a tiny Llama imported, no training."""
    _tiny_llama(tmp_path / "hf")
    rc, _ = _convert(["--from", "hf", "--to", "megaq", "--input", tmp_path / "hf",
                      "--output", tmp_path / "RUN" / "ck"])
    assert rc == 0
    return tmp_path / "hf", tmp_path / "RUN" / "ck"


def _tree(root):
    """{relative path: bytes} of every file under root: what a refusal must leave as it was."""
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files}


def test_output_overlapping_input_is_refused_and_nothing_is_lost(tmp_path, capsys):
    """--overwrite replaces --output as a whole: an --output that is the input, holds it or
    lies inside it is refused on every route, before anything is read or written."""
    hf, ck = _imported(tmp_path)
    (tmp_path / "RUN" / "notes.txt").write_text("unrelated file beside the checkpoint")
    before = _tree(tmp_path)
    for argv in (["--to", "hf", "--input", ck, "--output", tmp_path / "RUN"],  # an ancestor
                 ["--to", "hf", "--input", ck, "--output", ck],  # the same
                 ["--to", "hf", "--input", ck, "--output", ck / "iter_0000000" / "hf"],  # inside
                 ["--from", "megaq", "--to", "megaq", "--ckpt-format", "torch_dist",
                  "--input", ck, "--output", tmp_path / "RUN"],
                 ["--from", "hf", "--to", "megaq", "--input", hf, "--output", tmp_path]):
        rc, err = _convert(argv + ["--overwrite"], capsys)
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: --output {argv[-1]} overlaps --input {argv[-3]}"), err
        assert "choose an --output outside --input" in err
        assert _tree(tmp_path) == before  # the input, the unrelated file: all there, no temp dir


def test_unwritable_output_and_bad_flags_are_one_line(tmp_path, capsys):
    _, ck = _imported(tmp_path)
    (tmp_path / "afile").write_text("x")
    before = _tree(tmp_path)
    cases = [(tmp_path / "afile" / "hf", f"{tmp_path / 'afile'} is a file, not a directory"),
             (tmp_path / "afile", "is a file, not a directory; pass a directory path")]
    if os.path.isdir("/sys"):  # sysfs refuses a new directory even to root
        cases.append(("/sys/megaq_hf_test", "cannot write --output /sys/megaq_hf_test: "))
    for out, expect in cases:
        rc, err = _convert(["--to", "hf", "--input", ck, "--output", out, "--overwrite"], capsys)
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert expect in err, err
    # a tokenizer given by name but missing: refused, not shipped-without with a note
    rc, err = _convert(["--to", "hf", "--input", ck, "--output", tmp_path / "out",
                        "--tokenizer-model", tmp_path / "tok.model"], capsys)
    assert rc == 2 and err == (f"error: --tokenizer-model {tmp_path / 'tok.model'} is not a "
                               f"readable file; pass the tokenizer the checkpoint was trained "
                               f"with (or leave the flag out to ship the checkpoint's own)\n"), err
    # a bad flag value: pretrain_gpt.py's one line, not argparse's usage block
    rc, err = _convert(["--to", "hf", "--input", ck, "--output", tmp_path / "out",
                        "--max-shard-size", "5XB"], capsys)
    assert rc == 2 and err == ("error: argument --max-shard-size: '5XB' is not a size; give a "
                               "positive number of bytes or one with KB, MB, GB or TB (e.g. 5GB) "
                               "(see --help)\n"), err
    assert _tree(tmp_path) == before


def test_export_refuses_architecture_without_hf_counterpart():
    from megaq.interop.hf import InteropError, model_family
    from megaq.model import GPTConfig
    with pytest.raises(InteropError, match="no transformers architecture"):
        model_family(GPTConfig(position_embedding_type="rope"))  # rope + LayerNorm + GELU
    with pytest.raises(InteropError, match="GPT-2 always has biases"):
        model_family(GPTConfig(add_bias_linear=False))
    assert model_family(GPTConfig.llama(add_bias_linear=True)) == "llama"  # attention/mlp bias


def test_save_hf_needs_save():
    from megaq.config.arguments import ArgumentsError, parse_config
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "0",
            "--mock-data", "--save-hf", "/tmp/never_written"]
    with pytest.raises(ArgumentsError, match="--save-hf needs --save DIR"):
        parse_config(argv, world_size=1)
    assert parse_config(argv + ["--save", "/tmp/ck"], world_size=1).checkpointing.save_hf \
        == "/tmp/never_written"


def test_imported_checkpoint_has_the_form_a_run_saves(trained, tmp_path):
    """An imported model_optim.pt (torch format) holds the same records and configuration
    sections as a training run's save (its torch_dist common file: what --load and the
    consolidation tools read)."""
    _tiny_llama(tmp_path / "hf")
    rc, _ = _convert(["--from", "hf", "--to", "megaq", "--input", tmp_path / "hf", "--output",
                      tmp_path / "mq", "--tensor-model-parallel-size", "2"])
    assert rc == 0
    ours = torch.load(paths.model_file(paths.iteration_dir(str(tmp_path / "mq"), 0), 1, 0),
                      map_location="cpu", weights_only=True)
    runs = torch.load(os.path.join(paths.iteration_dir(trained["llama_gqa_untied"][0], 3),
                                   "common.pt"), map_location="cpu", weights_only=True)
    assert set(ours) == set(runs) and set(ours["config"]) == set(runs["config"])
    for section in runs["config"]:
        assert set(ours["config"][section]) == set(runs["config"][section]), section
    assert ours["layout"] == {**runs["layout"], "world_size": 2, "pp": 1, "dp": 1,
                              "ranks_per_node": 2}
    assert record.saved_config(ours)["model"]["vocab_size"] == 99
    assert ours["model_optim"]["step"] == 0 and ours["iteration"] == 0


def test_export_of_a_run_whose_tokenizer_cannot_be_built_says_why(tmp_path, capsys):
    """A run whose tokenizer files are no tokenizer (here a HuggingFaceTokenizer directory
    with an empty tokenizer.json, never read: mock data) still exports its weights, with a
    note naming the tokenizer and the reason, and ships no tokenizer files."""
    tok_dir = tmp_path / "hf_tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    argv = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "0",
            "--eval-iters", "0", "--mock-data", "--vocab-size", "64",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok_dir),
            "--save", str(tmp_path / "ck"), "--data-cache-path", str(tmp_path / "cache")]
    run_on_ranks(_train, 1, args=(argv,))
    capsys.readouterr()  # the run's lines
    rc, _ = _convert(["--to", "hf", "--input", tmp_path / "ck", "--output", tmp_path / "out"])
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert rc == 0 and (tmp_path / "out" / "model.safetensors").is_file()
    assert "note: no tokenizer files: HuggingFaceTokenizer (" in text, text
    assert "the checkpoint's copy): " in text and "cannot load a tokenizer" in text, text
    assert not {"tokenizer.json", "tokenizer.model"} & set(os.listdir(tmp_path / "out"))
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert cfg["eos_token_id"] is None  # no tokenizer, no ids to claim
