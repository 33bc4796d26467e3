"""The plan as text: one prediction as a table, a search as a ranked list."""

from __future__ import annotations

from .hardware import Cluster
from .step import PlanInput, Prediction


def _ms(s: float) -> str:
    return f"{s * 1e3:9.1f} ms"


def _bytes(b: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def render_prediction(pred: Prediction, pi: PlanInput, cluster: Cluster) -> str:
    z, lay = pi.zero, pred.layout
    zpp = [n for on, n in ((z.hpz, f"hpZ {z.hpz_partition_size}"),
                           (z.quantized_weights, f"qwZ int{z.weight_bits}"),
                           (z.fp8_weights, "FP8 weight gathers"),
                           (z.weight_deltas, f"weight deltas int{z.weight_delta_bits}"),
                           (z.quantized_gradients, f"qgZ int{z.grad_bits_inter}")) if on]
    lines = [
        f"plan: {lay['parameters'] / 1e9:.2f}B parameters on {cluster.describe()}",
        f"  layout   TP {pi.tp} x PP {pi.pp}" + (f" (x{pi.vp} virtual)" if pi.vp > 1 else "")
        + f" x DP {pi.dp}; DP group on {lay['dp_group_nodes']} node(s) x "
        f"{lay['dp_ranks_per_node']}; micro-batch {pi.micro_batch_size} x "
        f"{lay['num_micro_batches']} per step, global batch {pi.global_batch_size} x "
        f"{pi.seq_length} tokens",
        f"  ZeRO     stage {z.stage}" + (" + " + ", ".join(zpp) if zpp else "")
        + f"; {'FP8 ' + pi.model.fp8_format if pi.fp8 else ('bf16' if pi.bf16 else 'fp32')}"
        + f"; recompute {pi.model.recompute_granularity or 'none'}",
        "",
        f"  step time           {_ms(pred.step_time_s)}",
        f"    compute           {_ms(pred.compute_s)}",
    ]
    for phase, s in pred.exposed_comm_s.items():
        if s > 0:
            lines.append(f"    exposed {phase:<18}{_ms(s).strip():>11}")
    lines += [
        f"    pipeline bubble   {_ms(pred.bubble_s)}",
        f"    optimizer         {_ms(pred.optimizer_s)}",
        f"  tokens/s            {pred.tokens_per_s:12,.0f}",
        f"  TFLOP/s per GPU     {pred.tflops_per_gpu:12.1f}   (MFU {pred.mfu:.1%} of "
        f"{cluster.gpu.peak_bf16_tflops:g} bf16)",
        f"  cross-node bytes    {_bytes(pred.cross_node_bytes):>12} per iteration",
        "",
        f"  memory per GPU      {pred.memory_gib:9.2f} GiB of {pred.hbm_gib:.1f} "
        f"({'fits' if pred.fits else 'DOES NOT FIT'})",
    ]
    for part, gib in sorted(pred.memory_parts_gib.items(), key=lambda kv: -kv[1]):
        if gib >= 0.005:
            lines.append(f"    {part:<22}{gib:9.2f} GiB")
    lines += [f"  note: {n}" for n in pred.notes]
    return "\n".join(lines)


def render_search(plans, reason: str, cluster: Cluster, limit: int = 10) -> str:
    lines = [f"search on {cluster.describe()}: {len(plans)} plan(s) fit", ""]
    lines.append(f"  {'#':>2}  {'tokens/s':>12}  {'step':>9}  {'MFU':>6}  {'GiB':>6}  plan")
    for i, p in enumerate(plans[:limit], 1):
        pr = p.prediction
        lines.append(f"  {i:>2}  {pr.tokens_per_s:12,.0f}  {pr.step_time_s * 1e3:7.0f}ms  "
                     f"{pr.mfu:6.1%}  {pr.memory_gib:6.1f}  {p.name}")
    if plans:
        lines += ["", f"  {reason}", "", "  flags of #1:", "    " + " ".join(plans[0].flags)]
    return "\n".join(lines)
