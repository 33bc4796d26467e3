"""The step-time and memory model of one megaq training step: PlanInput -> Prediction.

:func:`predict` walks a step the way megaq runs it (docs/ZERO.md, docs/ZEROPP.md,
docs/PIPELINE.md): per pipeline stage, each micro-batch's forward and backward through
each model chunk (compute.py), the ZeRO gathers and reductions of each unit
(traffic.py) of which only what megaq overlaps is hidden -- a unit's gather behind the
previous unit's compute (prefetch), a unit's reduction behind the next units' backward
(async reduce) -- and TP's collectives, which run in line; the schedule's idle slots
(bubble.py); the last reduction (every reduction when gradients are reduced once per
step: stage 1, --zero-grad-sync last_microbatch), the optimizer step and the weight
deltas after it.
Memory: memory.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field

from megaq.data.config import MOCK_VOCAB_SIZE
from megaq.model.config import GPTConfig
from megaq.parallel.comm import INTER, INTRA
from megaq.parallel.topology import Layout, check_hpz_size, validate_layout
from megaq.zero.config import ZeroConfig, fp8_weights_kept_in_e4m3
from megaq.zero.fp8_resident import AMAX_READ_BYTES_PER_PARAM, REFRESH_BYTES_PER_PARAM

from . import bubble as bubble_mod
from . import compute, memory, traffic
from .calibration import Calibration
from .hardware import Cluster, HardwareError
from .shapes import FP8_WEIGHTS_PER_LAYER, stage_units, total_params

DEFAULT_VOCAB = 32000  # when neither the model nor --vocab-size says (a Llama tokenizer's)
# Host seconds to launch one layer's forward and backward (compiled blocks), as measured on
# the device machine's CPU: the 500-step FP8 check's 91M model (12 x 768, micro-batches of
# 8 x 1,024 tokens, an H100; docs/PLANNING.md, "What the model includes, and what it leaves
# out") stepped in 35.8 ms (bf16) and 64.5 ms (FP8 delayed) for 24 layer passes, where the
# GPU work was predicted at 28.8 and 30.0. A layer with less GPU work than this waits on the
# host, which the model does not count.
HOST_LAYER_S = {"bf16": 1.5e-3, "fp8": 2.7e-3}


class PlanError(ValueError):
    """A plan that cannot be made (layout, model, hardware); one line with the fix."""


def fp32_grad_extra_bytes(grad_elem: int) -> int:
    """HBM bytes per parameter the optimizer phase moves beyond 16-bit gradients' with
    fp32 ones: the grad norm and the update each read every gradient once. The
    calibration's optimizer_bytes_per_param is for fp32 gradients."""
    return 2 * (4 - grad_elem)


@dataclass(frozen=True)
class PlanInput:
    """Everything of a run the step model reads."""
    model: GPTConfig                 # vocab_size set
    zero: ZeroConfig
    tp: int = 1
    pp: int = 1
    vp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    global_batch_size: int = 1
    bf16: bool = True
    gpus_per_node: int = 8           # ranks per node of the layout (the node map)
    rank_order: str = "tp-dp-pp"
    optimizer: str = "adam"          # --optimizer: AdamW keeps two moments, SGD one
    # bytes per gradient element as a measured run's engine held them (None: what the
    # engine holds now, grad_elem's rule); replayed results from before 16-bit gradients: 4
    grad_bytes: int | None = None
    # whether fc1's FP8 backward took SwiGLU's gradient from the fused kernel as a measured
    # run did (None: what megaq does now, swiglu_fp8_backward_fused's rule); replayed
    # results from before that kernel: False
    fused_swiglu_fp8: bool | None = None
    # likewise RoPE's backward into the QKV layer's FP8 dY (None: rope_fp8_backward_fused's
    # rule); replayed results from before that kernel: False
    fused_rope_fp8: bool | None = None
    # whether stage 0's E4M3 weights took their amaxes from the optimizer's pass as a
    # measured run did (None: what megaq does now, refresh_reads_masters's rule);
    # replayed results from before the one-pass step took them: False
    amax_from_step: bool | None = None
    # the vocabulary is DEFAULT_VOCAB because nothing said otherwise (a tokenizer's is
    # only known once it is loaded): the plan says so
    vocab_assumed: bool = field(default=False, compare=False)

    @classmethod
    def from_config(cls, run, vocab_size: int | None = None) -> "PlanInput":
        """From megaq.config.run.RunConfig (megaq.config.arguments.parse_config's result)."""
        vocab = (run.model.vocab_size or vocab_size or run.data.vocab_size
                 or (MOCK_VOCAB_SIZE if run.data.mock_data else None))
        p = run.parallel
        return cls(model=dataclasses.replace(run.model, vocab_size=vocab or DEFAULT_VOCAB),
                   zero=run.zero, vocab_assumed=vocab is None,
                   tp=p.tp, pp=p.pp, vp=run.virtual_pipeline_size, dp=p.dp,
                   micro_batch_size=run.training.micro_batch_size,
                   global_batch_size=run.training.global_batch_size, bf16=run.training.bf16,
                   gpus_per_node=p.layout.ranks_per_node, rank_order=p.rank_order,
                   optimizer=run.optimizer.optimizer)

    @property
    def sequence_parallel(self) -> bool:
        return self.model.sequence_parallel  # its one home: GPTConfig

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def seq_length(self) -> int:
        return self.model.seq_length

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def fp8(self) -> bool:
        return self.model.fp8_format is not None

    @property
    def e4m3_weights(self) -> bool:
        """The FP8 GEMMs' weights held in E4M3 (1 byte): ZeRO-3's FP8 weight gathers, or
        stage 0's E4M3-only weights (megaq.zero.fp8_resident)."""
        scaling = self.model.fp8_recipe if self.fp8 else None
        return self.zero.fp8_weights or fp8_weights_kept_in_e4m3(self.zero.stage, self.elem, scaling)

    @property
    def grad_elem(self) -> int:
        """Bytes the engine holds per gradient element at backward's end: 16-bit where
        the step has nothing to reduce (DP = 1), writes each gradient once (one
        micro-batch) and its update reads them so (AdamW: megaq's one-pass kernel on a
        GPU), else the fp32 accumulator (megaq.zero.grads, keep_16bit)."""
        if self.grad_bytes is not None:
            return self.grad_bytes
        once = self.dp == 1 and not self.zero.grads_reduced_once and self.num_micro_batches == 1
        return self.elem if once and self.optimizer == "adam" else 4

    @property
    def swiglu_fp8_backward_fused(self) -> bool:
        """fc1's FP8 backward takes SwiGLU's gradient from one kernel that writes the FP8
        dY and its transpose (megaq.parallelize.apply_fp8: a SwiGLU MLP without biases,
        the delayed recipe, whose scale is known before dY; kernels/fused_swiglu.py)."""
        if self.fused_swiglu_fp8 is not None:
            return self.fused_swiglu_fp8
        m = self.model
        return self.fp8 and m.fp8_recipe == "delayed" and m.swiglu and not m.add_bias_linear

    @property
    def rope_fp8_backward_fused(self) -> bool:
        """The QKV layer's FP8 backward takes RoPE's gradient from one kernel that writes
        the FP8 dY and its transpose (megaq.parallelize.apply_fp8: RoPE, no bias or q/k
        norms, the delayed recipe; kernels/fused_rope.py)."""
        if self.fused_rope_fp8 is not None:
            return self.fused_rope_fp8
        m = self.model
        return (self.fp8 and m.fp8_recipe == "delayed" and m.position_embedding_type == "rope"
                and not m.add_bias_linear and not m.qk_layernorm)

    @property
    def refresh_reads_masters(self) -> bool:
        """Does stage 0's refresh of the E4M3 weights read the fp32 masters once more for
        their amaxes (megaq.zero.fp8_resident)? Not after megaq's one-pass AdamW step,
        which takes them in its own pass (the GPU's AdamW); SGD's step does not."""
        if self.amax_from_step is not None:
            return not self.amax_from_step
        return self.optimizer != "adam"

    @property
    def compiled(self) -> bool:
        return self.model.compile_blocks

    @property
    def elem(self) -> int:
        """Bytes of a weight as gathered (and of an activation)."""
        return 2 if self.bf16 else 4


@functools.lru_cache(maxsize=256)
def dp_group_shape(world: int, tp: int, pp: int, ranks_per_node: int, hpz: int,
                   order: str) -> traffic.DPGroupShape:
    """How a DP group lies on the nodes (megaq.parallel.topology's rank grid)."""
    layout = Layout(world_size=world, tp=tp, pp=pp, ranks_per_node=ranks_per_node, order=order)
    validate_layout(layout)
    check_hpz_size(layout, hpz)
    group = layout.dp_groups()[0]
    per_node = layout.intra_groups(group)
    k, m = len(per_node), len(per_node[0])
    # every rank of a node is in one DP group, which has m members there
    return traffic.DPGroupShape(k, m, max(ranks_per_node // m, 1))


@dataclass
class Prediction:
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    memory_gib: float
    fits: bool
    compute_s: float
    exposed_comm_s: dict
    bubble_s: float
    optimizer_s: float
    other_s: float
    memory_parts_gib: dict
    cross_node_bytes: int
    bytes_per_phase: dict
    hbm_gib: float
    layout: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
            "memory_gib": self.memory_gib, "fits": self.fits,
            "breakdown_s": {"compute": self.compute_s, "exposed_comm": self.exposed_comm_s,
                            "bubble": self.bubble_s, "optimizer": self.optimizer_s,
                            "other": self.other_s},
            "memory_parts_gib": self.memory_parts_gib, "hbm_gib": self.hbm_gib,
            "cross_node_bytes_per_iteration": self.cross_node_bytes,
            "bytes_per_phase": self.bytes_per_phase, "layout": self.layout,
            "notes": self.notes,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=False)


def _check(pi: PlanInput, cluster: Cluster) -> None:
    if pi.world_size != cluster.world_size:
        raise PlanError(f"the layout needs {pi.world_size} GPUs (TP {pi.tp} x PP {pi.pp} x DP "
                        f"{pi.dp}) but the cluster has {cluster.world_size} "
                        f"({cluster.num_nodes} x {cluster.gpus_per_node}); change --num-nodes "
                        f"or the layout")
    if pi.fp8 and not cluster.gpu.peak_fp8_tflops:
        raise HardwareError(f"--fp8-format needs FP8 tensor cores, which {cluster.gpu.name} "
                            f"lacks; drop --fp8-format or pick an H100-class --gpu")


def predict(pi: PlanInput, cluster: Cluster, cal: Calibration,
            prefetch_limit: int | None = None) -> Prediction:
    """The step time and peak memory of `pi` on `cluster`.

    prefetch_limit: None for megaq (a unit's whole gather is issued ahead, behind the
    previous unit's compute). Another system's ZeRO-3 that fetches at most this many
    parameter elements ahead of use (DeepSpeed's stage3_prefetch_bucket_size) is modelled
    with that share of each unit's gather hidden the same way and the rest on demand,
    exposed; used only where such a system was measured (planner.published)."""
    _check(pi, cluster)
    cfg, z, gpu = pi.model, pi.zero, cluster.gpu
    g = dp_group_shape(pi.world_size, pi.tp, pi.pp, pi.gpus_per_node, z.hpz_partition_size,
                       pi.rank_order)
    M, mb, tokens = pi.num_micro_batches, pi.micro_batch_size, pi.micro_batch_size * pi.seq_length
    link_eff = cal.link_efficiency
    elem = pi.elem
    hbm = gpu.hbm_gb_per_s * 1e9 * cal.hbm_efficiency
    layers_per_chunk = cfg.num_layers // (pi.pp * pi.vp)
    intra_tp = pi.tp <= pi.gpus_per_node
    tp_link = cluster.intra_node_bytes_per_s * link_eff[INTRA] if intra_tp else \
        cluster.inter_node_bytes_per_s * link_eff[INTER] / pi.gpus_per_node
    tp_lat = cluster.intra_node_latency_s if intra_tp else cluster.inter_node_latency_s

    def tp_time(n_collectives: int) -> float:
        """TP's all-reduces (or SP's gather + reduce-scatter pairs, the same bytes) of the
        residual stream, in line with compute."""
        if pi.tp == 1:
            return 0.0
        full = tokens * cfg.hidden_size * elem
        return n_collectives * (2 * full * (pi.tp - 1) / pi.tp / tp_link
                                + 2 * (pi.tp - 1) * tp_lat)

    times: dict[tuple, tuple] = {}

    def unit_times(u) -> tuple[traffic.LinkTime, traffic.LinkTime, traffic.LinkTime]:
        """(forward gather, later gather, reduction) of a unit; once per size."""
        key = (u.numel, u.fp8_numel)
        if key not in times:
            times[key] = (traffic.gather_time(u, g, z, elem, cluster, link_eff, False),
                          traffic.gather_time(u, g, z, elem, cluster, link_eff, True),
                          traffic.reduce_time(u, g, z, elem, cluster, link_eff))
        return times[key]

    # a later gather and a reduction in flight together share a communicator (the DP
    # group's) unless the gather runs over hpZ's in-node group or the reduction over
    # qgZ's two hop groups
    same_group = not (z.hpz or z.weight_deltas or z.quantized_gradients)

    # per stage and chunk: compute, and the exposed gathers / reduces of one micro-batch
    stages = []
    for s in range(pi.pp):
        units = stage_units(cfg, pi.tp, pi.pp, pi.vp, s, pi.e4m3_weights)
        chunks = []
        for c in range(pi.vp):
            prefix = f"chunk{c}." if pi.vp > 1 else ""
            cu = [u for u in units if (u.name.startswith(prefix) if prefix else True)]
            last = s == pi.pp - 1 and c == pi.vp - 1
            cc = compute.chunk_compute(cfg, gpu, cal, layers=layers_per_chunk, tp=pi.tp,
                                       sp=pi.sequence_parallel, micro_batch=mb, has_head=last,
                                       fp8=pi.fp8, compiled=pi.compiled,
                                       fused_swiglu_fp8=pi.swiglu_fp8_backward_fused,
                                       fused_rope_fp8=pi.rope_fp8_backward_fused)
            per_unit_fwd = cc.fwd_s / max(len(cu), 1)
            per_unit_bwd = cc.bwd_s / max(len(cu), 1)
            tp_f, tp_b = tp_time(2 * layers_per_chunk), tp_time(2 * layers_per_chunk)
            exp = {"weight_gather_fwd": 0.0, "weight_gather_bwd": 0.0, "grad_reduce": 0.0}
            exp_first = {"weight_gather_fwd": 0.0}
            quant_s = 0.0
            if z.stage == 3:
                gf = [unit_times(u)[0].total for u in cu]
                gb = [unit_times(u)[1].total for u in cu]
                ahead = [1.0 if prefetch_limit is None else min(1.0, prefetch_limit / max(u.numel, 1))
                         for u in cu]  # the share of each unit's gather issued ahead of use
                pre = z.prefetch > 0

                def hidden_behind(t: float, share: float, compute_s: float) -> float:
                    """Exposed seconds of a gather whose `share` was issued during the
                    previous unit's compute and whose rest is fetched on demand."""
                    return (1 - share) * t + max(0.0, share * t - compute_s)
                # forward: the first unit's gather is exposed, the others hide behind
                # the previous unit's compute (prefetch); without prefetch all are exposed
                first_fwd = gf[0] + sum(hidden_behind(t, a, per_unit_fwd) if pre else t
                                        for t, a in zip(gf[1:], ahead[1:]))
                later_fwd = gb[0] + sum(hidden_behind(t, a, per_unit_fwd) if pre else t
                                        for t, a in zip(gb[1:], ahead[1:])) \
                    if z.hpz else first_fwd
                exp_first["weight_gather_fwd"] = first_fwd
                # each unit's span in the step's first forward: its compute and the
                # exposed part of its gather (what the weight-delta exchange hides behind)
                exp_first["unit_spans"] = [per_unit_fwd + gf[0]] + [
                    per_unit_fwd + (hidden_behind(t, a, per_unit_fwd) if pre else t)
                    for t, a in zip(gf[1:], ahead[1:])]
                exp["weight_gather_fwd"] = later_fwd
                # backward, units in reverse: the next unit's gather (prefetched) and this
                # unit's reduction (async) run under the next unit's backward
                rev = list(reversed(cu))
                rev_ahead = list(reversed(ahead))
                exp["weight_gather_bwd"] = unit_times(rev[0])[1].total
                for i in range(len(rev) - 1):
                    gt = unit_times(rev[i + 1])[1]
                    # grads_reduced_once: no reduction in backward (all in the tail below)
                    rt = traffic.LinkTime() if z.grads_reduced_once else unit_times(rev[i])[2]
                    if not pre:
                        exp["weight_gather_bwd"] += gt.total
                        exp["grad_reduce"] += max(0.0, rt.total - per_unit_bwd)
                        continue
                    a = rev_ahead[i + 1]
                    exp["weight_gather_bwd"] += (1 - a) * gt.total  # fetched on demand
                    gt = traffic.LinkTime(a * gt.intra, a * gt.inter, a * gt.latency)
                    over = max(0.0, traffic.overlapped(gt, rt, same_group) - per_unit_bwd)
                    share = gt.total / max(gt.total + rt.total, 1e-30)
                    exp["weight_gather_bwd"] += over * share
                    exp["grad_reduce"] += over * (1 - share)
                rd = [unit_times(u)[2].total for u in rev]
            else:
                rd = [unit_times(u)[2].total for u in reversed(cu)]
                # stages 0 and 2: the reductions overlap the rest of backward; reduced
                # once (stage 1, last_microbatch) they all run after the last backward,
                # in finish_grad_sync: the step's tail below
                if not z.grads_reduced_once:
                    exp["grad_reduce"] = sum(max(0.0, r - per_unit_bwd) for r in rd[:-1])
            n_full = sum(u.padded_numel(g.n, z.block_size) for u in cu)
            if z.quantized_weights:  # qwZ's kernels per gather: per micro-batch, or per step
                quant_s += n_full * cal.quantize_bytes.get("qwz", 3.0) / hbm / (
                    M if z.weights_resident else 1)
            if z.quantized_gradients:  # qgZ's per reduction
                quant_s += n_full * cal.quantize_bytes.get("qgz", 6.0) / hbm / (
                    M if z.grads_reduced_once else 1)
            chunks.append(dict(cc=cc, tp_f=tp_f, tp_b=tp_b, exp=exp, exp_first=exp_first,
                               quant=quant_s, tail=rd[-1] if rd else 0.0, units=cu))
        stages.append(dict(units=units, chunks=chunks))

    def fwd_s(s, c):
        ch = stages[s]["chunks"][c]
        return ch["cc"].fwd_s + ch["tp_f"] + ch["exp"]["weight_gather_fwd"] + ch["quant"] / 3

    def bwd_s(s, c):
        ch = stages[s]["chunks"][c]
        return (ch["cc"].bwd_s + ch["tp_b"] + ch["exp"]["weight_gather_bwd"]
                + ch["exp"]["grad_reduce"] + 2 * ch["quant"] / 3)

    p2p = 0.0
    if pi.pp > 1:
        # blocking sends of one micro-batch's activation (gradient) to the next stage;
        # neighbouring stages are world/PP ranks apart (TP apart with tp-pp-dp order)
        act = tokens * cfg.hidden_size * elem / (pi.tp if pi.sequence_parallel else 1)
        stride = pi.world_size // pi.pp if pi.rank_order == "tp-dp-pp" else pi.tp
        if stride >= pi.gpus_per_node:  # every GPU of a node sends through its NICs
            p2p = (act / (cluster.inter_node_bytes_per_s * link_eff[INTER] / pi.gpus_per_node)
                   + cluster.inter_node_latency_s)
        else:
            p2p = (act / (cluster.intra_node_bytes_per_s * link_eff[INTRA])
                   + cluster.intra_node_latency_s)
    sim = bubble_mod.simulate(pi.pp, pi.vp, M, fwd_s, bwd_s, p2p)
    # the bubble proper: the schedule's idle slots with instant transfers
    idle = bubble_mod.simulate(pi.pp, pi.vp, M, fwd_s, bwd_s, 0.0).idle_s if p2p else sim.idle_s
    # the step's first forward gathers cross nodes under hpZ: extra time, once per chunk
    first_extra = max(sum(ch["exp_first"]["weight_gather_fwd"] - ch["exp"]["weight_gather_fwd"]
                          for ch in st["chunks"]) for st in stages) if z.stage == 3 else 0.0
    # the last reduction (the first unit's, after backward's end: finish_grad_sync waits);
    # grads reduced once (stage 1, last_microbatch): every reduction of the step, one
    # after another on the DP group
    tail = max(st["chunks"][0]["tail"] for st in stages)
    if z.grads_reduced_once:
        tail = max(sum(unit_times(u)[2].total for u in st["units"]) for st in stages)
    # stages 1 and 2: the one all-gather of the updated weights after the optimizer step
    step_gather = max(sum(unit_times(u)[0].total for u in st["units"]) for st in stages) \
        if z.weights_resident else 0.0
    # optimizer: the fused AdamW over this rank's shard
    shard_params = max(sum(u.shard_numel(g.n, z.block_size) if z.stage else u.numel
                           for u in st["units"]) for st in stages)
    optimizer_s = shard_params * (cal.optimizer_bytes_per_param
                                  - fp32_grad_extra_bytes(pi.grad_elem)) / hbm
    if z.stage == 0:  # then the E4M3-only weights are cast from the masters (fp8_resident)
        optimizer_s += max(sum(u.fp8_numel for u in st["units"]) for st in stages) \
            * (REFRESH_BYTES_PER_PARAM + AMAX_READ_BYTES_PER_PARAM * pi.refresh_reads_masters) / hbm
    deltas_s = 0.0
    if z.weight_deltas:
        # the exchange's exposed waits, and the kernels that make and apply the differences
        deltas_s = max(_delta_exchange_waits(
            [traffic.delta_time(u, g, z, cluster, link_eff).total for u in st["units"]],
            [t for ch in st["chunks"] for t in ch["exp_first"]["unit_spans"]])
            + sum(traffic.delta_kernel_bytes(u, g, z, elem) / hbm for u in st["units"])
            for st in stages)
    step = sim.makespan_s + max(first_extra, 0.0) + tail + optimizer_s + deltas_s \
        + step_gather + cal.fixed_step_overhead_s

    # ---- breakdowns: on the busiest stage
    crit = max(range(pi.pp), key=lambda s: sim.busy_s[s])
    compute_s = sum(M * (ch["cc"].fwd_s + ch["cc"].bwd_s + ch["quant"])
                    for ch in stages[crit]["chunks"])
    exposed = {
        "weight_gather_fwd": sum(M * ch["exp"]["weight_gather_fwd"] for ch in stages[crit]["chunks"])
        + max(first_extra, 0.0),
        "weight_gather_bwd": sum(M * ch["exp"]["weight_gather_bwd"] for ch in stages[crit]["chunks"]),
        "weight_delta_gather": deltas_s,
        "weight_gather_step": step_gather,
        "grad_reduce": sum(M * ch["exp"]["grad_reduce"] for ch in stages[crit]["chunks"]) + tail,
        "tp": sum(M * (ch["tp_f"] + ch["tp_b"]) for ch in stages[crit]["chunks"]),
        # the waits the stage's activation / gradient transfers add to its idle time
        "pp": max(sim.idle_s[crit] - idle[crit], 0.0),
    }
    bubble_s = idle[crit]

    # ---- bytes (per DP group, every group of the world)
    groups_per_stage = pi.world_size // pi.pp // g.n
    fp8_tensors = FP8_WEIGHTS_PER_LAYER * layers_per_chunk * pi.vp if (z.fp8_weights and pi.fp8) else 0
    phase_bytes: dict[str, dict[str, int]] = {}
    for st in stages:
        for ph, links in traffic.step_phase_bytes(st["units"], g, z, elem, elem, M,
                                                  fp8_tensors).items():
            d = phase_bytes.setdefault(ph, {INTRA: 0, INTER: 0})
            for link in (INTRA, INTER):
                d[link] += links[link] * groups_per_stage
    cross = sum(v[INTER] for v in phase_bytes.values())

    # ---- memory on the fullest stage
    parts, peak = memory_peak(pi, cal, g)
    to_gib = {k: v / memory.GIB for k, v in parts.items()}
    # bench_train.py's count, 6 N + 12 L h s per token (N: non-embedding parameters)
    tokens_per_s = pi.global_batch_size * pi.seq_length / step
    tflops = tokens_per_s * compute.model_flops_per_token(cfg) / pi.world_size / 1e12
    peak_tf = gpu.peak_bf16_tflops
    layout = {"world_size": pi.world_size, "tp": pi.tp, "pp": pi.pp, "vp": pi.vp, "dp": pi.dp,
              "num_micro_batches": M, "dp_group_nodes": g.k, "dp_ranks_per_node": g.m,
              "parameters": total_params(cfg)}
    notes = []
    if pi.vocab_assumed:
        notes.append(f"vocabulary assumed {DEFAULT_VOCAB} (the tokenizer's is known only once "
                     f"it is loaded); pass --vocab-size N for another")
    if parts.get("grads") == 0:
        notes.append("memory peaks at backward's start, before the fp32 gradient "
                     "accumulators come back (the engine frees them between steps)")
    layer_s = min((ch["cc"].fwd_s + ch["cc"].bwd_s) / layers_per_chunk for ch in stages[crit]["chunks"])
    host_s = HOST_LAYER_S["fp8" if pi.fp8 else "bf16"]
    if layer_s < host_s:
        notes.append(f"a layer's forward and backward are {layer_s * 1e3:.2f} ms of GPU work per "
                     f"micro-batch, less than the ~{host_s * 1e3:.1f} ms a host took to launch them "
                     f"(docs/PLANNING.md): the step is likely bound by the host, which the model "
                     f"does not count, and slower than predicted; a larger micro-batch helps")
    return Prediction(
        step_time_s=step, tokens_per_s=tokens_per_s,
        tflops_per_gpu=tflops, mfu=tflops / peak_tf, memory_gib=peak / memory.GIB,
        fits=fits_on(peak, gpu, cal),
        compute_s=compute_s, exposed_comm_s=exposed, bubble_s=bubble_s,
        optimizer_s=optimizer_s, other_s=cal.fixed_step_overhead_s,
        memory_parts_gib=to_gib, cross_node_bytes=cross, bytes_per_phase=phase_bytes,
        hbm_gib=gpu.hbm_gib, layout=layout, notes=notes)


def _delta_exchange_waits(exchange_s: list[float], spans_s: list[float]) -> float:
    """Seconds the step's first forward waits for weight deltas' differences.

    megaq.zero.zeropp.deltas posts every unit's exchange at the step's first gather, in
    engine order, and waits for unit i's at unit i's gather: the exchanges queue on the
    link one after another (unit i's lands at the sum of the first i + 1), while the
    forward runs through the units before i (their spans: compute and exposed gather)."""
    waits = now = landed = 0.0
    for i, x in enumerate(exchange_s):
        if i:
            now += spans_s[i - 1]
        landed += x
        wait = max(0.0, landed - now)
        waits += wait
        now += wait
    return waits


def fits_on(peak_bytes: float, gpu, cal: Calibration) -> bool:
    """Whether a peak fits the device beside what the CUDA context and NCCL take."""
    return peak_bytes / memory.GIB <= gpu.hbm_gib - cal.runtime_reserved_gib


def memory_peak(pi: PlanInput, cal: Calibration, g: traffic.DPGroupShape | None = None
                ) -> tuple[dict[str, float], float]:
    """(bytes by part, peak bytes) of the fullest pipeline stage at its fuller moment
    (backward's start or end: memory.py), allocator slack included; a part the peak
    moment does not hold (the gradient accumulators at backward's start) is 0."""
    g = g or dp_group_shape(pi.world_size, pi.tp, pi.pp, pi.gpus_per_node,
                            pi.zero.hpz_partition_size, pi.rank_order)
    by_stage = [_memory_parts(pi, cal, stage_units(pi.model, pi.tp, pi.pp, pi.vp, s,
                                                   pi.e4m3_weights), s, g)
                for s in range(pi.pp)]
    parts = max(by_stage, key=lambda p: sum(p.values()))
    parts["allocator_slack"] = sum(parts.values()) * cal.allocator_slack
    return parts, sum(parts.values())


def _memory_parts(pi: PlanInput, cal: Calibration, units, stage: int,
                  g: traffic.DPGroupShape) -> dict[str, float]:
    """The parts one stage holds at the larger of backward's start and end."""
    cfg, z = pi.model, pi.zero
    eng = memory.engine_bytes(units, g.n, z, pi.elem, optimizer=pi.optimizer,
                              grad_elem=pi.grad_elem)
    parts = {"weights": eng.params, "optimizer": eng.optimizer, "grads": eng.grads}
    for k, v in eng.zeropp.items():
        parts[k] = v
    # each unit's whole flat buffer in the gather dtype: a gathered unit, a reduce bucket
    fulls = [n * pi.elem for n in memory.flat_numels(units, g.n, z)]
    if z.stage == 3:
        # gathered units in flight: (1 + prefetch) consecutive units, a kept tied embedding
        k = 1 + z.prefetch
        parts["gathered_weights"] = max(sum(fulls[i:i + k]) for i in range(len(fulls)))
    elif z.weights_resident:  # the whole weights, resident
        parts["gathered_weights"] = sum(fulls)
    # reductions in flight (up to reduce_bucket_size) and the one being launched
    reducing = min(z.reduce_bucket_size, sum(fulls)) + max(fulls)
    if z.grads_reduced_once:
        # the full fp32 grads, kept over the step instead of the accumulators:
        # finish_grad_sync reduces them unit by unit (cast to the gather dtype), each
        # unit's accumulator coming back as its full grad goes, so at most one unit
        # holds both, beside the reductions in flight (megaq.zero.grads)
        parts["grads"] = 4 * max(fulls) // pi.elem // (g.n if z.stage else 1)
        parts["grad_buckets"] = eng.full_grads + reducing
    else:
        parts["grad_buckets"] = reducing
    tokens = pi.micro_batch_size * pi.seq_length
    layers = cfg.num_layers // (pi.pp * pi.vp)
    kept, recompute, left = memory.chunk_activation_bytes(
        cfg, tokens, pi.tp, pi.sequence_parallel, layers, fp8=bool(pi.fp8), compiled=pi.compiled)
    M = pi.num_micro_batches
    if pi.vp == 1:
        total = M
        in_flight = min(pi.pp - stage, M)
    else:
        total = M * pi.vp
        warm = total if M == pi.pp else min((pi.pp - stage - 1) * 2 + (pi.vp - 1) * pi.pp, total)
        in_flight = min(warm + 1, total)
    # the accumulators come back at the stage's first backward (megaq.zero.grads): a
    # forward after it (1F1B's steady state, accumulation) runs with them held
    grads_with_activations = in_flight < total
    start = dict(parts, activations=kept * in_flight + recompute)
    if stage == pi.pp - 1:
        start["logits"] = memory.head_activation_bytes(cfg, tokens, pi.tp)
    if z.grads_reduced_once:
        # no accumulator before finish_grad_sync; the full grads from the first backward on
        start["grads"] = 0.0
        start["grad_buckets"] = eng.full_grads if grads_with_activations else max(fulls)
    elif not grads_with_activations:
        start["grads"] = 0.0
    end = dict(parts, activations=left)
    return max((start, end), key=lambda p: sum(p.values()))
