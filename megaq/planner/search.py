"""Layouts and switches for a model, a global batch and a cluster, ranked by predicted
throughput among those that fit.

The search walks TP (dividing the GPUs of a node and the heads), PP (dividing the
layers), virtual stages, micro-batch size, ZeRO stage and the ZeRO++ switches (hpZ over
the DP ranks of a node, qwZ, qgZ, weight deltas, FP8 weight gathers with FP8 GEMMs);
for each it takes the least recomputation that fits (recomputing costs time and
nothing else). A plan the memory model says does not fit is never proposed. Each plan
renders as pretrain_gpt.py flags (:func:`plan_flags`) that megaq's own parser accepts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megaq.config.flags import flag_fields
from megaq.model.config import GPTConfig
from megaq.parallel.topology import LayoutError
from megaq.zero.config import ZeroConfig, ZeroConfigError, check_fp8_weight_gathers

from .calibration import Calibration
from .hardware import Cluster
from .step import (PlanError, PlanInput, Prediction, dp_group_shape, fits_on, memory_peak,
                   predict)

RECOMPUTE = (  # least first
    ("none", dict(GPTConfig.NO_RECOMPUTE)),
    ("selective", dict(GPTConfig.NO_RECOMPUTE, recompute_granularity="selective")),
    ("full", dict(GPTConfig.NO_RECOMPUTE, recompute_granularity="full",
                  recompute_method="uniform", recompute_num_layers=1)),
)


@dataclass
class Plan:
    input: PlanInput
    prediction: Prediction
    recompute: str
    flags: list[str]

    @property
    def name(self) -> str:
        pi, z = self.input, self.input.zero
        zpp = [n for on, n in ((z.hpz, f"hpZ{z.hpz_partition_size}"), (z.quantized_weights, "qwZ"),
                               (z.fp8_weights, "fp8-gather"), (z.weight_deltas, "deltas"),
                               (z.quantized_gradients, "qgZ")) if on]
        return (f"TP{pi.tp} PP{pi.pp}" + (f"x{pi.vp}" if pi.vp > 1 else "") + f" DP{pi.dp} "
                f"mb{pi.micro_batch_size} ZeRO-{z.stage}" + ("+" + "+".join(zpp) if zpp else "")
                + ("" if self.recompute == "none" else f" recompute-{self.recompute}"))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def zero_variants(base: ZeroConfig, dp_per_node: int, model: GPTConfig) -> list[ZeroConfig]:
    """ZeRO-3 with each useful combination of the ZeRO++ switches, stage 0, and stages 1
    and 2 plain and with int8 qwZ + qgZ (FP8 GEMMs: FP8 weight gathers instead of qwZ,
    where the recipe allows them; stages 1 and 2 then without qwZ)."""
    out = [dataclasses.replace(base, stage=0)]
    hpz = dp_per_node if dp_per_node > 1 else 1
    qw = dict(fp8_weights=True) if model.fp8 else dict(quantized_weights=True)
    plain = dict(stage=3, hpz_partition_size=1, quantized_weights=False, fp8_weights=False,
                 quantized_gradients=False, weight_deltas=False)
    combos = [{}, qw, dict(quantized_gradients=True), dict(qw, quantized_gradients=True)]
    if hpz > 1:
        combos += [dict(hpz_partition_size=hpz), dict(qw, hpz_partition_size=hpz),
                   dict(qw, hpz_partition_size=hpz, quantized_gradients=True),
                   dict(hpz_partition_size=hpz, quantized_gradients=True),
                   dict(hpz_partition_size=hpz, weight_deltas=True, quantized_gradients=True),
                   dict(hpz_partition_size=hpz, weight_deltas=True)]
    combos += [dict(stage=1), dict(stage=2),
               dict(stage=2, quantized_gradients=True,
                    quantized_weights=not model.fp8)]
    for c in combos:
        try:
            z = dataclasses.replace(base, **dict(plain, **c))
            check_fp8_weight_gathers(model.fp8, z)
        except ZeroConfigError:
            continue
        out.append(z)
    return out


def search(model: GPTConfig, global_batch: int, seq_len: int, cluster: Cluster,
           calibration: Calibration, *, bf16: bool = True, zero: ZeroConfig | None = None,
           micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16), max_pp: int = 8,
           top: int | None = None) -> list[Plan]:
    """Plans that fit, fastest first. `model` gives the architecture (its vocab_size set,
    fp8_format / compile_blocks kept as given); recompute settings are the search's."""
    model = dataclasses.replace(model, seq_length=seq_len, **GPTConfig.NO_RECOMPUTE)
    base = zero or ZeroConfig(gather_dtype=model.params_dtype)
    world, gpn = cluster.world_size, cluster.gpus_per_node
    heads, groups = model.num_attention_heads, model.num_query_groups
    plans: list[Plan] = []
    for tp in _divisors(gpn):
        if heads % tp or groups % tp or (model.seq_length % tp):
            continue
        for pp in _divisors(model.num_layers):
            if pp > max_pp or world % (tp * pp):
                continue
            dp = world // (tp * pp)
            vps = [1] + [v for v in (2,) if pp > 1 and (model.num_layers // pp) % v == 0]
            try:
                g = dp_group_shape(world, tp, pp, gpn, 1, "tp-dp-pp")
            except LayoutError:
                continue
            for vp in vps:
                for mb in sorted(micro_batches):  # memory grows with mb: stop at the first
                    if global_batch % (mb * dp):  # that fits in no variant
                        continue
                    m = global_batch // (mb * dp)
                    if vp > 1 and m % pp:
                        continue
                    found = [p for z in zero_variants(base, g.m, model)
                             if (p := _best_recompute(model, z, tp, pp, vp, dp, mb, global_batch,
                                                      bf16, gpn, cluster, calibration))]
                    if not found:
                        break
                    plans += found
    plans.sort(key=lambda p: -p.prediction.tokens_per_s)
    return plans[:top] if top else plans


def _best_recompute(model, z, tp, pp, vp, dp, mb, gbs, bf16, gpn, cluster, cal) -> Plan | None:
    for name, settings in RECOMPUTE:
        cfg = dataclasses.replace(model, sequence_parallel=tp > 1, **settings)
        pi = PlanInput(model=cfg, zero=z, tp=tp, pp=pp, vp=vp, dp=dp,
                       micro_batch_size=mb, global_batch_size=gbs, bf16=bf16, gpus_per_node=gpn)
        try:
            _, peak = memory_peak(pi, cal)
            if not fits_on(peak, cluster.gpu, cal):
                continue
            return Plan(pi, predict(pi, cluster, cal), name, plan_flags(pi))
        except (PlanError, LayoutError):
            return None
    return None


def why_best(plans: list[Plan]) -> str:
    """One line: why the first plan wins."""
    if not plans:
        return "no plan fits"
    best = plans[0]
    bp = best.prediction
    line = f"{best.name} wins: {bp.tokens_per_s:,.0f} tokens/s"
    plain = next((p for p in plans if p.input.zero.stage == 3 and not p.input.zero.zeropp_enabled),
                 None)
    if plain is not None and plain is not best:
        r = bp.tokens_per_s / plain.prediction.tokens_per_s
        cross = plain.prediction.cross_node_bytes / max(bp.cross_node_bytes, 1)
        line += f", {r:.2f}x the best plain ZeRO-3 plan ({plain.name})"
        if bp.cross_node_bytes < plain.prediction.cross_node_bytes:
            line += f" with {cross:.1f}x fewer cross-node bytes"
    if len(plans) > 1:
        runner = plans[1]
        line += (f"; next: {runner.name} at "
                 f"{runner.prediction.tokens_per_s / bp.tokens_per_s:.1%} of it")
    exposed = bp.exposed_comm_s
    biggest = max(exposed, key=exposed.get)
    comm = sum(exposed.values())
    line += (f"; its step: compute {bp.compute_s / bp.step_time_s:.0%}, exposed "
             f"communication {comm / bp.step_time_s:.0%}")
    if comm > 0:
        line += f" (most {biggest})"
    line += f", bubble {bp.bubble_s / bp.step_time_s:.0%}"
    return line


# ------------------------------------------------------------------------- flags
def _render(obj, skip=()) -> list[str]:
    out = []
    for f in flag_fields(type(obj)):
        if f.name in skip:
            continue
        value, name = getattr(obj, f.name), f.metadata["flag"]
        if f.metadata["argparse"].get("action") == "store_true" and f.metadata["value"] is None:
            if value:
                out.append(name)
        elif f.metadata["value"] is None and value is not None and (
                value != f.default or f.metadata["argparse"].get("required")):
            out += [name, str(value)]
    return out


def model_flags(cfg: GPTConfig) -> list[str]:
    """pretrain_gpt.py's model flags for `cfg` (the recompute settings included)."""
    out = _render(cfg, skip=("recompute_activations",))
    if cfg.group_query_attention:
        out += ["--num-query-groups", str(cfg.num_query_groups)]
    if not cfg.add_bias_linear:
        out.append("--disable-bias-linear")
    return out


def zero_flags(z: ZeroConfig) -> list[str]:
    out = _render(z)
    if z.stage != 3:  # the flag's parser default is None (a given stage is told from none)
        out[:0] = ["--zero-stage", str(z.stage)]
    if z.quantized_weights:
        out.append("--zero-quantized-weights")
    if z.fp8_weights:
        out += ["--zero-quantized-weights", "fp8"]
    if z.quantized_gradients and z.grad_bits_intra != z.grad_bits_inter:
        out += ["--zero-quantized-gradients-intra-bits", str(z.grad_bits_intra)]
    return out


def plan_flags(pi: PlanInput) -> list[str]:
    """The plan as pretrain_gpt.py flags (add the data, --lr and the run's length)."""
    out = model_flags(pi.model)
    out += ["--tensor-model-parallel-size", str(pi.tp),
            "--pipeline-model-parallel-size", str(pi.pp)]
    if pi.vp > 1:
        out += ["--num-layers-per-virtual-pipeline-stage",
                str(pi.model.num_layers // (pi.pp * pi.vp))]
    if pi.sequence_parallel:
        out.append("--sequence-parallel")
    out += ["--gpus-per-node", str(pi.gpus_per_node),
            "--micro-batch-size", str(pi.micro_batch_size),
            "--global-batch-size", str(pi.global_batch_size)]
    if pi.bf16:
        out.append("--bf16")
    return out + zero_flags(pi.zero)
