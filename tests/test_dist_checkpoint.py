"""--ckpt-format torch_dist with the real training loop on gloo ranks (fp32, CPU).

Launches (few, each several checks):
  U: TP2 x PP2 x DP2, full ZeRO++ (hpZ, qwZ, qgZ + error feedback), --async-save,
     4 iterations, background saves at 2 and 4 (the uninterrupted run);
  resumed from U's (background-written) iteration 2, synchronous saves at 3 and 4:
     losses 3, 4 bit-identical to U's; then from its (synchronous) iteration 3:
     loss 4 bit-identical;
  R: TP2 x PP2 x DP2 with hpZ only (ZeRO++ without quantization: every layout then
     computes the same numbers up to fp32 summation order), 4 iterations, save at 2;
  from R's iteration 2 as TP1 x PP1 x DP4 plain ZeRO-3 (saving at 3), as TP1 x PP2
     (interleaved, 2 chunks per stage) x DP2; and from the TP1 x PP1 x DP4 plain
     ZeRO-3 save back to ZeRO++ (hpZ) as TP2 x PP1 x DP4: losses within 1e-5 of R's.
Also: flat ranges -> boxes, bytes a rank materialises while saving and loading, the
engine's sharded state in and out (the interface the format reads and fills).
"""

import dataclasses
import os

import pytest
import torch

from megaq import pretrain
from megaq.checkpoint import dcp_chunks, dcp_format, staging
from megaq.checkpoint.errors import CheckpointError
from megaq.checkpoint.paths import common_file, error_feedback_file, iteration_dir, read_tracker
from megaq.checkpoint.save import save_checkpoint
from megaq.testing.ranks import run_on_ranks
from tests.test_checkpoint_resume import copy_checkpoint, model_argv

ARCH = ["--num-layers", "4", "--swiglu", "--group-query-attention", "--num-query-groups", "2"]
ZEROPP = ["--zero-hpz-partition-size", "2", "--zero-quantized-weights",
          "--zero-quantized-gradients", "--zero-gradient-error-feedback",
          "--zero-quantization-block-size", "32"]


def _train(topo, argv):
    staging.HOST_BYTES.reset()
    s = pretrain.main(argv, topo=topo)
    return {"losses": s.losses, "host_peak": staging.HOST_BYTES.peak,
            "state_bytes": dcp_format.LAST_SHARD_BYTES.get("save", 0),
            "load_bytes": dcp_format.LAST_SHARD_BYTES.get("load", 0)}


def layout_argv(tp, pp, extra=()):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            *extra]


def run(tmp, world, tp, pp, iters, extra, **kw):
    argv = model_argv(str(tmp), iters, ARCH + layout_argv(tp, pp, extra))
    return run_on_ranks(_train, world, tp=tp, pp=pp, args=(argv,), **kw)


def test_flat_range_boxes_cover_the_range_in_order():
    shape = (3, 4, 5)
    for a, b in [(0, 60), (7, 8), (3, 47), (20, 40), (19, 41), (0, 1), (59, 60)]:
        seen = []
        for offsets, sizes, flat_start in dcp_chunks.flat_range_boxes(shape, a, b):
            idx = torch.arange(60).view(shape)
            box = idx[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert box.flatten().tolist() == list(range(flat_start, flat_start + box.numel()))
            seen += box.flatten().tolist()
        assert seen == list(range(a, b))
        assert len(dcp_chunks.flat_range_boxes(shape, a, b)) <= 2 * len(shape) - 1


def test_engine_sharded_state_in_and_out():
    """engine.sharded_state() copied out and handed to a second engine becomes its state
    (masters, moments, step); carried without the optimizer state, the second engine's
    moments start at zero; another engine's pieces are refused."""
    from megaq.parallel.topology import Layout, build_topology
    from megaq.zero import ZeroConfig, build_engine
    from tests import zero_harness as H

    def engine():
        torch.manual_seed(0)
        model = H.GPTModel(H.model_config())
        return model, build_engine([model], build_topology(Layout(1), 0), ZeroConfig(block_size=8))

    model, a = engine()
    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.seq_length + 1))
    for _ in range(2):
        a.zero_grad()
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        a.finish_grad_sync()
        a.step(1e-2)
    sd = a.sharded_state()
    assert sd.step == 2 and sd.keys == ("param", "exp_avg", "exp_avg_sq")
    copied = dataclasses.replace(sd, params=[dataclasses.replace(
        p, tensors={k: t.clone() for k, t in p.tensors.items()}) for p in sd.params])
    _, b = engine()
    b.load_sharded_state(copied)
    want, got = a.full_state(), b.full_state()
    assert got["step"] == 2 and want["params"].keys() == got["params"].keys()
    assert all(torch.equal(want["params"][n][k], got["params"][n][k])
               for n in want["params"] for k in want["params"][n])
    _, c = engine()
    weights = dataclasses.replace(copied, step=0, keys=("param",), params=[dataclasses.replace(
        p, tensors={"param": p.tensors["param"]}) for p in copied.params])
    c.load_sharded_state(weights)
    got = c.full_state()
    assert got["step"] == 0 and any(e["exp_avg"].abs().sum() > 0 for e in want["params"].values())
    assert all(torch.equal(e["param"], want["params"][n]["param"]) and not e["exp_avg"].any()
               and not e["exp_avg_sq"].any() for n, e in got["params"].items())
    with pytest.raises(ValueError, match="this rank's shard of every parameter"):
        c.load_sharded_state(dataclasses.replace(copied, params=copied.params[1:]))


def test_exact_resume_full_zeropp_sync_and_async(tmp_path):
    ck = tmp_path / "u"
    u = run(tmp_path, 8, 2, 2, 4, ZEROPP + ["--save", str(ck), "--save-interval", "2",
                                            "--async-save", "--gpus-per-node", "4"],
            ranks_per_node=4, hpz_size=2)
    assert read_tracker(str(ck)) == 4
    it2 = iteration_dir(str(ck), 2)
    assert os.path.isfile(common_file(it2))
    assert os.path.isfile(error_feedback_file(it2, 7))
    # the background save staged exactly what the rank writes: its own shard
    for r in u:
        assert 0 < r["host_peak"] == r["state_bytes"]
    copy_checkpoint(str(ck), 2, str(tmp_path / "c2"))
    b = run(tmp_path, 8, 2, 2, 4, ZEROPP + ["--load", str(tmp_path / "c2"), "--save",
                                            str(tmp_path / "c2"), "--save-interval", "1",
                                            "--gpus-per-node", "4"],
            ranks_per_node=4, hpz_size=2)
    assert [b[0]["losses"][i] for i in (3, 4)] == [u[0]["losses"][i] for i in (3, 4)]
    # a synchronous save: at most one copy of the shard (DCP's writer keeps its copies of
    # the pieces until the file is closed); the load: one saved chunk at a time
    for r in b:
        assert 0 < r["host_peak"] <= max(r["state_bytes"], r["load_bytes"])
    copy_checkpoint(str(tmp_path / "c2"), 3, str(tmp_path / "c3"))
    c = run(tmp_path, 8, 2, 2, 4, ZEROPP + ["--load", str(tmp_path / "c3"),
                                            "--gpus-per-node", "4"],
            ranks_per_node=4, hpz_size=2)
    assert c[0]["losses"][4] == u[0]["losses"][4]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("r")
    r = run(tmp, 8, 2, 2, 4, ["--zero-hpz-partition-size", "2", "--save", str(tmp / "ck"),
                              "--save-interval", "2"], hpz_size=2)
    return tmp, r[0]["losses"]


def _close(got, want, iters):
    for i in iters:
        assert got[i] == pytest.approx(want[i], rel=1e-5), (i, got[i], want[i])


def test_reshard_to_dp4_plain_zero3_and_back_to_zeropp(reference, tmp_path):
    tmp, want = reference
    copy_checkpoint(str(tmp / "ck"), 2, str(tmp_path / "a"))
    a = run(tmp_path, 4, 1, 1, 4, ["--load", str(tmp_path / "a"), "--save", str(tmp_path / "a"),
                                   "--save-interval", "1"])
    _close(a[0]["losses"], want, (3, 4))
    # every rank materialised at most its own shard: one saved chunk at a time while
    # loading, its pieces' copies while saving
    for r in a:  # (a rank may own nothing but padding of this tiny model)
        assert r["host_peak"] <= max(r["load_bytes"], r["state_bytes"])
    assert a[0]["host_peak"] > 0
    copy_checkpoint(str(tmp_path / "a"), 3, str(tmp_path / "b"))
    b = run(tmp_path, 8, 2, 1, 4, ["--load", str(tmp_path / "b"),
                                   "--zero-hpz-partition-size", "2"], hpz_size=2)
    _close(b[0]["losses"], want, (4,))


def test_reshard_to_interleaved_pipeline(reference, tmp_path):
    tmp, want = reference
    copy_checkpoint(str(tmp / "ck"), 2, str(tmp_path / "a"))
    a = run(tmp_path, 4, 1, 2, 4, ["--load", str(tmp_path / "a"),
                                   "--num-layers-per-virtual-pipeline-stage", "1"])
    _close(a[0]["losses"], want, (3, 4))


def _load_variants(topo, argv, ck, ck_no_optim):
    """Engines built by pretrain.build_trainer from a torch_dist checkpoint: in full,
    with --no-load-optim / --no-load-rng, and the refusals."""
    from megaq.config.arguments import parse_config
    from megaq.runtime.failure import AgreedError
    from megaq.pretrain import build_trainer

    def trainer(*extra):
        config = parse_config(argv + list(extra), world_size=topo.layout.world_size)
        return build_trainer(config, topo)

    def states(t):
        return [(st.master.clone(), st.state["exp_avg"].clone(), st.state["exp_avg_sq"].clone())
                for st in t.p.engine.optimizer.states], t.p.engine.step_count

    full, full_step = states(trainer("--load", ck))
    weights, weights_step = states(trainer("--load", ck, "--no-load-optim", "--no-load-rng"))
    out = {"full_step": full_step, "weights_step": weights_step,
           "masters_equal": all(torch.equal(a[0], b[0]) for a, b in zip(full, weights)),
           "moments_full_nonzero": any(bool(a[1].abs().sum() > 0) for a in full),
           "moments_zero": all(not a[1].any() and not a[2].any() for a in weights)}
    # a checkpoint written without optimizer state (save_optim=False)
    t = trainer("--load", ck)
    save_checkpoint(ck_no_optim, 2, config=t.p.config, topo=topo, engine=t.p.engine,
                    lr_schedule=t.p.lr_schedule, consumed_samples=16, save_optim=False)
    errors = {}
    for name, extra in [("no_optim", ["--load", ck_no_optim]),
                        ("arch", ["--load", ck, "--hidden-size", "64"])]:
        try:
            trainer(*extra)
        except (CheckpointError, AgreedError) as e:
            errors[name] = str(e)
    without, _ = states(trainer("--load", ck_no_optim, "--no-load-optim"))
    out["no_optim_loads_weights"] = all(torch.equal(a[0], b[0]) for a, b in zip(full, without))
    # Megatron's --finetune: the weights only, from iteration 0
    ft = trainer("--load", ck_no_optim, "--finetune")
    tuned, tuned_step = states(ft)
    out["finetune"] = {"iteration": ft.state.iteration, "step": tuned_step,
                       "weights": all(torch.equal(a[0], b[0]) for a, b in zip(full, tuned)),
                       "moments_zero": all(not a[1].any() and not a[2].any() for a in tuned)}
    out["errors"] = errors
    return out


def test_no_load_optim_no_save_optim_and_refusals(tmp_path):
    ck, ck2 = str(tmp_path / "ck"), str(tmp_path / "ck2")
    # ZeRO stage 0 (replicated partitions: DP rank 0 writes them, every rank reads them)
    argv = model_argv(str(tmp_path), 2, ["--zero-stage", "0"])
    run_on_ranks(_train, 2, args=(argv + ["--save", ck],))
    out = run_on_ranks(_load_variants, 2, args=(argv, ck, ck2))[0]
    assert out["full_step"] == 2 and out["moments_full_nonzero"]
    assert out["weights_step"] == 0 and out["moments_zero"] and out["masters_equal"]
    assert out["no_optim_loads_weights"]
    assert out["finetune"] == {"iteration": 0, "step": 0, "weights": True, "moments_zero": True}
    assert "was saved with --no-save-optim (no optimizer state)" in out["errors"]["no_optim"]
    assert "--no-load-optim" in out["errors"]["no_optim"]
    assert "different architecture: --hidden-size 64 (checkpoint: 32)" in out["errors"]["arch"]
