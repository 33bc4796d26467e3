"""Fit the step model's efficiency tables from bench_train.py and bench_kernels.py JSON.

Every number of the calibration comes from a measurement named in its `provenance`:

- **GEMM efficiency** (per dtype, by the GEMM's smallest dimension): where a run was
  profiled, the profiler's matmul time against the GEMM FLOPs of `megaq.model.flops`
  (the bf16 output head taken out of FP8 runs at the bf16 efficiency); at the other
  model sizes, the efficiency at which the model reproduces that size's measured step.
- **attention efficiency**: the profiler's attention time against the attention FLOPs.
- **HBM efficiency**: bench_kernels.py's quantization kernels at their largest sizes.
- **optimizer bytes per parameter**: the one-pass AdamW step's measured time.
- **element-wise byte scale** (compiled and eager): the rest of the profiled step, as
  the factor on the model's analytic element-wise bytes that reproduces it.
- **the emulated link** (`emulated_link`, only for replaying the two-node emulation):
  each configuration's host time per step (the ranks' main-thread CPU in the training
  step, from the GPU-rank step profile, a separate run: with gloo and CUDA tensors every
  collective is synchronous, so this work and the link's do not overlap), then the
  link's efficiency and the per-message latency of gloo over TCP, from the ZeRO-3 rows
  alone; the other configurations are held out for the validation.

The fit is deterministic: the same files give the same JSON, byte for byte
(tests/test_planner_validation.py regenerates the committed one).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics

from megaq.planner.bench_rows import (BenchFileError, TrainRow, file_gpu, read_kernel_rows,
                                      read_train_rows, read_zeropp_kernels)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "docs", "results")
# What the committed calibration is fitted on. The validation (megaq.planner.validate)
# replays the other files: the final FP8 / bf16 runs at 1.3B and every 3B run (no 3B
# number enters the fit), and the emulated runs other than ZeRO-3.
FIT_TRAIN_FILES = ("bench_train_h200.json", "bench_train_h200_profile.json",
                   "fp8_h200_1.3B.json", "fp8_levers_h200_1.3B_every_transpose_own.json",
                   "fp8_h200_check_125M.json")
FIT_KERNEL_FILES = ("kernels_h200.json",)
FIT_EMULATED_FILE = "emulated_cluster_gpu.json"
EMULATED_FIT_CONFIGS = ("ZeRO-3",)
# netns_step_profile.py --device cuda, beside FIT_EMULATED_FILE: the host time per step;
# a configuration it did not profile takes ZeRO-3's (the same engine path)
FIT_EMULATED_PROFILE = "emulated_step_profile_gpu.json"
HOST_DEFAULT_CONFIG = "ZeRO-3"
# bench_kernels.py ops timed at their largest sizes for the HBM efficiency: the planner
# charges the ZeRO++ kernels and all element-wise work at this fraction of HBM bandwidth
HBM_OPS = ("quantize8", "dequantize8", "quantize4", "dequantize4", "dequant_reduce4",
           "dequant_reduce_quantize4", "reorder_quantize4")
REFERENCE_GPU = "H200"
# qwZ: the engine keeps each shard quantized (qwz_packed_shards), so a gather pays the
# dequantization of the whole unit; the owner's quantize, once per step, is left out
QWZ_DEQUANT_ROW = "dequantize int8, all weights, one call per site's flat buffer"
QGZ_ROW = ("qgZ grad path (reorder_quantize -> dequant_reduce_quantize -> dequant_reduce), "
           "one call per site's flat grad")


class CalibrateError(ValueError):
    """A calibration that cannot be fitted from the files given; one line."""


# ------------------------------------------------------------------ the model, as fitted
class RunFlagsError(ValueError):
    """pretrain_gpt.py flags of a replayed run that its configuration refuses; one line."""


def _run_config(argv, world_size=1, ranks_per_node=None):
    """pretrain_gpt.py's configuration for `argv`, built from the configuration classes'
    own flags (megaq.config.FLAG_CLASSES; the CLI's parser adds only Megatron-LM's
    accepted-and-ignored flags and the planning flags, which replayed runs do not use)."""
    from megaq.config.run import FLAG_CLASSES, ConfigError, RunConfig
    from megaq.data.errors import ArgumentParser, DataError
    from megaq.config.flags import add_flags
    from megaq.model import ModelConfigError
    from megaq.parallel.pipeline import PipelineConfigError
    from megaq.parallel.topology import LayoutError
    from megaq.zero import ZeroConfigError

    class Parser(ArgumentParser):
        error_class = RunFlagsError

    p = Parser(prog="pretrain_gpt.py")
    for cls in FLAG_CLASSES:
        add_flags(p, cls)
    flags = p.parse_args(list(argv))
    try:
        return RunConfig.from_flags(flags, world_size, ranks_per_node)
    except (ConfigError, DataError, LayoutError, ModelConfigError, PipelineConfigError,
            ZeroConfigError) as e:
        raise RunFlagsError(str(e)) from None


@functools.lru_cache(maxsize=512)
def _plan_input(argv: tuple, world_size: int, ranks_per_node: int):
    """pretrain_gpt.py's flags as the model's input (parsed once per run: fits re-predict
    the same run many times)."""
    from megaq.planner.step import PlanInput
    return PlanInput.from_config(_run_config(argv, world_size, ranks_per_node))


def _predict(argv, calibration, cluster=None, prefetch_limit=None, as_measured=None):
    """The model's prediction for pretrain_gpt.py's flags `argv` on `cluster` (default: one
    reference GPU); prefetch_limit as in megaq.planner.step.predict; as_measured: the
    PlanInput fields of how a measured run's code worked (TrainRow.as_measured)."""
    from megaq.planner.hardware import Cluster, gpu_preset
    from megaq.planner.step import predict
    cluster = cluster or Cluster(gpu_preset(REFERENCE_GPU), num_nodes=1, gpus_per_node=1)
    pi = _plan_input(tuple(argv), cluster.world_size, cluster.gpus_per_node)
    if as_measured:
        pi = dataclasses.replace(pi, **as_measured)
    return predict(pi, cluster, calibration, prefetch_limit)


def _flop_split(row: TrainRow) -> dict:
    """GEMM FLOPs of the blocks, of the bf16 head, and attention FLOPs, per step
    (the model's own split of megaq.model.flops.num_flops)."""
    from megaq.planner.compute import flop_split
    from megaq.planner.step import PlanInput
    cfg = PlanInput.from_config(_run_config(row.argv)).model
    split = flop_split(cfg, row.shape[3] * cfg.seq_length)
    q = cfg.num_attention_heads * cfg.kv_channels
    return {"blocks": split.gemm, "head": split.head, "attention": split.attention,
            "smallest_dim": min(cfg.hidden_size, q, cfg.ffn_hidden_size)}


def _bisect(f, target: float, lo: float, hi: float, rel: float = 1e-6) -> float:
    """x in [lo, hi] with f(x) == target, f monotonic; clamps at the ends."""
    flo, fhi = f(lo) - target, f(hi) - target
    if flo * fhi > 0:
        return lo if abs(flo) < abs(fhi) else hi
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        fm = f(mid) - target
        if fm == 0 or (hi - lo) < rel * max(abs(mid), 1e-12):
            return mid
        if (fm < 0) == (flo < 0):
            lo, flo = mid, fm
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _r(x: float, digits: int = 4) -> float:
    """Rounded to `digits` significant figures: the JSON does not carry fit noise."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


# ------------------------------------------------------------------ the fit
def _median(xs):
    xs = list(xs)
    if not xs:
        raise CalibrateError("no measurement to fit")
    return statistics.median(xs)


def fit(train_files, kernel_files, emulated_file=None, *, base=None):
    """The Calibration fitted on these files, and its provenance / residuals (a dict)."""
    from megaq.planner.calibration import load_calibration
    from megaq.planner.hardware import gpu_preset

    gpu = gpu_preset(REFERENCE_GPU)
    for path in train_files:  # another GPU's figures would be fitted as this one's
        other = file_gpu(path)
        if other not in (None, REFERENCE_GPU):
            raise BenchFileError(f"{path} was measured on an {other}; the calibration fits "
                                 f"{REFERENCE_GPU} runs only (tools/plan.py validate checks "
                                 f"other GPUs against it)")
    rows = [r for path in train_files for r in read_train_rows(path)]
    zeropp = [read_zeropp_kernels(path) for path in train_files]
    kernels = [k for path in kernel_files for k in read_kernel_rows(path)]
    if not rows:
        raise CalibrateError("no megaq rows in the --bench-train files")
    cal = base or load_calibration()
    notes = {}

    # HBM: the quantization kernels at their largest size, median over ops
    big = max((k.elements for k in kernels if k.op in HBM_OPS), default=0)
    hbm = [k.gbps for k in kernels if k.op in HBM_OPS and k.impl == "triton" and k.elements == big]
    if not hbm:
        raise CalibrateError("no triton quantization rows in the --bench-kernels files "
                             f"(ops {', '.join(HBM_OPS)})")
    hbm_eff = _median(hbm) / gpu.hbm_gb_per_s
    notes["hbm_efficiency"] = f"median of {len(hbm)} triton kernels at {big} elements"

    # GEMMs and attention from profiled runs
    prof = [r for r in rows if r.profile_ms.get("matmul") and r.profile_ms.get("attention")]
    bf16_prof = [r for r in prof if r.fp8 is None and r.compiled]
    if not bf16_prof:
        raise CalibrateError("no profiled compiled bf16 run (bench_train.py --profile) to fit "
                             "the GEMM and attention efficiencies on")
    gemm_pts = {"bf16": {}, "fp8": {}}
    by_dim: dict = {}
    for r in bf16_prof:
        s = _flop_split(r)
        by_dim.setdefault(s["smallest_dim"], []).append(
            (s["blocks"] + s["head"]) / (r.profile_ms["matmul"] / 1e3) / (gpu.peak_bf16_tflops * 1e12))
    gemm_pts["bf16"] = {d: _median(v) for d, v in by_dim.items()}
    attn = [_flop_split(r)["attention"] / (r.profile_ms["attention"] / 1e3)
            / (gpu.peak_bf16_tflops * 1e12) for r in prof]
    attention_eff = _median(attn)

    def bf16_at(dim):
        pts = sorted(gemm_pts["bf16"].items())
        return min(pts, key=lambda p: abs(math.log(p[0] / dim)))[1]

    by_dim = {}
    for r in prof:
        if r.fp8 is None:
            continue
        s = _flop_split(r)
        head_s = s["head"] / (gpu.peak_bf16_tflops * 1e12 * bf16_at(s["smallest_dim"]))
        fp8_s = r.profile_ms["matmul"] / 1e3 - head_s
        by_dim.setdefault(s["smallest_dim"], []).append(
            s["blocks"] / fp8_s / (gpu.peak_fp8_tflops * 1e12))
    # FP8: the profiler's matmul-only figure is kept as a note; the table's FP8 points are
    # fitted on whole steps below, because the model's element-wise bytes (fitted on bf16)
    # undercount the FP8 casts, which the step pays
    notes["gemm_efficiency"] = (f"bf16: profiled matmul time at {sorted(gemm_pts['bf16'])}; "
                                "fp8: whole compiled FP8 steps (tensorwise and delayed recipes; "
                                "matmul alone, profiled: " + ", ".join(
                                    f"{_r(_median(v), 3)} at {d}" for d, v in sorted(by_dim.items()))
                                + ")")

    # the optimizer: the current one-pass AdamW kernel's rows
    from megaq.planner.shapes import total_params
    from megaq.planner.step import PlanInput, fp32_grad_extra_bytes
    onepass = [r for r in rows if r.optimizer == "onepass"]
    opt_rows = onepass or rows
    opt_bpp = _median(r.optimizer_ms / 1e3 * gpu.hbm_gb_per_s * 1e9 * hbm_eff
                      / total_params(PlanInput.from_config(_run_config(r.argv)).model)
                      + fp32_grad_extra_bytes(r.grad_bytes) for r in opt_rows)
    notes["optimizer_bytes_per_param"] = (f"{len(opt_rows)} {'one-pass ' if onepass else ''}"
                                          "AdamW step times")

    # the ZeRO++ kernels: bench_train.py's zeropp_kernels table (one call per site's flat
    # buffer, as the engine calls them), HBM bytes per element of the whole model
    zpp = [z for z in zeropp if z]
    quantize_bytes = dict(cal.quantize_bytes)
    if zpp:
        per_elem = lambda ms, z: ms / 1e3 * gpu.hbm_gb_per_s * 1e9 * hbm_eff / z["params"]
        quantize_bytes = {
            "qwz": _r(_median(per_elem(z["rows"][QWZ_DEQUANT_ROW]["ms"], z) for z in zpp)),
            "qgz": _r(_median(per_elem(z["rows"][QGZ_ROW]["ms"], z) for z in zpp))}
        notes["quantize_bytes"] = (f"zeropp_kernels of {len(zpp)} bench_train.py file(s): qwz = "
                                   "int8 dequantize of every weight, qgz = the qgZ "
                                   "gradient path, per site's flat buffer")

    cal = dataclasses.replace(
        cal, reference_gpu=REFERENCE_GPU, quantize_bytes=quantize_bytes, attention_efficiency=_r(attention_eff),
        hbm_efficiency=_r(hbm_eff), optimizer_bytes_per_param=_r(opt_bpp),
        gemm_efficiency={k: tuple((d, _r(e)) for d, e in sorted(v.items()))
                         for k, v in gemm_pts.items() if v})

    # element-wise byte scale: the profiled step's remainder, compiled and eager
    scales = dict(cal.elementwise_bytes_scale)
    for mode, compiled in (("compiled", True), ("eager", False)):
        fit_rows = [r for r in prof if r.compiled == compiled and r.fp8 is None]
        if not fit_rows:
            continue
        vals = []
        for r in fit_rows:
            def step(x, r=r):
                c = dataclasses.replace(cal, elementwise_bytes_scale={**scales, mode: x})
                return _predict(r.argv, c, as_measured=r.as_measured()).step_time_s
            vals.append(_bisect(step, r.step_ms / 1e3, 0.0, 50.0))
        scales[mode] = _r(_median(vals))
    cal = dataclasses.replace(cal, elementwise_bytes_scale=scales)
    notes["elementwise_bytes_scale"] = "profiled bf16 steps' remainder after GEMMs and attention"

    # GEMM efficiency at the sizes with no profile: the efficiency that gives their step
    for dtype in ("bf16", "fp8"):
        dims = dict(cal.gemm_efficiency.get(dtype, ())) if dtype == "bf16" else {}
        unprofiled: dict = {}
        for r in rows:
            if (r.fp8 is None) != (dtype == "bf16") or not r.compiled:
                continue
            if dtype == "bf16" and r.profile_ms:
                continue
            if r.fp8 is not None and r.fp8[1] == "rowwise":
                continue  # the rowwise recipe is not the GEMM the planner models for FP8
            d = _flop_split(r)["smallest_dim"]
            if d in dims and dtype == "bf16":
                continue
            def step(e, r=r, d=d):
                table = tuple(sorted({**dims, d: e}.items()))
                c = dataclasses.replace(cal, gemm_efficiency={**cal.gemm_efficiency, dtype: table})
                return -_predict(r.argv, c, as_measured=r.as_measured()).step_time_s  # falls as the efficiency rises
            unprofiled.setdefault(d, []).append(_bisect(step, -r.step_ms / 1e3, 0.05, 1.0))
        if unprofiled:
            dims.update({d: _r(_median(v)) for d, v in unprofiled.items()})
            cal = dataclasses.replace(cal, gemm_efficiency={**cal.gemm_efficiency,
                                                            dtype: tuple(sorted(dims.items()))})
            notes[f"gemm_efficiency.{dtype}.step_fitted"] = sorted(unprofiled)

    provenance = {
        "fitted_on": {"bench_train": [os.path.basename(p) for p in train_files],
                      "bench_kernels": [os.path.basename(p) for p in kernel_files]},
        "held_out_for_validation": "megaq/planner/validate.py's rows (docs/PLANNING.md)",
        "how": notes,
        "not_fitted": {"allocator_slack": "the benchmarks record allocated, not reserved, "
                                          "memory: the model's default is kept",
                       "activations": "counted from the tensors the code saves for backward "
                                      "(megaq/planner/memory.py), not fitted: the fitted "
                                      "files' memory was measured on an earlier tree",
                       "link_efficiency": "no multi-node measurement at speed: the model's "
                                          "default is kept"},
    }
    extra = {"provenance": provenance}
    if emulated_file:
        profile = emulated_profile_beside(emulated_file)
        extra["emulated_link"] = fit_emulated_link(emulated_file, cal, profile)
        provenance["fitted_on"]["emulated"] = {"file": os.path.basename(emulated_file),
                                               "configs": list(EMULATED_FIT_CONFIGS)}
        if profile:
            provenance["fitted_on"]["emulated"]["host_time"] = os.path.basename(profile)
    cal = dataclasses.replace(cal, source=", ".join(
        os.path.basename(p) for p in (*train_files, *kernel_files)))
    return cal, extra


def _allocated_gib(prediction) -> float:
    """The prediction's peak memory without the allocator's slack (what max_memory_allocated
    measures)."""
    return prediction.memory_gib - prediction.memory_parts_gib.get("allocator_slack", 0.0)


# ------------------------------------------------------------------ the emulated link
def emulated_rows(path: str) -> list[dict]:
    """The emulation benchmark's rows: config, rate, flags, measured step and its spread."""
    try:
        with open(path) as f:
            doc = json.load(f)
        base = list(doc["model_args"])
        configs = doc["configs"]
        recs = doc["records"]
    except OSError as e:
        raise BenchFileError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise BenchFileError(f"{path} is not a netns_zero_bench.py result (model_args, configs, "
                             "records)") from None
    if base and base[0].endswith("pretrain_gpt.py"):
        base = base[1:]
    out = []
    for r in recs:
        passes = r.get("step_ms_per_pass") or [r["step_ms"]]
        out.append({"config": r["config"], "rate_gbit": r["rate_bits"] / 1e9,
                    "rate": r["rate"], "argv": base + list(configs[r["config"]]),
                    "step_ms": float(r["step_ms"]), "passes_ms": [float(x) for x in passes],
                    "inter_node_bytes": float(r["steady_accounted_per_iteration"])})
    return out


# the emulation: 2 namespaces ("nodes") x 2 GPU ranks of one H200 machine, gloo over TCP
EMULATED_NODES, EMULATED_RANKS_PER_NODE = 2, 2


def emulated_cluster(rate_gbit: float, link: dict):
    from megaq.planner.hardware import Cluster, gpu_preset
    return Cluster(gpu_preset(REFERENCE_GPU), num_nodes=EMULATED_NODES,
                   gpus_per_node=EMULATED_RANKS_PER_NODE, inter_node_gbit_per_s=rate_gbit,
                   inter_node_latency_s=link["latency_s"], intra_node_gb_per_s=link["loopback_gb_per_s"],
                   intra_node_latency_s=link["latency_s"])


def emulated_calibration(cal, link: dict, config: str | None = None):
    """The calibration for replaying `config` of the emulation: its link, and its host
    time per step in series (the step's fixed overhead)."""
    out = dataclasses.replace(cal, link_efficiency={"intra_node": 1.0,
                                                    "inter_node": link["efficiency"]})
    host = link.get("host_s_per_step")
    if host:
        out = dataclasses.replace(out, fixed_step_overhead_s=host.get(config, host[HOST_DEFAULT_CONFIG]))
    return out


def emulated_host_seconds(path: str) -> dict[str, float]:
    """Per configuration, the profiled ranks' main-thread CPU seconds per training step
    (netns_step_profile.py's train_step_cpu_ms, mean over ranks): the host work of a step
    (Python, launches, gloo's staging copies, the device waits they spin on)."""
    try:
        with open(path) as f:
            results = json.load(f)["results"]
        out = {r["config"]: statistics.mean(float(v["train_step_cpu_ms"])
                                            for v in r["per_rank"].values()) / 1e3
               for r in results}
    except OSError as e:
        raise BenchFileError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError, statistics.StatisticsError):
        raise BenchFileError(f"{path} is not a netns_step_profile.py result (results, "
                             "per_rank, train_step_cpu_ms)") from None
    if HOST_DEFAULT_CONFIG not in out:
        raise CalibrateError(f"{path}: the host time needs the {HOST_DEFAULT_CONFIG} row")
    return {k: _r(v, 4) for k, v in sorted(out.items())}


def fit_emulated_link(path: str, cal, profile: str | None = None) -> dict:
    """The emulated link's efficiency, gloo's per-message latency (TCP, gloo's step, the
    Python call) and the loopback's bandwidth (the in-node hops), least squares in log
    step time over the ZeRO-3 rows at every rate, with the host time per step of
    `profile` (a netns_step_profile.py file) in series; a coarse grid, then a fine one
    around its best point (deterministic)."""
    rows = [r for r in emulated_rows(path) if r["config"] in EMULATED_FIT_CONFIGS]
    if len({r["rate_gbit"] for r in rows}) < 2:
        raise CalibrateError(f"{path}: the emulated link needs the ZeRO-3 rows at two rates")
    host = emulated_host_seconds(profile) if profile else {}

    def err(eff, lat, loop):
        lk = {"efficiency": eff, "latency_s": lat, "loopback_gb_per_s": loop,
              "host_s_per_step": host}
        return sum(math.log(_predict(r["argv"], emulated_calibration(cal, lk, r["config"]),
                                     emulated_cluster(r["rate_gbit"], lk))
                            .step_time_s * 1e3 / r["step_ms"]) ** 2 for r in rows)

    coarse = [(err(e, lat, loop), e, lat, loop)
              for e in [0.5 + 0.05 * i for i in range(11)]
              for lat in [0.5e-3 * i for i in range(21)]
              for loop in (1.0, 2.0, 4.0, 8.0)]
    _, e0, lat0, loop = min(coarse)
    fine = [(err(e, lat, loop), e, lat)
            for e in [e0 + 0.01 * i for i in range(-5, 6)] if 0.3 <= e <= 1.0
            for lat in [lat0 + 0.05e-3 * i for i in range(-10, 11)] if lat >= 0]
    resid, eff, lat = min(fine)
    out = {"efficiency": _r(eff, 3), "latency_s": _r(lat, 3), "loopback_gb_per_s": loop,
           "rms_log_error": _r(math.sqrt(resid / len(rows)), 3),
           "fitted_on": f"{os.path.basename(path)}: {', '.join(EMULATED_FIT_CONFIGS)} rows"}
    if host:
        out["host_s_per_step"] = host
        out["host_fitted_on"] = (f"{os.path.basename(profile)}: train_step_cpu_ms per "
                                 f"configuration; others take {HOST_DEFAULT_CONFIG}'s")
    return out


def emulated_profile_beside(emulated_file: str) -> str | None:
    """The GPU-rank step profile in the emulated file's folder, if there is one."""
    path = os.path.join(os.path.dirname(os.path.abspath(emulated_file)), FIT_EMULATED_PROFILE)
    return path if os.path.exists(path) else None


# ------------------------------------------------------------------ the command
def default_files():
    return ([os.path.join(RESULTS, f) for f in FIT_TRAIN_FILES],
            [os.path.join(RESULTS, f) for f in FIT_KERNEL_FILES],
            os.path.join(RESULTS, FIT_EMULATED_FILE))


def calibration_json(cal, extra) -> str:
    doc = {**cal.to_json(), **extra}
    doc["gemm_efficiency"] = {k: [list(p) for p in v] for k, v in doc["gemm_efficiency"].items()}
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
