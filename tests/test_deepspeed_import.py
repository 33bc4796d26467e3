"""A DeepSpeed ZeRO-3 run moves to megaq: `convert_checkpoint.py --from deepspeed`
(megaq/interop/deepspeed.py).

The fixture (tests/fixtures/deepspeed_zero3, made by its generate.py) is written by
DeepSpeed 0.19.8 itself: megaq's GPTModel trained 3 steps under ZeRO-3 on two gloo ranks
(torch AdamW as the client optimizer, fp32), saved by `engine.save_checkpoint` (the
global_step3 tag) and converted by DeepSpeed's ds_to_universal.py (global_step3_universal).
continuation.json holds SHA-256 digests of every parameter's fp32 master and Adam moments
taken in the DeepSpeed process (safe_get_full_fp32_param / safe_get_full_optimizer_state)
and the losses of the 2 steps DeepSpeed trained after the save. The same holds for a
transformers LlamaForCausalLM run (deepspeed_llama/, continuation_llama.json), imported
with its config.json through the Hugging Face mapping.
"""

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess

import pytest
import torch

from megaq.checkpoint import safe_unpickle
from megaq.interop import deepspeed as ds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "deepspeed_zero3")
ROOT = os.path.join(FIXTURE, "deepspeed")            # latest_universal -> the universal form
TAG = os.path.join(ROOT, "global_step3")              # the ZeRO-3 tag as saved
RECORD = json.load(open(os.path.join(FIXTURE, "continuation.json")))
HEADS = str(RECORD["architecture"]["num_attention_heads"])


def _convert(source: str, out: str, tp: int = 1, **kw) -> str:
    a = argparse.Namespace(input=source, output=out, overwrite=False, tensor_model_parallel_size=tp,
                           pipeline_model_parallel_size=1, virtual_pipeline_size=1,
                           seq_length=None, make_vocab_size_divisible_by=1, no_optimizer=False,
                           num_attention_heads=int(HEADS), model_flags=None, hf_config=None)
    for k, v in kw.items():
        setattr(a, k, v)
    return ds.convert_to_megaq(a)


@pytest.fixture(scope="module")
def imported_tp2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mq") / "tp2")
    return out, _convert(ROOT, out, tp=2)


def _megaq_full_state(ckpt: str):
    """(full {name: {param, exp_avg, exp_avg_sq}}, saved config, {"step"}) of a megaq
    checkpoint (megaq.interop.megatron_export.full_optimizer_state)."""
    from megaq.interop.common import resolve_checkpoint_dir
    from megaq.interop.megatron_export import full_optimizer_state
    saved, record, full = full_optimizer_state(resolve_checkpoint_dir(ckpt))
    return full, saved, record["model_optim"]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.float().contiguous().flatten().numpy().tobytes()).hexdigest()


# every fixture of a megaq-model run: this one, and any other generate.py wrote (the same
# model and steps; e.g. a bf16 run on GPUs, kept as tests/fixtures/deepspeed_zero3_gpu/)
MEGAQ_MODEL_FIXTURES = sorted(
    d for d in os.listdir(os.path.dirname(FIXTURE)) if d.startswith("deepspeed_zero3")
    and os.path.isfile(os.path.join(os.path.dirname(FIXTURE), d, "continuation.json")))


@pytest.mark.parametrize("fixture", MEGAQ_MODEL_FIXTURES)
@pytest.mark.parametrize("source", ["universal", "zero3 tag"])
def test_imported_weights_and_moments_are_deepspeeds(tmp_path, imported_tp2, source, fixture):
    """Every parameter's fp32 master, exp_avg and exp_avg_sq after the import (the universal
    form at TP 2, resharded; the raw ZeRO-3 tag at TP 1) is bit-equal to what DeepSpeed's
    engine held at the save (SHA-256 of the fp32 bytes, from DeepSpeed's own full-state
    API, not from the files); the step, iteration and consumed samples are DeepSpeed's."""
    base = os.path.join(os.path.dirname(FIXTURE), fixture)
    record = json.load(open(os.path.join(base, "continuation.json")))
    if source == "universal" and fixture == "deepspeed_zero3":
        out, msg = imported_tp2
    else:
        out = str(tmp_path / "out")
        msg = _convert(os.path.join(base, "deepspeed", "global_step3" + (
            "_universal" if source == "universal" else "")), out, tp=2 if source == "universal" else 1)
    assert "optimizer state imported" in msg and "step 3" in msg, msg
    full, saved, state = _megaq_full_state(out)
    assert state["step"] == record["optimizer_step"][0] == 3
    assert set(full) == set(record["state"])
    for name, digest in record["state"].items():
        for key, ds_key in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            assert _sha(full[name][key]) == digest[ds_key]["sha256"], (source, name, key)
    sd = safe_unpickle.load(os.path.join(out, "iter_0000003", "mp_rank_00_000", "model_optim.pt"))
    assert (sd["iteration"], sd["consumed_samples"]) == (3, 12)
    assert sd["lr_scheduler"] == {"num_steps": 3, "num_samples": 12}


def _continue(topo, argv):
    from megaq.config.arguments import parse_config
    from megaq.data.iterator import BatchIterator
    from megaq.pretrain import build_trainer
    config = parse_config(argv, world_size=topo.layout.world_size,
                          ranks_per_node=topo.layout.ranks_per_node, print_notes=False)
    trainer = build_trainer(config, topo)
    dataset = [{"tokens": row.numpy()} for row in torch.tensor(RECORD["tokens"]).flatten(0, 1)]
    t = trainer.config.training
    trainer.p.train_batches = lambda consumed: BatchIterator(
        dataset, t.global_batch_size, t.micro_batch_size, topo.dp_rank, topo.layout.dp,
        consumed_samples=consumed, vocab_size=trainer.config.model.vocab_size)
    state = trainer.train()
    return state.iteration, dict(state.losses)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 1), (1, 2)])
def test_megaq_continues_deepspeeds_run(tmp_path, imported_tp2, tp, pp):
    """megaq resumes DeepSpeed's iteration 3 at TP 2, TP 1 x DP 2 or PP 2 (the tied head's
    copy on the last stage made from the embedding, moments too) with its weights,
    moments and step, and its next 2 losses are the ones DeepSpeed computed on the same
    batches (iteration 4: the imported weights' forward; 5: after one Adam update from
    the imported moments and step).

    Tolerance 1e-5 absolute on losses near 4.7: both are fp32 and differ only in
    summation order (TP all-reduce vs one matmul, DeepSpeed's vs megaq's gradient
    reduction and norm), a few float32 ulps (observed: at most 5e-7); fresh moments
    (checked below) move iteration 5's loss by 2.6e-2, so a lost moment or step shows."""
    from megaq.testing.ranks import run_on_ranks
    out = imported_tp2[0] if tp == 2 else str(tmp_path / "layout")
    if tp == 1:
        _convert(ROOT, out, pipeline_model_parallel_size=pp)
    flags = open(os.path.join(out, "megaq_args.txt")).read().split()
    argv = flags + ["--micro-batch-size", str(RECORD["training"]["micro_batch_size"]),
                    "--train-iters", str(RECORD["iteration"] + len(RECORD["next_losses"])),
                    "--hidden-dropout", "0", "--attention-dropout", "0",
                    "--mock-data", "--log-interval", "1", "--eval-iters", "0",
                    "--load", out, "--no-load-rng", "--data-cache-path", str(tmp_path / "cache")]
    it, losses = run_on_ranks(_continue, 2, tp=tp, pp=pp, args=(argv,))[-1]
    assert it == 5
    got = [losses[4], losses[5]]
    assert got == pytest.approx(RECORD["next_losses"], abs=1e-5), (got, RECORD["next_losses"])
    if tp == 1:
        return
    fresh = run_on_ranks(_continue, 2, tp=tp, args=(argv + ["--no-load-optim"],))[0][1]
    assert abs(fresh[5] - RECORD["next_losses"][1]) > 1e-3, (fresh, RECORD["next_losses"])


# ------------------------------------------------------------------ refusals
class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _cli(*args, cwd):
    """tools/convert_checkpoint.py's main() in this process; (exit code, stderr)."""
    from megaq.cli import convert_checkpoint
    err = io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)  # a crafted os.system("touch PWNED") would land here
    try:
        with contextlib.redirect_stderr(err):
            rc = convert_checkpoint.main(["--from", "deepspeed", "--to", "megaq", *args])
    finally:
        os.chdir(old)
    return subprocess.CompletedProcess(args, rc, "", err.getvalue())


def _copy(tmp_path) -> str:
    dst = str(tmp_path / "ds")
    shutil.copytree(ROOT, dst, symlinks=True)
    return dst


def _one_error_line(r, *needles):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


UNIVERSAL = os.path.join("global_step3_universal", "zero")


@pytest.mark.parametrize("victim", [
    os.path.join(UNIVERSAL, "final_norm.weight", "exp_avg.pt"),
    os.path.join(UNIVERSAL, "optimizer_state.pt"),
    os.path.join("global_step3_universal", "zero_pp_rank_0_mp_rank_00_model_states.pt")])
def test_crafted_file_is_refused_unrun(tmp_path, victim):
    """A universal checkpoint file that pickles os.system is refused with one `error:` line
    naming the class; nothing runs and nothing is written."""
    src = _copy(tmp_path)
    torch.save({"x": _Boom()} if victim.endswith("states.pt") else _Boom(),
               os.path.join(src, victim))
    r = _cli("--input", src, "--output", str(tmp_path / "out"), "--num-attention-heads", HEADS,
             cwd=str(tmp_path))
    _one_error_line(r, "refused unread", "system")
    assert not os.path.exists(tmp_path / "PWNED") and not os.path.exists(tmp_path / "out")


def test_missing_moments_and_escaping_symlink_are_refused(tmp_path):
    """A parameter without its exp_avg.pt is one line naming it and the fix; a file
    replaced by a symlink out of the checkpoint is refused without reading it."""
    src = _copy(tmp_path)
    where = os.path.join(src, UNIVERSAL, "layers.1.mlp.linear_fc2.bias")
    os.remove(os.path.join(where, "exp_avg.pt"))
    r = _cli("--input", src, "--output", str(tmp_path / "out"), "--num-attention-heads", HEADS,
             cwd=str(tmp_path))
    _one_error_line(r, "layers.1.mlp.linear_fc2.bias holds no exp_avg.pt", "--no-optimizer")
    assert not os.path.exists(tmp_path / "out")
    # the weights alone still import
    r = _cli("--input", src, "--output", str(tmp_path / "w"), "--num-attention-heads", HEADS,
             "--no-optimizer", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert _megaq_full_state(str(tmp_path / "w"))[2]["step"] == 0
    outside = tmp_path / "outside.pt"
    torch.save(torch.zeros(32), outside)
    os.symlink(outside, os.path.join(where, "exp_avg.pt"))
    r = _cli("--input", src, "--output", str(tmp_path / "out"), "--num-attention-heads", HEADS,
             cwd=str(tmp_path))
    _one_error_line(r, "exp_avg.pt is a symlink", "refused")


def test_heads_are_required_and_checked(tmp_path):
    r = _cli("--input", ROOT, "--output", str(tmp_path / "out"), cwd=str(tmp_path))
    _one_error_line(r, "--num-attention-heads")
    r = _cli("--input", ROOT, "--output", str(tmp_path / "out"), "--num-attention-heads", "5",
             cwd=str(tmp_path))
    _one_error_line(r, "--num-attention-heads 5 does not fit")
    r = _cli("--input", str(tmp_path), "--output", str(tmp_path / "out"), "--num-attention-heads",
             HEADS, cwd=str(tmp_path))
    _one_error_line(r, "is not a DeepSpeed checkpoint")
    assert not os.path.exists(tmp_path / "out")


# ------------------------------------------------------- a transformers model's run
LLAMA_ROOT = os.path.join(FIXTURE, "deepspeed_llama")
LLAMA_CONFIG = os.path.join(FIXTURE, "llama_config")
LLAMA = json.load(open(os.path.join(FIXTURE, "continuation_llama.json")))


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mq") / "llama_tp2")
    return out, _convert(LLAMA_ROOT, out, tp=2, num_attention_heads=None, hf_config=LLAMA_CONFIG)


def test_transformers_models_run_imports_with_its_moments(llama_tp2):
    """A DeepSpeed ZeRO-3 run of transformers' LlamaForCausalLM (GQA, SwiGLU, untied)
    imports through the Hugging Face mapping at TP 2: mapped back to transformers' names
    and layout by the export's mapping (the other direction, megaq.interop.hf's to_hf),
    every fp32 master and both moments are bit-equal to DeepSpeed's own (q/k/v fused and
    gate/up stacked alike for the moments)."""
    from megaq.interop.hf import MAPPINGS
    from megaq.model import GPTConfig
    out, msg = llama_tp2
    assert "optimizer state imported" in msg and "step 3" in msg, msg
    full, saved, state = _megaq_full_state(out)
    assert state["step"] == 3
    mapping = MAPPINGS["llama"](GPTConfig.from_dict(saved["model"]), LLAMA["architecture"]["vocab_size"])
    seen = set()
    for name, tensors in full.items():
        for key, ds_key in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            for hf_name, t in mapping.to_hf(name, tensors[key]):
                assert _sha(t) == LLAMA["state"][hf_name][ds_key]["sha256"], (hf_name, key)
                seen.add(hf_name)
    assert seen == set(LLAMA["state"])


def test_megaq_continues_a_transformers_models_run(tmp_path, llama_tp2):
    """megaq continues the Llama run at TP 2 with DeepSpeed's next 2 losses (transformers'
    forward there, megaq's here, both fp32 and differing in summation order: 1e-5
    absolute; observed at most 5e-7)."""
    from megaq.testing.ranks import run_on_ranks
    out = llama_tp2[0]
    flags = open(os.path.join(out, "megaq_args.txt")).read().split()
    argv = flags + ["--micro-batch-size", str(LLAMA["training"]["micro_batch_size"]),
                    "--train-iters", "5", "--mock-data", "--log-interval", "1", "--eval-iters", "0",
                    "--load", out, "--no-load-rng", "--data-cache-path", str(tmp_path / "cache")]
    assert LLAMA["tokens"] == RECORD["tokens"]  # _continue feeds the megaq-model run's batches
    it, losses = run_on_ranks(_continue, 2, tp=2, args=(argv,))[-1]
    assert it == 5
    got = [losses[4], losses[5]]
    assert got == pytest.approx(LLAMA["next_losses"], abs=1e-5), (got, LLAMA["next_losses"])


def test_load_of_a_deepspeed_directory_names_the_converter():
    """--load of DeepSpeed's save directory is refused with the command that converts it."""
    from megaq.checkpoint.paths import not_a_checkpoint_root
    msg = not_a_checkpoint_root(ROOT)
    assert "is a DeepSpeed checkpoint" in msg and "--from deepspeed" in msg, msg


@pytest.mark.parametrize("damage,expect", [
    ("no_shapes", "holds no param_shapes"),
    ("truncated", "cannot be read"),
    ("bad_shape", "param_shapes lists 'embedding.word_embeddings.weight' with shape 'x'"),
])
def test_damaged_model_states_are_one_line(tmp_path, damage, expect):
    """A model-state file without param_shapes, cut short, or with a shape that is not one
    is one `error:` line naming the file; nothing is written."""
    src = _copy(tmp_path)
    path = os.path.join(src, "global_step3_universal", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    if damage == "no_shapes":
        torch.save({"module": {}}, path)
    elif damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(100)
    else:
        sd = safe_unpickle.load(path, safe_unpickle.DEEPSPEED)
        sd["param_shapes"][0]["embedding.word_embeddings.weight"] = "x"
        torch.save(sd, path)
    r = _cli("--input", src, "--output", str(tmp_path / "out"), "--num-attention-heads", HEADS,
             cwd=str(tmp_path))
    _one_error_line(r, "zero_pp_rank_0_mp_rank_00_model_states.pt", expect)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("ds_config, bf16", [({"bf16": {"enabled": True}}, True),
                                             ({"bf16": {"enabled": False}}, False), ({}, False)])
def test_a_bf16_runs_flags_carry_bf16(monkeypatch, ds_config, bf16):
    """A DeepSpeed run in bf16 mode continues in bf16: --bf16 is among the flags written
    to megaq_args.txt (the fixture ran in fp32; its ds_config is set here)."""
    from megaq.interop import deepspeed
    real = deepspeed.model_states
    monkeypatch.setattr(deepspeed, "model_states",
                        lambda tag: dict(real(tag), ds_config=ds_config))
    config, _ = deepspeed.load_deepspeed_checkpoint(ROOT, heads=int(HEADS), optimizer=False)
    assert ("--bf16" in config["flags"]) == bf16
