"""Shared by the ZeRO engine tests: train GPTModel for a few steps under any
TP x PP x DP layout with the engine, and the same global batches in one process with
torch.optim.AdamW (or SGD, zero_kw {"optimizer": "sgd"}) + clip_grad_norm_ (the reference)."""

from __future__ import annotations

import torch
import torch._dynamo  # noqa: F401 - torch.optim imports it lazily (~3 s of CPU); do it
#                       once here, before run_on_ranks forks, not once per rank

from megaq.model.config import GPTConfig
from megaq.model.gpt import GPTModel
from megaq.parallel import comm
from megaq.parallel.comm import INTER, INTRA
from megaq.parallel.pipeline import get_forward_backward_func, masked_mean_loss, pipeline_tensor_shape
from megaq.parallel.tensor_parallel import shard_of
from megaq.parallelize import parallelize
from megaq.zero import OptimizerSettings, ZeroConfig, wants_weight_decay
from megaq.zero.zeropp import volume

SEQ, MBS = 8, 2
# eps 1e-6, not 1e-8: for a gradient element near zero Adam's update g/(|g|+eps)
# turns the ~1e-11 absolute rounding difference between two summation orders (TP
# splits a matmul's reduction) into an update difference of lr * 1e-11/eps.
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-6, 0.1
CLIP = 0.05  # below the grad norms of the first steps (asserted), so clipping triggers
STEPS = 5


def model_config(**kw) -> GPTConfig:
    # Odd vocab (101; padded to 102 at TP 1 and 2 with make_vocab_size_divisible_by=3),
    # sizes that leave every flat buffer unaligned, no dropout (exact comparison).
    # No linear biases: the attention key bias has an exactly-zero gradient in exact
    # arithmetic, and Adam turns its rounding noise into O(lr) updates that differ
    # between any two summation orders (LayerNorm biases still exercise no-decay).
    base = dict(num_layers=2, hidden_size=20, num_attention_heads=2, vocab_size=101,
                seq_length=SEQ, make_vocab_size_divisible_by=3, attention_dropout=0.0,
                hidden_dropout=0.0, seed=7, add_bias_linear=False)
    base.update(kw)
    return GPTConfig(**base)


def global_batch(step: int, rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (rows, SEQ + 1), generator=g)


def learnable_batch(seed: int, rows: int, vocab: int) -> torch.Tensor:
    """Arithmetic sequences mod vocab with a few strides: the loss falls fast, so a wrong
    weight or gradient shard shows in the curve of a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % vocab


def split_microbatches(data: torch.Tensor, dp_rank: int, n_micro: int) -> list[dict]:
    """This DP rank's n_micro micro-batches of MBS rows from a global batch [rows, SEQ + 1]."""
    out = []
    for m in range(n_micro):
        rows = data[(dp_rank * n_micro + m) * MBS:(dp_rank * n_micro + m + 1) * MBS]
        out.append({"tokens": rows[:, :-1], "labels": rows[:, 1:],
                    "loss_mask": torch.ones(MBS, SEQ)})
    return out


def microbatches(step, dp_rank, dp, n_micro, vocab):
    return split_microbatches(global_batch(step, dp * n_micro * MBS, vocab), dp_rank, n_micro)


def world_totals(per_node: dict) -> dict[str, dict[str, int]]:
    """comm.per_node_totals summed over the nodes: {phase: {intra_node, inter_node}}."""
    out: dict[str, dict[str, int]] = {}
    for phases in per_node.values():
        for phase, links in phases.items():
            d = out.setdefault(phase, {INTRA: 0, INTER: 0})
            for link, v in links.items():
                d[link] += v
    return out


def modelled_step_bytes(shards, k: int, m: int, cfg: ZeroConfig, groups: int) -> dict[str, dict[str, int]]:
    """The byte model (volume.step, bf16 weights and gradients) of one step over `groups`
    DP groups that each hold units of the given shard sizes."""
    total: dict[str, dict[str, int]] = {}
    for S in shards:
        for phase, links in volume.step(S, k, m, 2, 2, cfg).items():
            d = total.setdefault(phase, {INTRA: 0, INTER: 0})
            for link in (INTRA, INTER):
                d[link] += groups * links[link]
    return total


def reference(model_kw: dict, dp: int, n_micro: int, steps: int = STEPS, clip: float = CLIP,
              zero_kw: dict | None = None):
    """One process, whole global batch per step: losses, grad norms, final params.
    zero_kw: the engine's optimizer settings (optimizer, sgd_momentum, lr) to mirror."""
    zero_kw = zero_kw or {}
    cfg = model_config(**model_kw)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if wants_weight_decay(n, p)], "weight_decay": WD},
              {"params": [p for n, p in named if not wants_weight_decay(n, p)], "weight_decay": 0.0}]
    lr = zero_kw.get("lr", LR)
    if zero_kw.get("optimizer", "adam") == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=zero_kw.get("sgd_momentum", 0.9))
    else:
        opt = torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS)
    losses, norms = [], []
    for step in range(steps):
        data = global_batch(step, dp * n_micro * MBS, cfg.vocab_size)
        opt.zero_grad()
        loss = masked_mean_loss(model(input_ids=data[:, :-1], labels=data[:, 1:]),
                                torch.ones(data.shape[0], SEQ))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {n: p.detach().clone() for n, p in named}


def _reference_name(chunk, name: str) -> str:
    if name.startswith("layers."):
        i, rest = name[len("layers."):].split(".", 1)
        return f"layers.{chunk.layer_start + int(i)}.{rest}"
    if name == "output_layer.weight" and getattr(chunk.output_layer.weight, "shared_embedding", False):
        return "embedding.word_embeddings.weight"  # the tied copy on the last stage
    return name


def engine_configs(zero_kw: dict) -> tuple[ZeroConfig, OptimizerSettings]:
    """zero_kw: ZeroConfig's settings and the optimizer's (OptimizerSettings' names: lr,
    optimizer, sgd_momentum, ...) in one dict, split into the two the engine takes;
    the optimizer's default to the reference's AdamW (LR, BETAS, EPS, WD)."""
    names = set(OptimizerSettings.__dataclass_fields__)
    opt = {"lr": LR, "adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "adam_eps": EPS,
           "weight_decay": WD, **{k: v for k, v in zero_kw.items() if k in names}}
    return (ZeroConfig(**{k: v for k, v in zero_kw.items() if k not in names}),
            OptimizerSettings(**opt))


def train_rank(topo, model_kw: dict, zero_kw: dict, n_micro: int, steps: int = STEPS,
               account: bool = False, clip: float = CLIP, start_step: int = 0, load=None,
               vp: int = 1):
    """Runs on every rank; returns what the test compares against the reference."""
    cfg = model_config(**model_kw)
    torch.manual_seed(0)
    zcfg, opt = engine_configs(zero_kw)
    chunks, engine = parallelize(cfg, topo, zcfg, optimizer=opt, vp_size=vp)
    invalidations = []
    if engine.gatherer is not None:  # count the seam's invalidation calls
        inner = engine.gatherer.invalidate
        engine.gatherer.invalidate = lambda *a: (invalidations.append(1), inner(*a))[1]
    if load is not None:
        engine.load_full_state(load)
    peak = [0]

    def track(*_):  # runs after the engine's pre-hook: current site gathered + prefetches
        peak[0] = max(peak[0], engine.live_gathered_bytes())
    for site in engine.sites:
        site.modules[0].register_forward_pre_hook(track)
    fb = get_forward_backward_func(topo.layout.pp, vp)
    shape = pipeline_tensor_shape(SEQ, MBS, cfg.hidden_size, topo.tp.size, cfg.sequence_parallel)
    losses, norms, mem, traffic = [], [], [], None
    for step in range(start_step, steps):
        if account and step == 0:
            comm.STATS.reset()
        engine.zero_grad()
        mbs = microbatches(step, topo.dp_rank, topo.dp.size, n_micro, cfg.vocab_size)
        step_losses = fb(chunks, mbs, n_micro, topo, tensor_shape=shape)
        engine.finish_grad_sync()
        norm = engine.clip_grad_norm(clip)
        assert bool(engine.grads_finite())
        engine.step(opt.lr)
        if account and step == 0:
            traffic = comm.per_node_totals(topo.world)
        losses.append([float(x) for x in step_losses])
        norms.append(float(norm))
        mem.append(engine.memory_report())
    full = engine.full_state()
    params_norm = float(engine.params_norm())  # --log-params-norm's number (collective)
    meta = {}
    for c, chunk in enumerate(chunks):
        prefix = f"chunk{c}." if len(chunks) > 1 else ""  # engine.full_state's naming
        for name, p in chunk.named_parameters():
            meta[prefix + name] = (_reference_name(chunk, name),
                                   bool(getattr(p, "tensor_model_parallel", False)),
                                   getattr(p, "partition_dim", -1), getattr(p, "partition_stride", 1))
    return {"losses": losses, "norms": norms, "mem": mem, "state": full, "meta": meta,
            "tp_rank": topo.tp_rank, "tp": topo.tp.size, "traffic": traffic,
            "M": engine.zero_model_bytes, "numel": sum(p.numel() for c in chunks for p in c.parameters()),
            "last_stage": topo.is_last_stage, "peak_gathered": peak[0],
            "gather_bound": gather_bound(engine), "invalidations": len(invalidations),
            "step_count": engine.step_count, "params_norm": params_norm,
            "shards": [p.shard_numel for p in engine.partitions if p.sharded]}


def gather_bound(engine) -> int:
    """Live gathered bytes allowed: (1 + prefetch) consecutive sites, plus units used by
    several sites (a tied embedding), which stay gathered between their uses."""
    sizes = [sum(u.sharded.full_bytes for u in s.gathered_units) for s in engine.sites]
    k = 1 + engine.cfg.prefetch
    users: dict[int, list] = {}
    for s in engine.sites:
        for u in s.gathered_units:
            users.setdefault(id(u), [u, 0])[1] += 1
    kept = sum(u.sharded.full_bytes for u, n in users.values() if n > 1)
    return max((sum(sizes[i:i + k]) for i in range(len(sizes))), default=0) + kept


def train_many(topo, scenarios):
    return [train_rank(topo, *sc) for sc in scenarios]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def check_against_reference(results, ref, tol: float = 1e-5) -> float:
    """Losses, grad norms and every final parameter slice match; returns the worst error."""
    ref_losses, ref_norms, ref_params = ref
    worst = 0.0
    # Loss of a step: mean over the last stage's micro-batches on every DP rank.
    per_step = [sum(r["losses"][s][i] for r in results if r["last_stage"] for i in range(len(r["losses"][s])))
                / sum(len(r["losses"][s]) for r in results if r["last_stage"])
                for s in range(len(ref_losses))]
    for got, want in zip(per_step, ref_losses):
        worst = max(worst, abs(got - want) / abs(want))
    for r in results:
        for got, want in zip(r["norms"], ref_norms):
            worst = max(worst, abs(got - want) / abs(want))
        for name, st in r["state"]["params"].items():
            ref_name, tp_split, dim, stride = r["meta"][name]
            want = ref_params[ref_name]
            if tp_split and r["tp"] > 1:
                want = shard_of(want, dim, r["tp_rank"], r["tp"], stride)
            assert st["param"].shape == want.shape, (name, st["param"].shape, want.shape)
            e = rel_err(st["param"], want)
            assert e < tol, f"{name}: relative error {e:.2e}"
            worst = max(worst, e)
    # the engine's params norm (no gather; every shard counted once) is the whole model's
    ref_norm = float(torch.sqrt(sum((p.double() ** 2).sum() for p in ref_params.values())))
    for r in results:
        e = abs(r["params_norm"] - ref_norm) / ref_norm
        assert e < tol, f"params norm {r['params_norm']} vs {ref_norm}"
        worst = max(worst, e)
    assert worst < tol, worst
    return worst
