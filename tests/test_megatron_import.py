"""Megatron-LM checkpoint import (megaq/interop/megatron.py).

The source checkpoints are written by megatron-core itself: its GPTModel (local layer
spec: RMSNorm, SwiGLU, grouped-query attention, RoPE, untied head) is built on CPU over
gloo, at TP 1 and at TP 2 (two processes, each saving its own shard, as Megatron-LM's
mp_rank_00 / mp_rank_01 hold), and its state_dict() is saved in Megatron-LM's torch
format (iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt with args, iteration, optimizer
state), with megatron-core's logits for a fixed batch. The imported weights must give
those logits in megaq's one-process model. Pipeline-parallel (and virtual-stage)
checkpoints, which would need megatron-core's pipeline schedules to produce, are cut
from the TP 1 state dict by Megatron's documented rules (column-parallel rows,
row-parallel columns, [gate_r; up_r] for SwiGLU fc1, stage-local layer numbers) and
must import to exactly the same tensors.
"""

import argparse
import os
import subprocess
import sys

import pytest
import torch

from megaq.interop import megatron as mi

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=48, seq_length=16, vocab=128)

WRITER = r'''
import argparse, os, sys, torch, torch.distributed as dist
out, port, rank, tp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
QK = sys.argv[5] == "qk"  # --qk-layernorm and --use-rope-scaling (Llama 3.1 RoPE)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(tp),
                  LOCAL_RANK=str(rank))
dist.init_process_group("gloo", rank=rank, world_size=tp)
torch.cuda.current_device = lambda: "cpu"  # mcore's RoPE moves its table to the current CUDA device
import contextlib
from megatron.core.tensor_parallel import random as mcore_random
# mcore forks its CUDA RNG stream around attention dropout (0 here); there is no CUDA.
mcore_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(tp, 1)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
torch.manual_seed(0)
L, H, NH, NG, F, S, V = 4, 32, 4, 2, 48, 16, 128
cfg = TransformerConfig(num_layers=L, hidden_size=H, num_attention_heads=NH, num_query_groups=NG,
    ffn_hidden_size=F, use_cpu_initialization=True, gated_linear_unit=True,
    activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=1e-5,
    add_bias_linear=False, bias_dropout_fusion=False, apply_rope_fusion=False,
    masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05, qk_layernorm=QK)
spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=QK)
BASE = 1000000 if QK else 10000  # head dim 8: wavelengths 6283 (smoothed) and 198,692 (scaled)
model = GPTModel(config=cfg, transformer_layer_spec=spec,
                 vocab_size=V, max_sequence_length=S, position_embedding_type="rope",
                 rotary_base=BASE, share_embeddings_and_output_weights=False,
                 rope_scaling=QK, rope_scaling_factor=8.0).eval()
with torch.no_grad():  # mcore zero-inits norms' gamma at 1: perturb so a norm mix-up shows
    for n, p in model.named_parameters():
        if "layernorm" in n:
            p.add_(0.1 * torch.randn_like(p))
ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))
pos = torch.arange(S).expand(2, S) + (20000 if QK else 0)  # where the RoPE scaling matters
causal = torch.triu(torch.ones(1, 1, S, S), diagonal=1).bool()  # True = masked (mcore's default builds it on CUDA)
with torch.no_grad():
    logits = model(ids, pos, attention_mask=causal)  # this TP rank's vocabulary slice
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous())
    logits = torch.cat(parts, dim=-1)
args = argparse.Namespace(num_layers=L, hidden_size=H, ffn_hidden_size=F, num_attention_heads=NH,
    group_query_attention=True, num_query_groups=NG, kv_channels=H // NH, seq_length=S,
    max_position_embeddings=S, position_embedding_type="rope", rotary_base=BASE,
    use_rope_scaling=QK, rope_scaling_factor=8.0,
    rotary_percent=1.0, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
    add_bias_linear=False, untie_embeddings_and_output_weights=True,
    make_vocab_size_divisible_by=128, padded_vocab_size=V, vocab_size=None, num_experts=None,
    qk_layernorm=QK, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
    params_dtype=torch.float32, ckpt_format="torch")
sd = model.state_dict()  # this TP rank's shard, exactly what Megatron-LM saves for it
torch.save({"state_dict": sd, "args": args, "ids": ids, "pos": pos, "logits": logits},
           f"{out}.rank{rank}")
'''


def _run_megatron_core(out: str, tp: int, variant: str = "plain"):
    """Build and run megatron-core's GPTModel on `tp` gloo ranks; -> per-rank blobs.
    variant "qk": with --qk-layernorm and --use-rope-scaling."""
    pytest.importorskip("megatron.core")
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, out, port, str(r), str(tp), variant],
                              env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(tp)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-4000:]
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(tp)]


@pytest.fixture(scope="module")
def mcore_model(tmp_path_factory):
    """(megatron-core state_dict, Megatron args Namespace, input ids, mcore logits), TP 1."""
    blob = _run_megatron_core(str(tmp_path_factory.mktemp("mcore") / "mcore.pt"), 1)[0]
    return blob["state_dict"], blob["args"], blob["ids"], blob["logits"]


@pytest.fixture(scope="module")
def mcore_tp2(tmp_path_factory):
    """([rank 0 state_dict, rank 1 state_dict], args, ids, logits): megatron-core at TP 2,
    each rank's own shard (Megatron-LM's mp_rank_00 / mp_rank_01 contents)."""
    blobs = _run_megatron_core(str(tmp_path_factory.mktemp("mcore2") / "mcore.pt"), 2)
    return [b["state_dict"] for b in blobs], blobs[0]["args"], blobs[0]["ids"], blobs[0]["logits"]


@pytest.fixture(scope="module")
def mcore_qk_tp2(tmp_path_factory):
    """As mcore_tp2, the model with --qk-layernorm and --use-rope-scaling."""
    blobs = _run_megatron_core(str(tmp_path_factory.mktemp("mcoreqk") / "mcore.pt"), 2, "qk")
    return [b["state_dict"] for b in blobs], blobs[0]["args"], blobs[0]["ids"], blobs[0]["logits"]


def save_megatron(root, per_rank: dict, args, iteration=7, optimizer=True):
    """Megatron-LM's torch layout: tracker + iter dir + mp_rank_XX[_YYY]/model_optim_rng.pt."""
    tp = max(t for t, _ in per_rank) + 1
    pp = max(p for _, p in per_rank) + 1
    for (t, p), chunks in per_rank.items():
        d = os.path.join(root, f"iter_{iteration:07d}", f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
        os.makedirs(d, exist_ok=True)
        a = argparse.Namespace(**vars(args))
        a.tensor_model_parallel_size, a.pipeline_model_parallel_size = tp, pp
        sd = {"args": a, "iteration": iteration, "checkpoint_version": 3.0,
              "rng_state": [{"random_rng_state": None}]}
        if len(chunks) == 1:
            sd["model"] = chunks[0]
        else:
            sd.update({f"model{v}": c for v, c in enumerate(chunks)})
            a.virtual_pipeline_model_parallel_size = len(chunks)
        if optimizer:
            sd["optimizer"] = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}}}
        torch.save(sd, os.path.join(d, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


def megatron_shards(sd, tp, pp, vp=1, num_layers=4):
    """Cut a full megatron-core state dict the way Megatron-LM shards it over TP x PP x VP."""
    col = ("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")
    row = ("linear_proj.weight", "linear_fc2.weight")
    per_chunk = num_layers // (pp * vp)
    out = {}
    for t in range(tp):
        for p in range(pp):
            chunks = []
            for v in range(vp):
                first = v * (num_layers // vp) + p * per_chunk  # mcore's layer offset
                c = {}
                for name, x in sd.items():
                    if name.startswith("decoder.layers."):
                        i = int(name.split(".")[2])
                        if not first <= i < first + per_chunk:
                            continue
                        name = name.replace(f"decoder.layers.{i}.", f"decoder.layers.{i - first}.", 1)
                    elif name.startswith("embedding.") and not (p == 0 and v == 0):
                        continue
                    elif name.startswith(("decoder.final_layernorm", "output_layer")) and not (
                            p == pp - 1 and v == vp - 1):
                        continue
                    if x is None:
                        c[name] = x
                    elif name.endswith("linear_fc1.weight"):  # SwiGLU: [gate_r; up_r]
                        gate, up = x.chunk(2, dim=0)
                        c[name] = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]]).clone()
                    elif name.endswith(col):
                        c[name] = x.chunk(tp, dim=0)[t].clone()
                    elif name.endswith(row):
                        c[name] = x.chunk(tp, dim=1)[t].clone()
                    else:
                        c[name] = x
                chunks.append(c)
            out[(t, p)] = chunks
    return out


@pytest.mark.slow  # 12-30 s: megatron-core builds its model in this process
@pytest.mark.parametrize("tp,variant", [(1, "plain"), (2, "plain"), (2, "qk")])
def test_imported_weights_reproduce_megatron_core_logits(tmp_path, request, tp, variant):
    """megatron-core's own checkpoint (TP 1, or TP 2 with each rank's own shard) ->
    megaq's full weights -> megaq's one-process model gives megatron-core's logits;
    "qk": with q/k layer norms and Llama 3.1 RoPE scaling, at positions past 20000."""
    from megaq.model import GPTConfig
    from megaq.model.gpt import GPTModel

    if tp == 1:
        sd, args, ids, logits = request.getfixturevalue("mcore_model")
        shards = {(0, 0): [sd]}
    else:
        sds, args, ids, logits = request.getfixturevalue("mcore_tp2" if variant == "plain"
                                                         else "mcore_qk_tp2")
        shards = {(r, 0): [sd] for r, sd in enumerate(sds)}
    src = save_megatron(str(tmp_path / "mlm"), shards, args)
    assert mi.is_megatron_checkpoint(src) == ("Megatron-LM checkpoint (torch format), iteration 7, "
                                              f"TP {tp} x PP 1")
    config, weights = mi.load_megatron_checkpoint(src)
    full = dict(weights)
    assert config["megatron_layout"] == {"tp": tp, "pp": 1, "vp": 1} and config["has_optimizer"]
    c = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, kv_channels=8, vocab_size=128, seq_length=16,
                  max_position_embeddings=16, position_embedding_type="rope", normalization="RMSNorm",
                  layernorm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=128,
                  attention_dropout=0.0, hidden_dropout=0.0,
                  rotary_base=1000000 if variant == "qk" else 10000,
                  qk_layernorm=variant == "qk", use_rope_scaling=variant == "qk")
    assert {k: v for k, v in mi.architecture_from_args(args, src).items()
            if k in ("qk_layernorm", "use_rope_scaling", "rope_scaling_factor", "rotary_base")} \
        == {"qk_layernorm": c.qk_layernorm, "use_rope_scaling": c.use_rope_scaling,
            "rope_scaling_factor": 8.0, "rotary_base": c.rotary_base}
    pos = torch.arange(16).expand(2, 16) + (20000 if variant == "qk" else 0)
    model = GPTModel(c).eval()
    names = dict(model.named_parameters())
    assert set(names) == set(full)
    with torch.no_grad():
        for n, p in names.items():
            p.copy_(full[n])
        ours = model(input_ids=ids, position_ids=pos)
    ours = ours[0] if isinstance(ours, tuple) else ours
    ours = ours.reshape(logits.shape) if ours.shape != logits.shape else ours
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp,pp,vp", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2)])
def test_any_tp_pp_vp_imports_the_same_tensors(tmp_path, mcore_model, tp, pp, vp):
    sd, args, _, _ = mcore_model
    ref = dict(mi.load_megatron_checkpoint(save_megatron(str(tmp_path / "one"), {(0, 0): [sd]}, args))[1])
    src = save_megatron(str(tmp_path / "many"), megatron_shards(sd, tp, pp, vp), args)
    assert f"TP {tp} x PP {pp}" in mi.is_megatron_checkpoint(src)
    config, weights = mi.load_megatron_checkpoint(src)
    got = dict(weights)
    assert config["megatron_layout"] == {"tp": tp, "pp": pp, "vp": vp}
    assert set(got) == set(ref)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


def test_transformer_engine_names_map_to_the_same_weights(tmp_path, mcore_model):
    """TE layer specs fold the norms into linear_qkv / linear_fc1 (layer_norm_weight)."""
    sd, args, _, _ = mcore_model
    te = {}
    for k, v in sd.items():
        k = k.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        te[k.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")] = v
    ref = dict(mi.load_megatron_checkpoint(save_megatron(str(tmp_path / "a"), {(0, 0): [sd]}, args))[1])
    got = dict(mi.load_megatron_checkpoint(save_megatron(str(tmp_path / "b"), {(0, 0): [te]}, args))[1])
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)


def test_convert_writes_a_megaq_checkpoint_that_trains(tmp_path, mcore_model):
    """convert_to_megaq (tools/convert_checkpoint.py --from megatron) -> a megaq checkpoint
    that pretrain_gpt.py loads at TP 2 (resharded) and trains from; the loss at the first
    step is the imported model's, not a fresh one's (ln 128 = 4.85)."""
    from megaq.testing.ranks import run_on_ranks

    sd, args, _, _ = mcore_model
    src = save_megatron(str(tmp_path / "mlm"), megatron_shards(sd, 2, 2), args)
    out = str(tmp_path / "megaq")
    msg = mi.convert_to_megaq(argparse.Namespace(input=src, output=out, overwrite=False))
    assert "optimizer state was not imported" in msg and "--no-load-rng" in msg
    flags = open(os.path.join(out, "megaq_args.txt")).read().split()
    assert mi.is_megatron_checkpoint(out) is None  # megaq's own layout is not mistaken for one
    argv = flags + ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                    "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-4",
                    "--mock-data", "--log-interval", "1", "--eval-iters", "0",
                    "--load", out, "--no-load-rng", "--no-load-optim",
                    "--data-cache-path", str(tmp_path / "cache")]
    losses = run_on_ranks(_train, 2, tp=2, args=(argv,))[0]
    assert len(losses) == 2 and all(v == v for v in losses.values())
    with pytest.raises(mi.MegatronImportError, match="exists; choose a new --output"):
        mi.convert_to_megaq(argparse.Namespace(input=src, output=out, overwrite=False))


def _train(topo, argv):
    from megaq.pretrain import main
    return main(argv, topo=topo).losses


def test_refusals_and_load_message(tmp_path, mcore_model, capsys):
    sd, args, _, _ = mcore_model
    src = save_megatron(str(tmp_path / "mlm"), {(0, 0): [sd]}, args)
    with pytest.raises(mi.MegatronImportError, match="optimizer state .* cannot be mapped"):
        mi.load_megatron_checkpoint(src, optimizer=True)
    moe = argparse.Namespace(**dict(vars(args), num_experts=8))
    with pytest.raises(mi.MegatronImportError, match="mixture of experts"):
        mi.load_megatron_checkpoint(save_megatron(str(tmp_path / "moe"), {(0, 0): [sd]}, moe))
    # (multi-latent attention's down projection: a part megaq lacks)
    extra = dict(sd, **{"decoder.layers.0.self_attention.linear_q_down_proj.weight":
                        torch.ones(8, 32)})
    with pytest.raises(mi.MegatronImportError,
                       match="linear_q_down_proj.weight has no megaq counterpart"):
        dict(mi.load_megatron_checkpoint(save_megatron(str(tmp_path / "qk"), {(0, 0): [extra]},
                                                       args))[1])
    # q/k layer norms in the weights of a model whose args have no --qk-layernorm: refused,
    # not dropped
    qk = {**sd, "decoder.layers.0.self_attention.q_layernorm.weight": torch.ones(8)}
    qk_src = save_megatron(str(tmp_path / "qk_src"), {(0, 0): [qk]}, args)
    with pytest.raises(mi.MegatronImportError, match="q_layernorm.weight has no place in the "
                                                     "model its saved args describe"):
        mi.convert_to_megaq(argparse.Namespace(
            input=qk_src, output=str(tmp_path / "qk_out"), overwrite=False,
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_size=1,
            seq_length=None, make_vocab_size_divisible_by=1, no_optimizer=True))
    dist = tmp_path / "dist"
    (dist / "iter_0000005").mkdir(parents=True)
    (dist / "iter_0000005" / "metadata.json").write_text("{}")
    (dist / "latest_checkpointed_iteration.txt").write_text("5")
    assert "torch_dist" in mi.is_megatron_checkpoint(str(dist))
    # a torch_dist directory of another backend (tests/test_megatron_dist.py imports real ones)
    with pytest.raises(mi.MegatronImportError, match="sharded backend None, not torch_dist"):
        mi.load_megatron_checkpoint(str(dist))
    assert mi.is_megatron_checkpoint(str(tmp_path)) is None
    # pretrain_gpt.py --load on a Megatron-LM directory: one line naming the converter.
    r = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--num-layers", "4",
                        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                        "--lr", "1e-4", "--mock-data", "--load", src,
                        "--data-cache-path", str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {src} is a Megatron-LM checkpoint (torch format), iteration 7")
    assert "tools/convert_checkpoint.py --from megatron --to megaq" in line
    assert "Traceback" not in r.stderr


def test_cli_refusals_are_one_line_and_keep_the_input(tmp_path, capsys):
    """tools/convert_checkpoint.py --from megatron: a MegatronImportError is an InteropError,
    so the tool prints one `error:` line and exits 2 (it printed a traceback, exit 1);
    an --output around the input is refused before anything is read or written."""
    from data_fixtures import tool
    convert = tool("convert_checkpoint")

    def run(*argv):
        capsys.readouterr()
        rc = convert.main([str(a) for a in argv])
        return rc, capsys.readouterr().err

    # no checkpoint there
    rc, err = run("--from", "megatron", "--to", "megaq", "--input", tmp_path / "none",
                  "--output", tmp_path / "out")
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {tmp_path / 'none'} is not a Megatron-LM checkpoint directory")
    # a megaq checkpoint (its model_optim.pt, not Megatron's model_optim_rng.pt)
    megaq_ck = tmp_path / "megaq_ck"
    (megaq_ck / "iter_0000003" / "mp_rank_00_000").mkdir(parents=True)
    (megaq_ck / "iter_0000003" / "mp_rank_00_000" / "model_optim.pt").write_bytes(b"")
    (megaq_ck / "latest_checkpointed_iteration.txt").write_text("3")
    rc, err = run("--from", "megatron", "--to", "megaq", "--input", megaq_ck,
                  "--output", tmp_path / "out")
    assert rc == 2 and err.count("\n") == 1 and "it is a megaq checkpoint" in err, err
    # a tracker that is not text: a line, not a UnicodeDecodeError
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe")
    rc, err = run("--from", "megatron", "--to", "megaq", "--input", garbled, "--output", tmp_path / "out")
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    # --output an ancestor of --input, with --overwrite: refused, the input is all there
    args = argparse.Namespace(num_layers=1, hidden_size=8, num_attention_heads=2)
    src = save_megatron(str(tmp_path / "run" / "mlm"), {(0, 0): [{}]}, args)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs)
    rc, err = run("--from", "megatron", "--to", "megaq", "--input", src,
                  "--output", tmp_path / "run", "--overwrite")
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --output {tmp_path / 'run'} overlaps --input {src}")
    assert sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs) == files
    assert not os.path.exists(tmp_path / "out")
