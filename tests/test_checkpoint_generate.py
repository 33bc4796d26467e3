"""Consolidation onto one process (megaq.checkpoint.consolidate.load_consolidated_model, what
tools/generate.py loads): a TP=2 x PP=2 checkpoint loaded on one process computes the
same validation loss the 4-rank run computed."""

import os
import subprocess
import sys

import pytest
import torch

from data_fixtures import tool
from megaq import pretrain
from megaq.checkpoint import dcp_format, formats, integrity, paths
from megaq.checkpoint.consolidate import load_consolidated_model
from megaq.interop.ckpt_format import convert_format
from megaq.data.gpt_dataset import MockGPTDataset
from megaq.testing.ranks import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(topo, argv):
    s = pretrain.main(argv, topo=topo)
    return s.val_losses


@pytest.mark.parametrize("model_flags", [
    # Llama style with GQA and SwiGLU (strided fc1 shards), and GPT-2 style with tied
    # embeddings and learned positions.
    ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
     "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
     "--untie-embeddings-and-output-weights"],
    [],
])
def test_tp_pp_checkpoint_consolidates_to_one_process(tmp_path, model_flags):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--lr", "1e-2", "--mock-data", "--vocab-size", "100",
            "--log-interval", "1", "--eval-iters", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--save", str(tmp_path / "ck"),
            "--data-cache-path", str(tmp_path / "cache"), *model_flags]
    val = run_on_ranks(_train, 4, tp=2, pp=2, args=(argv,))[0][2]

    ckpt_dir = paths.iteration_dir(str(tmp_path / "ck"), 2)
    assert formats.checkpoint_layout(ckpt_dir) == (2, 2)
    model, saved = load_consolidated_model(ckpt_dir)
    model.eval()
    valid = MockGPTDataset(4, 16, saved["model"]["seed"], 100, "valid")
    tokens = torch.stack([torch.from_numpy(valid[i]["tokens"]) for i in range(4)])
    with torch.no_grad():
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean().item()
    # Same weights, same samples; TP=2 splits matmuls and the vocab-parallel softmax,
    # so only fp32 summation order differs.
    assert loss == pytest.approx(val, rel=1e-5)

    # The format converter, both ways (tools/convert_checkpoint.py --from megaq --to
    # megaq): the torch copy consolidates to the same weights, and converting it back
    # gives every saved tensor (weights and AdamW moments) unchanged.
    old = convert_format(str(tmp_path / "ck"), str(tmp_path / "old"), "torch")["dir"]
    assert os.path.isfile(paths.model_file(old, 1, 1))
    back = convert_format(str(tmp_path / "old"), str(tmp_path / "back"), "torch_dist")["dir"]
    model_old, _ = load_consolidated_model(old)
    for (name, p), (_, q) in zip(model.named_parameters(), model_old.named_parameters()):
        assert torch.equal(p, q), name
    keys = ("param", "exp_avg", "exp_avg_sq")
    first, again = (dcp_format.read_saved_state(d, keys) for d in (ckpt_dir, back))
    assert first.keys() == again.keys() and len(first) > 5
    for name in first:
        for key in keys:
            assert torch.equal(first[name][key], again[name][key]), (name, key)


def test_generate_refuses_in_one_line_and_takes_no_verify_checkpoint(tmp_path, capsys):
    """The tool end to end on a real checkpoint: it consolidates the model, then finds no
    tokenizer (mock data) and says so in one line, naming the flags. Without its integrity
    manifest the checkpoint is refused, naming --no-verify-checkpoint, which (as in
    pretrain_gpt.py) loads it unverified: the tool then gets as far as the tokenizer again.
    With the NullTokenizer the prompt and the output are token ids."""
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-2",
            "--mock-data", "--vocab-size", "100", "--eval-iters", "0",
            "--save", str(tmp_path / "ck"), "--data-cache-path", str(tmp_path / "cache")]
    run_on_ranks(_train, 1, args=(argv,))
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "generate.py"), "--load",
                        str(tmp_path / "ck")], capture_output=True, text=True, timeout=120)
    no_tokenizer = (f"error: {paths.iteration_dir(str(tmp_path / 'ck'), 1)} records no tokenizer "
                    f"(a --mock-data run, or a model imported without one); pass --tokenizer-model "
                    f"PATH (or --vocab-file and --merge-file; or --tokenizer-type NullTokenizer to "
                    f"give and get token ids)")
    assert r.returncode == 2
    assert r.stderr.strip() == no_tokenizer, r.stderr

    # the flag, in this process (a subprocess costs seconds of imports each)
    generate = tool("generate")
    os.remove(os.path.join(paths.iteration_dir(str(tmp_path / "ck"), 1), integrity.MANIFEST_NAME))
    assert generate.main(["--load", str(tmp_path / "ck")]) == 2
    refused = capsys.readouterr().err.strip()
    assert "has no integrity manifest" in refused and "--no-verify-checkpoint" in refused
    assert generate.main(["--load", str(tmp_path / "ck"), "--no-verify-checkpoint"]) == 2
    assert capsys.readouterr().err.strip() == no_tokenizer
    assert generate.main(["--load", str(tmp_path / "ck"), "--no-verify-checkpoint",
                          "--tokenizer-type", "NullTokenizer", "--prompt", "7 8 9",
                          "--max-new-tokens", "5"]) == 0
    ids = capsys.readouterr().out.strip().splitlines()[-1].split(" ")
    assert ids[:3] == ["7", "8", "9"] and len(ids) == 8 and all(0 <= int(i) < 100 for i in ids)
    assert generate.main(["--load", str(tmp_path / "ck"), "--no-verify-checkpoint",
                          "--tokenizer-type", "NullTokenizer", "--prompt", "7 x"]) == 2
    assert "'x' is not a token id below 100" in capsys.readouterr().err
    # the flag is that call's, not the process's: the next load verifies again
    assert generate.main(["--load", str(tmp_path / "ck")]) == 2
    assert "has no integrity manifest" in capsys.readouterr().err


def test_generate_refuses_bad_input_in_one_line(tmp_path, capsys, tiny_tokenizer):
    """Flags out of range, a file that is no tokenizer, a tokenizer with more ids than the
    model has rows, and a prompt that gives no tokens: one `error:` line and exit 2 each
    (before: silently accepted, or a DataError / IndexError traceback)."""
    transformers = pytest.importorskip("transformers")
    from megaq.data.tokenizer import build_tokenizer
    vocab = build_tokenizer("SentencePieceTokenizer", tiny_tokenizer).vocab_size
    convert, generate = tool("convert_checkpoint"), tool("generate")

    def checkpoint(name, model_vocab):  # a tiny Llama imported from transformers: no training
        cfg = transformers.LlamaConfig(vocab_size=model_vocab, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=1, num_attention_heads=4,
                                       max_position_embeddings=16)
        hf_dir = str(tmp_path / f"{name}_hf")
        transformers.LlamaForCausalLM(cfg).save_pretrained(hf_dir)
        assert convert.main(["--from", "hf", "--to", "megaq", "--input", hf_dir,
                             "--output", str(tmp_path / name)]) == 0
        return str(tmp_path / name)

    def run(*argv):
        capsys.readouterr()
        rc = generate.main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, (rc, err)
        return err

    ck = checkpoint("ck", vocab)
    assert run("--load", ck, "--temperature", "-1").startswith(
        "error: --temperature must be a number >= 0 (0 = greedy), got -1.0 (see --help)")
    assert run("--load", ck, "--max-new-tokens", "-5").startswith(
        "error: --max-new-tokens must be at least 0, got -5 (see --help)")
    assert run("--load", ck, "--top-k", "x") == \
        "error: argument --top-k: invalid int value: 'x' (see --help)\n"
    not_a_model = tmp_path / "some.vocab"
    not_a_model.write_text("<s> 0\n</s> 0\n")
    assert "not a valid SentencePiece model" in run("--load", ck, "--tokenizer-model", not_a_model)
    assert "--prompt '' gives no tokens" in run("--load", ck, "--tokenizer-model", tiny_tokenizer,
                                                "--prompt", "")
    small = checkpoint("small", vocab - 1)
    assert f"has {vocab} ids, the model {vocab - 1}" in run(
        "--load", small, "--tokenizer-model", tiny_tokenizer)
    # the same checkpoint and tokenizer with a prompt: text comes out
    capsys.readouterr()
    assert generate.main(["--load", ck, "--tokenizer-model", tiny_tokenizer, "--prompt", "def",
                          "--max-new-tokens", "2", "--temperature", "0"]) == 0
    assert "[generate]" in capsys.readouterr().out
