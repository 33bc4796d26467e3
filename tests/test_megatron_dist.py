"""A live Megatron-LM run moves to megaq: the torch_dist import (megaq/interop/megatron_dist.py).

The fixture (tests/fixtures/megatron_torch_dist, made by its generate.py) is written by
megatron-core 0.16.1 itself: a 2-layer GPT trained 5 steps on two gloo ranks (DP 2) with
the distributed optimizer, saved in torch_dist (dp_reshardable optimizer state), then
3 more steps whose losses, and Megatron's own digests of its Adam moments at the save,
are in continuation.json. megaq imports it at another layout (TP 2; TP 1 x DP 2) and
must continue with Megatron's losses; the imported moments must be Megatron's. The same
run saved with the fully_reshardable optimizer state (megatron_fully_reshardable/,
Megatron-LM's --dist-ckpt-optim-fully-reshardable) passes the same checks at TP 2.
"""

import argparse
import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from megaq.interop import megatron as mi
from megaq.checkpoint import safe_unpickle

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "megatron_torch_dist")
SOURCE = os.path.join(FIXTURE, "megatron")  # dp_reshardable
FULLY_RESHARDABLE = os.path.join(FIXTURE, "megatron_fully_reshardable")
RECORD = json.load(open(os.path.join(FIXTURE, "continuation.json")))


def _convert(out: str, tp: int = 1, source: str = SOURCE, **kw) -> str:
    a = argparse.Namespace(input=source, output=out, overwrite=False, tensor_model_parallel_size=tp,
                           pipeline_model_parallel_size=1, virtual_pipeline_size=1,
                           seq_length=None, make_vocab_size_divisible_by=1, no_optimizer=False)
    for k, v in kw.items():
        setattr(a, k, v)
    return mi.convert_to_megaq(a)


@pytest.fixture(scope="module")
def imported_tp2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mq") / "tp2")
    msg = _convert(out, tp=2)
    return out, msg


@pytest.fixture(scope="module")
def imported_fully_reshardable_tp2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mq") / "fr_tp2")
    msg = _convert(out, tp=2, source=FULLY_RESHARDABLE)
    return out, msg


def _fixed_batches(topo, config):
    """The fixture's token stream as megaq's batch iterator (Megatron's sampler order)."""
    from megaq.data.iterator import BatchIterator
    tokens = torch.tensor(RECORD["tokens"]).flatten(0, 1)
    dataset = [{"tokens": row.numpy()} for row in tokens]
    t = config.training
    return lambda consumed: BatchIterator(dataset, t.global_batch_size, t.micro_batch_size,
                                          topo.dp_rank, topo.layout.dp, consumed_samples=consumed,
                                          vocab_size=config.model.vocab_size)


def _continue(topo, argv):
    from megaq.config.arguments import parse_config
    from megaq.pretrain import build_trainer
    config = parse_config(argv, world_size=topo.layout.world_size,
                          ranks_per_node=topo.layout.ranks_per_node, print_notes=False)
    trainer = build_trainer(config, topo)
    trainer.p.train_batches = _fixed_batches(topo, trainer.config)
    state = trainer.train()
    return state.iteration, state.consumed_samples, dict(state.losses)


@pytest.mark.parametrize("tp,pp,imported", [(2, 1, "imported_tp2"), (1, 1, None), (1, 2, None),
                                             (2, 1, "imported_fully_reshardable_tp2")])
def test_megaq_continues_megatrons_run(tmp_path, request, tp, pp, imported):
    """megaq resumes Megatron's iteration 5 at TP 2, TP 1 x DP 2 or PP 2 with Megatron's
    moments, step, LR and position, and its next 3 losses are Megatron's (from either
    optimizer layout of the same run: dp_reshardable; fully_reshardable at TP 2).

    Tolerance 1e-5 absolute on losses near 4: both runs are fp32 and differ only in
    summation order (TP all-reduce vs one matmul, the DP gradient reduction), a few
    float32 ulps of the loss (observed: at most 5e-7 over the 3 steps); a lost moment,
    step count (bias correction) or LR changes them by more than 1e-2 (checked below
    with fresh moments)."""
    from megaq.testing.ranks import run_on_ranks
    if imported:
        out = request.getfixturevalue(imported)[0]
    else:
        out = str(tmp_path / "layout")
        _convert(out, tp=1, pipeline_model_parallel_size=pp)
    flags = open(os.path.join(out, "megaq_args.txt")).read().split()
    train = RECORD["training"]
    argv = flags + ["--micro-batch-size", str(train["micro_batch_size"]),
                    "--train-iters", str(RECORD["iteration"] + len(RECORD["next_losses"])),
                    "--mock-data", "--log-interval", "1", "--eval-iters", "0",
                    "--seed", str(train["seed"]), "--load", out, "--no-load-rng",
                    "--data-cache-path", str(tmp_path / "cache")]
    it, consumed, losses = run_on_ranks(_continue, 2, tp=tp, pp=pp, args=(argv,))[-1]
    assert it == 8 and consumed == 32
    got = [losses[i] for i in (6, 7, 8)]
    assert got == pytest.approx(RECORD["next_losses"], abs=1e-5), (got, RECORD["next_losses"])
    if imported != "imported_tp2":
        return
    # the same weights with fresh moments (--no-load-optim, step 0) continue differently:
    # the comparison above can tell a lost optimizer state
    fresh = run_on_ranks(_continue, 2, tp=tp, args=(argv + ["--no-load-optim"],))[0][2]
    assert max(abs(fresh[i] - m) for i, m in zip((6, 7, 8), RECORD["next_losses"])) > 1e-2


def _megaq_full_state(ckpt: str):
    """(full {name: {param, exp_avg, exp_avg_sq}}, saved config, {"step"}) of a megaq
    checkpoint (megaq.interop.megatron_export.full_optimizer_state)."""
    from megaq.interop.common import resolve_checkpoint_dir
    from megaq.interop.megatron_export import full_optimizer_state
    saved, record, full = full_optimizer_state(resolve_checkpoint_dir(ckpt))
    return full, saved, record["model_optim"]


def test_progress_bars_start_no_thread_that_forked_ranks_could_deadlock_on():
    """The conversion's progress bars (megaq.interop.common.progress) start no thread.
    tqdm's monitor thread takes tqdm's lock every 10 s: a process forked while it held the
    lock (ranks forked from a test process whose fixture converted a checkpoint with bars,
    as the test above's) would wait forever at its own first bar."""
    import threading
    from tqdm import tqdm
    from megaq.interop.common import progress
    if tqdm.monitor is not None:  # another library's bar started one: not this test's subject
        tqdm.monitor.exit()
        tqdm.monitor = None
    before = {t.ident for t in threading.enumerate()}
    assert list(progress(range(3), "converting")) == [0, 1, 2]
    assert {t.ident for t in threading.enumerate()} == before


@pytest.mark.parametrize("imported", ["imported_tp2", "imported_fully_reshardable_tp2"])
def test_imported_moments_are_megatrons(request, imported):
    """Every parameter's exp_avg / exp_avg_sq after the import (at TP 2, resharded) equals
    what Megatron's optimizer held at the save (continuation.json's digests, taken from
    megatron-core's own per-parameter ranges, not from the checkpoint's buckets or model-
    space tensors): exact values at five positions, sums to float64 rounding. The step
    and position too. Either optimizer layout of the run."""
    out, msg = request.getfixturevalue(imported)
    assert "optimizer state imported" in msg and "step 5" in msg and "TP 2" in msg
    full, saved, state = _megaq_full_state(out)
    assert state["step"] == 5
    assert len(RECORD["moments"]) == len(full) == 15
    for mname, digest in RECORD["moments"].items():
        gname = mi._megaq_name(mname, 0, "fixture")[0]
        for key, d in digest.items():
            t = full[gname][key]
            if gname in ("embedding.word_embeddings.weight", "output_layer.weight"):
                t = t[:RECORD["architecture"]["vocab_size"]]  # megaq's vocab padding rows
            flat = t.flatten().double()
            assert [float(flat[i]) for i in d["at"]] == d["values"], (gname, key)
            assert float(flat.sum()) == pytest.approx(d["sum"], rel=1e-9, abs=1e-12)
            assert float((flat * flat).sum()) == pytest.approx(d["sum_sq"], rel=1e-9)


def test_record_carries_the_run_position(imported_tp2):
    """The iteration, consumed samples and LR schedule are Megatron's (in iterations)."""
    out = imported_tp2[0]
    sd = safe_unpickle.load(os.path.join(out, "iter_0000005", "mp_rank_01_000", "model_optim.pt"))
    assert (sd["iteration"], sd["consumed_samples"]) == (5, 20)
    assert sd["layout"]["tp"] == 2
    lr = sd["lr_scheduler"]
    assert (lr["num_steps"], lr["num_samples"], lr["warmup_steps"], lr["decay_steps"],
            lr["unit"], lr["decay_style"], lr["max_lr"]) == (5, 20, 2, 20, "iterations",
                                                             "constant", 0.003)


def test_no_optimizer_imports_weights_only(tmp_path):
    msg = _convert(str(tmp_path / "w"), tp=1, no_optimizer=True)
    assert "not imported" in msg
    full, saved, state = _megaq_full_state(str(tmp_path / "w"))
    assert state["step"] == 0 and os.path.isdir(tmp_path / "w" / "iter_0000000")


def _copy_fixture(tmp_path) -> str:
    dst = str(tmp_path / "mlm")
    shutil.copytree(SOURCE, dst)
    return dst


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _cli(*args, cwd, route=("megatron", "megaq")):
    """tools/convert_checkpoint.py's main() (megaq.cli.convert_checkpoint) in this process
    (the subprocess form is tests/test_megatron_import.py's); returns (exit code, stderr)."""
    from megaq.cli import convert_checkpoint
    err = io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)  # a crafted os.system("touch PWNED") would land here
    try:
        with contextlib.redirect_stderr(err):
            rc = convert_checkpoint.main(["--from", route[0], "--to", route[1], *args])
    finally:
        os.chdir(old)
    return subprocess.CompletedProcess(args, rc, "", err.getvalue())


@pytest.mark.parametrize("victim", [".metadata", "common.pt"])
def test_crafted_index_or_common_is_refused_unrun(tmp_path, victim):
    """A .metadata (plain pickle) or common.pt (torch.save) naming os.system is refused
    with one `error:` line naming the class; nothing runs and nothing is written."""
    src = _copy_fixture(tmp_path)
    path = os.path.join(src, "iter_0000005", victim)
    if victim == ".metadata":
        with open(path, "wb") as f:
            pickle.dump(_Boom(), f)
    else:
        torch.save({"args": _Boom()}, path)
    r = _cli("--input", src, "--output", str(tmp_path / "out"), cwd=str(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "posix.system" in lines[0] or "os.system" in lines[0]
    assert "refused unread" in lines[0]
    assert not os.path.exists(tmp_path / "PWNED") and not os.path.exists(tmp_path / "out")


def test_crafted_chunk_and_escaping_path_are_refused(tmp_path):
    """A chunk of a .distcp file holding a pickled call, and an index pointing a chunk
    outside the directory, are refused in one line each."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    src = _copy_fixture(tmp_path)
    it = os.path.join(src, "iter_0000005")
    index = safe_unpickle.load(os.path.join(it, ".metadata"), safe_unpickle.DCP_INDEX)
    key = MetadataIndex("optimizer.distributed.dp_group_idx_0.per_bucket_numel/shard_0_1")
    info = index.storage_data[key]
    buf = io.BytesIO()
    torch.save(_Boom(), buf)
    evil = buf.getvalue()
    with open(os.path.join(it, "__9_9.distcp"), "wb") as f:
        f.write(evil)
    info.relative_path, info.offset, info.length = "__9_9.distcp", 0, len(evil)
    with open(os.path.join(it, ".metadata"), "wb") as f:
        pickle.dump(index, f)
    r = _cli("--input", src, "--output", str(tmp_path / "out"), cwd=str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "refused unread" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "PWNED")
    info.relative_path, info.offset, info.length = "../../escape.distcp", 0, 10
    with open(os.path.join(it, ".metadata"), "wb") as f:
        pickle.dump(index, f)
    r = _cli("--input", src, "--output", str(tmp_path / "out"), cwd=str(tmp_path))
    assert r.returncode == 2 and "not a __N_M.distcp file" in r.stderr, r.stderr


def test_other_optimizer_layouts_are_refused_in_one_line(tmp_path):
    """An optimizer state in a layout megaq does not read (megatron-core's deprecated
    fully_sharded_model_space: flattened slices of each parameter) is refused in one
    line naming the layouts that import and --no-optimizer, writing nothing."""
    src = _copy_fixture(tmp_path)
    path = os.path.join(src, "iter_0000005", "common.pt")
    common = safe_unpickle.load(path, safe_unpickle.MEGATRON)
    common["optimizer"]["param_state_sharding_type"] = "fully_sharded_model_space"
    torch.save(common, path)
    r = _cli("--input", src, "--output", str(tmp_path / "out"), cwd=str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "'fully_sharded_model_space' layout" in r.stderr and "--no-optimizer" in r.stderr
    assert "'fully_reshardable'" in r.stderr and not os.path.exists(tmp_path / "out")


def test_layout_flags_are_honoured_or_refused(tmp_path, imported_tp2):
    """--tensor-model-parallel-size is honoured (it was silently dropped); a layout the
    model cannot take is refused in one line, writing nothing."""
    out = imported_tp2[0]
    assert "--tensor-model-parallel-size 2" in open(os.path.join(out, "megaq_args.txt")).read()
    assert sorted(os.listdir(os.path.join(out, "iter_0000005"))) == [
        "MANIFEST.sha256.json", "mp_rank_00_000", "mp_rank_01_000"]
    r = _cli("--input", SOURCE, "--output", str(tmp_path / "o3"), "--tensor-model-parallel-size",
             "3", cwd=str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "TP 3" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "o3")


# megatron-core loads a checkpoint megaq wrote (--to megatron) into the fixture's model,
# DDP and distributed optimizer (generate.py's build_megatron, one gloo rank: DP 1), and
# reports its logits on a probe batch, its own view of the Adam moments, and the losses
# of its next 3 training steps.
LOADER = r'''
import os, sys, torch, torch.distributed as dist, warnings
warnings.filterwarnings("ignore")
fixture, ckpt, out, port = sys.argv[1:5]
sys.path.insert(0, fixture)
import generate as g
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
g._shim_cuda()
from megatron.core import dist_checkpointing
model, opt, sched = g.build_megatron()
# megatron-core's torch-Adam fallback (no TE / apex on a CPU) needs the optimizer state to
# exist before a load: its own dummy initialisation, replaced in place by the load
for o in getattr(opt, "chained_optimizers", [opt]):
    o._init_optimizer_states_with_dummy_values()
state = {"model": model.module.sharded_state_dict()}
state["optimizer"] = opt.sharded_state_dict(
    state["model"], is_loading=True, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
loaded = dist_checkpointing.load(state, ckpt)
model.module.load_state_dict(loaded["model"])
with torch.no_grad():  # fp32 params: the main params are views of the (leaf) weights
    opt.load_state_dict(loaded["optimizer"])
# megatron-core's torch-Adam fallback keeps the per-parameter step of the dummy state on a
# dp_reshardable load (TE's FusedAdam, on a GPU, reads the param groups' step instead);
# set it from the loaded param groups, as Megatron saved it (a load of Megatron's own
# fixture checkpoint needs the same)
for o in getattr(opt, "chained_optimizers", [opt]):
    for group in o.optimizer.param_groups:
        for p in group["params"]:
            o.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))
sched.load_state_dict(loaded["opt_param_scheduler"])
data = g.batches(g.TRAIN_STEPS + g.NEXT_STEPS)
pos = torch.arange(g.ARCH["seq_length"]).unsqueeze(0)
with torch.no_grad():
    logits = model.module(data[5, :, :-1], pos, None)
moments = g._moment_digests(model, opt, 0)
lrs = []
step = g.make_train_step(model, opt, sched, data, lrs)
losses = [step(s) for s in range(g.TRAIN_STEPS, g.TRAIN_STEPS + g.NEXT_STEPS)]
torch.save({"logits": logits, "moments": moments, "losses": losses, "lrs": lrs,
            "iteration": loaded["iteration"],
            "consumed": loaded["args"].consumed_train_samples}, out)
'''


def test_to_megatron_loads_in_megatron_core(tmp_path, imported_tp2):
    """--to megatron: megatron-core 0.16.1 loads megaq's checkpoint (the fixture imported at
    TP 2, written back) with its distributed optimizer: the logits on a probe batch equal
    megaq's (fp32, same weights: summation order only, 1e-5), its Adam moments are the
    ones Megatron saved in the first place (the round trip is exact), and its next
    three steps give the losses of the original Megatron run (1e-5, as above)."""
    pytest.importorskip("megatron.core")  # the loader runs megatron-core itself
    import socket
    from megaq.checkpoint.consolidate import load_consolidated_model
    out = str(tmp_path / "mlm")
    back = ("megaq", "megatron")
    r = _cli("--input", imported_tp2[0], "--output", out, "--megatron-transformer-impl", "local",
             cwd=str(tmp_path), route=back)
    assert r.returncode == 0, r.stderr
    r = _cli("--input", imported_tp2[0], "--output", out, cwd=str(tmp_path), route=back)
    assert r.returncode == 2 and "exists" in r.stderr and r.stderr.count("\n") == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    result = str(tmp_path / "result.pt")
    p = subprocess.run([sys.executable, "-c", LOADER, FIXTURE, os.path.join(out, "iter_0000005"),
                        result, port], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(result, weights_only=False)  # our own subprocess's output
    assert (got["iteration"], got["consumed"]) == (5, 20)
    model, _ = load_consolidated_model(os.path.join(imported_tp2[0], "iter_0000005"))
    model.eval()
    probe = torch.tensor(RECORD["tokens"])[5, :, :-1]
    with torch.no_grad():
        mine = model(probe)[..., :RECORD["architecture"]["vocab_size"]]
    torch.testing.assert_close(got["logits"], mine, rtol=0, atol=1e-5)
    assert got["moments"] == RECORD["moments"]
    assert got["losses"] == pytest.approx(RECORD["next_losses"], abs=1e-5)
    assert got["lrs"] == RECORD["lrs"][5:]


def _train_and_save(topo, argv):
    from megaq.pretrain import main
    return main(argv, topo=topo).iteration


def test_qk_layernorm_and_rope_scaling_round_trip_through_megatron(tmp_path):
    """A megaq run with --qk-layernorm and --use-rope-scaling, written --to megatron
    (q_layernorm / k_layernorm in megatron-core's parameter order, the flags in its
    args) and read back --from megatron at TP 2: the same weights and Adam moments, and
    the flags among the architecture's."""
    from megaq.interop.megatron_export import full_optimizer_state as _full_state
    from megaq.testing.ranks import run_on_ranks
    save = str(tmp_path / "run")
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--qk-layernorm",
            "--use-rope-scaling", "--rope-scaling-factor", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-2", "--mock-data",
            "--vocab-size", "64", "--make-vocab-size-divisible-by", "64", "--eval-iters", "0",
            "--save", save, "--save-interval", "2", "--ckpt-format", "torch",
            "--data-cache-path", str(tmp_path / "cache")]
    assert run_on_ranks(_train_and_save, 1, args=(argv,))[0] == 2
    mlm, back = str(tmp_path / "mlm"), str(tmp_path / "back")
    r = _cli("--input", save, "--output", mlm, cwd=str(tmp_path), route=("megaq", "megatron"))
    assert r.returncode == 0, r.stderr
    r = _cli("--input", mlm, "--output", back, "--tensor-model-parallel-size", "2",
             cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    flags = open(os.path.join(back, "megaq_args.txt")).read().split()
    assert "--qk-layernorm" in flags and "--use-rope-scaling" in flags
    assert flags[flags.index("--rope-scaling-factor") + 1] == "16.0"
    _, _, before = _full_state(os.path.join(save, "iter_0000002"))
    _, _, after = _full_state(os.path.join(back, "iter_0000002"))
    assert set(before) == set(after) and any("q_layernorm" in n for n in before)
    for name in before:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(before[name][k], after[name][k]), (name, k)
