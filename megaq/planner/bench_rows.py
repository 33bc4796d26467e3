"""The rows of the project's benchmark JSON files, as pretrain_gpt.py flags and measured figures.

`tools/bench/bench_train.py` names its models by size ("1.3B") and its setups by
variant ("megaq-fp8dl-comp"); the planner needs the flags pretrain_gpt.py would take
for the same run. This module is the one translation between the two, used by the
calibration (which fits on some files) and the validation (which replays the others).

Only the megaq variants are rows here: the `ref-*` and `ao-*` variants are plain
PyTorch / torchao loops whose step is not megaq's, so the planner does not model them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# bench_train.py's SIZES: (layers, hidden, heads, micro-batch); its JSON names sizes, not
# shapes, so the shapes are restated here (tests/test_planner_validation.py checks they
# equal the benchmark's own table)
BENCH_SIZES = {"125M": (12, 768, 12, 16), "350M": (24, 1024, 16, 16), "1.3B": (24, 2048, 16, 8),
               "3B": (28, 3072, 24, 4)}
BENCH_SEQ, BENCH_VOCAB = 2048, 32000
# bench_train.py's FP8_VARIANTS: variant tag -> (--fp8-format, --fp8-recipe)
BENCH_FP8 = {"fp8tw": ("hybrid", "tensorwise"), "fp8rw": ("e4m3", "rowwise"),
             "fp8dl": ("hybrid", "delayed")}
# GPTConfig.llama, as bench_train.py builds it: no dropout (Megatron-LM's flags default to 0.1)
LLAMA_FLAGS = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16",
               "--attention-dropout", "0", "--hidden-dropout", "0"]


class BenchFileError(ValueError):
    """A benchmark file that is not what bench_train.py / bench_kernels.py write."""


@dataclass(frozen=True)
class TrainRow:
    """One measured megaq step of bench_train.py on one GPU, with the flags that describe it."""
    source: str                 # file name (no directory)
    size: str
    variant: str
    argv: tuple                 # pretrain_gpt.py flags of the same model, batch and switches
    step_ms: float
    fwd_bwd_ms: float
    optimizer_ms: float
    peak_mem_gib: float
    optimizer: str              # "onepass" / "fused": the AdamW kernel the run used
    grad_bytes: int = 4         # bytes per gradient element the engine held (files before
    #                             megaq.zero.grads' 16-bit gradients: 4, its fp32 accumulators)
    fused_swiglu_fp8: bool = False  # fc1's FP8 backward took SwiGLU's gradient from the fused
    #                             kernel (PlanInput.fused_swiglu_fp8; see fused_swiglu_fp8_of)
    fused_rope_fp8: bool = False  # the QKV layer's FP8 backward took RoPE's gradient from the
    #                             fused kernel (the key "fused_rope_fp8"; files before: False)
    amax_from_step: bool = False  # stage 0's E4M3 weights took their amaxes from the AdamW
    #                             step's pass (the key "fp8_amax_from_step"; files before: False)
    profile_ms: dict = field(default_factory=dict)  # GPU ms per step by kernel kind, if profiled

    def as_measured(self) -> dict:
        """The PlanInput fields that say how this run's code worked where megaq's has
        changed since (megaq.planner.step.PlanInput: grad_bytes, fused_swiglu_fp8,
        fused_rope_fp8, amax_from_step)."""
        return dict(grad_bytes=self.grad_bytes, fused_swiglu_fp8=self.fused_swiglu_fp8,
                    fused_rope_fp8=self.fused_rope_fp8, amax_from_step=self.amax_from_step)

    @property
    def shape(self) -> tuple:
        return BENCH_SIZES[self.size]

    @property
    def fp8(self) -> tuple | None:
        return next((v for k, v in BENCH_FP8.items() if f"-{k}" in self.variant), None)

    @property
    def compiled(self) -> bool:
        return self.variant.endswith("-comp")

    @property
    def label(self) -> str:
        return f"{self.size} {self.variant}"


def bench_argv(size: str, variant: str, micro_batch: int | None = None,
               shape: tuple | None = None) -> list[str]:
    """pretrain_gpt.py's flags for bench_train.py's (size, variant) on one GPU; `shape`
    (layers, hidden, heads, micro-batch) for a size bench_train.py adds at run time."""
    if shape is None and size not in BENCH_SIZES:
        raise BenchFileError(f"unknown bench_train size {size!r} (known: {', '.join(BENCH_SIZES)})")
    layers, hidden, heads, mb = shape or BENCH_SIZES[size]
    mb = micro_batch or mb
    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(BENCH_SEQ),
            "--max-position-embeddings", str(BENCH_SEQ), "--vocab-size", str(BENCH_VOCAB),
            "--micro-batch-size", str(mb), "--global-batch-size", str(mb), *LLAMA_FLAGS,
            "--zero-stage", "3" if "-s3" in variant else "0", "--lr", "3e-4", "--train-iters", "10", "--mock-data"]
    if variant.endswith("-comp"):
        argv.append("--compile-blocks")
    fp8 = next((v for k, v in BENCH_FP8.items() if f"-{k}" in variant), None)
    if fp8:
        argv += ["--fp8-format", fp8[0], "--fp8-recipe", fp8[1]]
    if "-fp8g" in variant:
        argv += ["--zero-quantized-weights", "fp8"]
    return argv


def _load_json(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise BenchFileError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise BenchFileError(f"{path} is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(doc, dict):
        raise BenchFileError(f"{path}: expected a JSON object")
    return doc


def file_gpu(path: str) -> str | None:
    """The planner's preset of the GPU a bench file was measured on (its "device", as torch
    names it), None when no preset describes it or the file does not say."""
    from megaq.planner.hardware import preset_of_device
    device = _load_json(path).get("device")
    return preset_of_device(device) if isinstance(device, str) else None


# bench_train.py files measured with fc1's fused FP8 SwiGLU backward before the rows said so
# (the key "fused_swiglu_fp8"): its delayed-recipe rows other than -nse (SwiGLU after the
# GEMM) ran it. Every other file without the key predates the kernel.
FUSED_SWIGLU_FP8_FILES = (
    "bench_train_h100_1.3B_fused_fp8_bwd.json", "bench_train_h100_3B_fused_fp8_bwd.json",
    "bench_train_h100_1.3B_gpu_fp8_cvt.json", "bench_train_h100_1.3B_fused_cvt.json",
    "bench_train_h100_3B_fused_cvt.json", "bench_train_h100_1.3B_same_run.json",
    "bench_train_h100_3B_same_run.json")


def fused_swiglu_fp8_of(source: str, row: dict) -> bool:
    """Whether a bench_train.py row's FP8 backward of fc1 ran the fused SwiGLU kernel."""
    if "fused_swiglu_fp8" in row:
        return bool(row["fused_swiglu_fp8"])
    variant = str(row.get("variant", ""))
    return source in FUSED_SWIGLU_FP8_FILES and "-fp8dl" in variant and "-nse" not in variant


def read_train_rows(path: str) -> list[TrainRow]:
    """The megaq rows of one bench_train.py JSON (failed and reference rows left out)."""
    doc = _load_json(path)
    results = doc.get("results")
    if not isinstance(results, list) or "meta" in doc or doc.get("seq", BENCH_SEQ) != BENCH_SEQ:
        raise BenchFileError(f"{path} is not a bench_train.py result (no 'results' list at seq "
                             f"{BENCH_SEQ}); pass it with --bench-kernels if it is bench_kernels.py's")
    rows = []
    for r in results:
        if not isinstance(r, dict) or "error" in r or not str(r.get("variant", "")).startswith("megaq"):
            continue
        try:
            rows.append(TrainRow(
                source=os.path.basename(path), size=r["size"], variant=r["variant"],
                argv=tuple(bench_argv(r["size"], r["variant"], int(r["micro_batch"]))),
                step_ms=float(r["step_ms"]), fwd_bwd_ms=float(r["fwd_bwd_ms"]),
                optimizer_ms=float(r["optimizer_ms"]), peak_mem_gib=float(r["peak_mem_gib"]),
                optimizer=str(r.get("optimizer", "fused")), grad_bytes=int(r.get("grad_bytes", 4)),
                fused_swiglu_fp8=fused_swiglu_fp8_of(os.path.basename(path), r),
                fused_rope_fp8=bool(r.get("fused_rope_fp8", False)),
                amax_from_step=bool(r.get("fp8_amax_from_step", False)),
                profile_ms=dict(r.get("profile_ms_per_step_by_kind") or {})))
        except (KeyError, TypeError, ValueError) as e:
            raise BenchFileError(f"{path}: row {r.get('size')} {r.get('variant')} lacks or "
                                 f"mangles {e}") from None
    return rows


@dataclass(frozen=True)
class KernelRow:
    """One graph-replay timing of bench_kernels.py: an op over `bytes` of HBM traffic."""
    source: str
    op: str
    impl: str
    elements: int
    bytes: int
    gbps: float


def read_kernel_rows(path: str) -> list[KernelRow]:
    """The timed rows of one bench_kernels.py JSON (checks and sweeps left out)."""
    doc = _load_json(path)
    results = doc.get("results")
    if not isinstance(results, list) or "meta" not in doc:
        raise BenchFileError(f"{path} is not a bench_kernels.py result (no 'meta' and "
                             "'results'); pass it with --bench-train if it is bench_train.py's")
    rows = []
    for r in results:
        if isinstance(r, dict) and {"op", "impl", "elements", "bytes", "GBps"} <= set(r):
            rows.append(KernelRow(os.path.basename(path), r["op"], r["impl"], int(r["elements"]),
                                  int(r["bytes"]), float(r["GBps"])))
    return rows


def read_zeropp_kernels(path: str) -> dict | None:
    """bench_train.py's `zeropp_kernels` table (the ZeRO++ kernels on the 1.3B model's
    parameters), or None when the file has none."""
    table = _load_json(path).get("zeropp_kernels")
    if not isinstance(table, dict) or not isinstance(table.get("rows"), dict) \
            or not isinstance(table.get("params"), int):
        return None
    return table
