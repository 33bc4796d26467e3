"""Several GPUs of one host (or CPU ranks): numerics, NCCL transports, ZeRO-3 vs ZeRO++ timings.

    python tools/cluster/multigpu_check.py                       # all GPUs of this host, nccl
    python tools/cluster/multigpu_check.py --device cpu --gpus 2 --model tiny --steps 2   # gloo ranks

Three stages, each a short pretrain_gpt.py training run started through torchrun
(--nproc-per-node G), so what is checked is the real training path:

1. numerics: one process (the reference) and every TP x PP x DP split of the G ranks
   (ZeRO-3), then full ZeRO++ (qwZ + hpZ + qgZ), on the same global batches of a
   small Llama-style model; per-iteration losses and grad norms must match the
   reference within fp32 / bf16 tolerances, ZeRO++ within its quantization bound.
2. transport: the G ranks pose as 2 nodes (--gpus-per-node G/2). Each half gets its
   own NCCL_HOSTID, so NCCL treats the halves as different hosts: P2P/SHM only inside
   a half, everything across the halves over NCCL's socket transport (NET/Socket).
   NCCL's INFO log (INIT,NET) says which transport each channel took; the lines are
   printed and checked (cross-half channels must be NET, in-half ones must not be).
   A timed all-gather over the world, with and without the split, shows the link is
   really slower.
3. bench: in that same 2-"node" run, ZeRO-3, qwZ, qwZ+hpZ and full ZeRO++ train a
   ~1.1B-parameter Llama-style model (TinyLlama's shape) with small micro-batches;
   step time (median after warm-up), per-phase bytes per node per iteration (the
   metrics file's `comm`), each one's speedup over ZeRO-3 of the same run, and (one
   more iteration each with --log-comm-time) milliseconds per communication phase.

Stage `resume` (between numerics and bench by default): runs stopped at iteration 2
and resumed from their checkpoints must continue as runs that never stopped (full
ZeRO++ with error feedback on the same layout; ZeRO-3 resharded onto a TP/PP split).

NVLink multicast stays off in every process: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 (and NCCL_MNNVL_ENABLE=0);
nothing here creates multicast objects. A JSON record goes to --out; a table is printed last.

`worker` is the per-rank entry torchrun starts: it runs a plan (a list of pretrain_gpt
argument lists and link probes) in one process group, one after another.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
REPO = _checkout.ROOT
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1", "NCCL_MNNVL_ENABLE": "0"}
PHASES = ("weight_gather_fwd", "weight_gather_bwd", "grad_reduce")

# Tolerances of stage 1 (relative to the one-process reference, per iteration), as
# (lm loss, grad norm). The mock-data loss sits near ln(vocab) and moves little in 3
# steps, so the grad norm (which sees every gradient element) is the sharper check.
# fp32: the splits only change summation order (~1e-7 per op; 2e-7 seen on CPU); a
# wrong shard, a missed reduction or a stale weight moves the norm by percents.
# bf16: 8-bit mantissa, 2^-9 rounding per op in a different order in every split
# (CPU: loss 6e-6, norm 1.2e-3). ZeRO++ (int8 weights, int4 gradients, bf16): the
# tests hold its loss within 0.5% of ZeRO-3 (tests/test_zeropp_training.py MARGIN);
# int4 gradient noise adds energy to the reduced gradient, so its norm reads high:
# CPU, 2 ranks (one quantizing hop): loss 3.6e-4, norm 1.6e-2; 4 ranks as 2 nodes x 2
# (two hops, each adding noise): loss 3.5e-4, norm 4.4e-2. 10% on the norm still
# fails a missed or doubled reduction (a factor of 2 or sqrt(DP)). exact: hpZ against
# the same run without it (its backward gathers return forward's weights bit for bit).
TOL = {"fp32": (1e-4, 1e-4), "bf16": (5e-3, 3e-2), "zeropp": (5e-3, 1e-1), "exact": (0.0, 0.0)}

MODELS = {
    # TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 heads, 4 KV groups, SwiGLU 5632.
    "1b": dict(layers=22, hidden=2048, heads=32, groups=4, ffn=5632, vocab=32000),
    "350m": dict(layers=24, hidden=1024, heads=16, groups=4, ffn=2816, vocab=32000),
    "tiny": dict(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=256),
}
NUMERICS_MODEL = dict(layers=4, hidden=64, heads=4, groups=2, ffn=128, vocab=256)


class CheckError(RuntimeError):
    """A stage's result is wrong (numerics off, wrong transport): one line says what.
    args[1], when given, is the stage's partial result (kept in the record)."""


# --------------------------------------------------------------------- arguments
def model_argv(m: dict, seq: int, tied: bool = False) -> list[str]:
    """Llama-style flags (Megatron names) for pretrain_gpt.py; `tied` shares the word
    embedding with the output layer (Megatron's default, GPT-2 style)."""
    return ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
            "--num-attention-heads", str(m["heads"]), "--group-query-attention",
            "--num-query-groups", str(m["groups"]), "--ffn-hidden-size", str(m["ffn"]),
            "--seq-length", str(seq), "--position-embedding-type", "rope",
            "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            *([] if tied else ["--untie-embeddings-and-output-weights"]),
            "--attention-dropout", "0",
            "--hidden-dropout", "0", "--mock-data", "--vocab-size", str(m["vocab"]),
            "--make-vocab-size-divisible-by", "128", "--eval-iters", "0",
            "--log-interval", "1", "--lr-decay-style", "constant"]


def bench_variants(hpz: int, qgz_chunks: tuple[int, ...] = ()) -> dict[str, list[str]]:
    """ZeRO-3, qwZ, qwZ+hpZ, ZeRO++, then ZeRO++ with each qgZ chunk size asked for."""
    qw, hp, qg = (["--zero-quantized-weights"], ["--zero-hpz-partition-size", str(hpz)],
                  ["--zero-quantized-gradients"])
    out = {"ZeRO-3": [], "qwZ": qw, "qwZ+hpZ": qw + hp, "ZeRO++": qw + hp + qg}
    for c in qgz_chunks:
        out[f"ZeRO++ chunk {c}"] = qw + hp + qg + ["--zero-quantized-gradients-chunk", str(c)]
    return out


def layouts(g: int, m: dict) -> list[tuple[int, int, int]]:
    """Every (TP, PP, DP) with TP*PP*DP = g that the model admits (TP | KV groups, PP | layers)."""
    out = []
    for tp in range(1, g + 1):
        for pp in range(1, g // tp + 1):
            if g % (tp * pp) == 0 and m["groups"] % tp == 0 and m["layers"] % pp == 0:
                out.append((tp, pp, g // (tp * pp)))
    # most model-parallel first, but pipelines with middle stages (PP > 2) last: a
    # failing split ends its launch, and this keeps the other splits' results
    return sorted(out, key=lambda x: (x[1] > 2, -x[0] * x[1], x))


# ------------------------------------------------------------------ environment
def child_env(device: str, gpus: int) -> dict:
    env = dict(os.environ)
    env.update(NO_MULTICAST)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if device == "cpu":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", "1")
    else:  # torchrun would set 1; the model is initialised on the CPU before moving
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, gpus))))
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return env


# ---------------------------------------------------------------------- launching
def launch(plan: dict, nproc: int, env: dict, log_dir: str, name: str, timeout: float) -> None:
    """torchrun --nproc-per-node nproc <this file> worker --plan <plan>; output to a log."""
    plan_path = os.path.join(log_dir, f"{name}.plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), os.path.abspath(__file__), "worker", "--plan", plan_path]
    log = os.path.join(log_dir, f"{name}.log")
    print(f"[multigpu_check] {name}: {' '.join(cmd[1:])}  (log {log})", flush=True)
    t0 = time.time()
    with open(log, "w") as out:
        # own session, so a timeout ends torchrun and every rank it started, by group id
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CheckError(f"{name} ran past {timeout:.0f} s; see {log}") from None
        finally:  # a timeout, or this driver being stopped (SIGTERM -> SystemExit)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    print(f"[multigpu_check] {name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
    if rc != 0:
        text = open(log, errors="replace").read()
        first = re.search(r"^(?:\[rank\d+\]: )?\w*(?:Error|Exception)\b.*$", text, re.M)
        cause = f": {first.group(0).strip()}" if first else ""
        raise CheckError(f"{name} failed (exit {rc}){cause}; end of {log}:\n{text[-3000:]}")


def read_train_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise CheckError(f"no metrics file {path}: the run wrote no training line")
    with open(path) as f:
        return [r for r in (json.loads(x) for x in f if x.strip()) if r.get("type") == "train"]


# ------------------------------------------------------------------- stage 1
def numerics(args, env, log_dir) -> dict:
    g, m, steps = args.gpus, NUMERICS_MODEL, 3
    micro, gbs = 2, 4 * args.gpus  # every split sees the same global batch
    common = ["--micro-batch-size", str(micro), "--global-batch-size", str(gbs), "--train-iters",
              str(steps), "--lr", "3e-3", "--seed", "7", "--data-cache-path", os.path.join(log_dir, "data")]
    base = model_argv(m, 32) + common
    tied = model_argv(m, 32, tied=True) + common
    mf = lambda label: os.path.join(log_dir, f"numerics_{label}.jsonl")  # noqa: E731
    ref_runs = {"ref_fp32": base + ["--zero-stage", "3"],
                "ref_bf16": base + ["--zero-stage", "3", "--bf16"],
                "ref_fp32_tied": tied + ["--zero-stage", "3"]}
    hpz = max(1, g // 2)
    runs = {}
    for tp, pp, dp in layouts(g, m):
        runs[f"tp{tp}_pp{pp}_dp{dp}_fp32"] = (base + ["--tensor-model-parallel-size", str(tp),
                                                      "--pipeline-model-parallel-size", str(pp)],
                                              "ref_fp32", TOL["fp32"])
    splits = layouts(g, m)  # bf16: the most model-parallel split and plain ZeRO-3 DP=G
    for tp, pp, dp in dict.fromkeys([splits[0], (1, 1, g)]):
        runs[f"tp{tp}_pp{pp}_dp{dp}_bf16"] = (base + ["--tensor-model-parallel-size", str(tp),
                                                      "--pipeline-model-parallel-size", str(pp),
                                                      "--bf16"], "ref_bf16", TOL["bf16"])
    runs[f"zeropp_dp{g}_bf16"] = (base + ["--bf16", "--gpus-per-node", str(hpz)]
                                  + bench_variants(hpz)["ZeRO++"], "ref_bf16", TOL["zeropp"])
    # hpZ over NCCL: as one node of G ranks its secondary partition spans all G (with
    # two "nodes" of one GPU each, G = 2, it would have nobody to partition with); the
    # cross-node hop of qgZ is empty there. The same run without hpZ is compared to it
    # below: hpZ must not change a single number.
    one_node = ["--bf16", "--gpus-per-node", str(g)]
    runs[f"zeropp_1node_hpz{g}_bf16"] = (base + one_node + bench_variants(g)["ZeRO++"], "ref_bf16",
                                         TOL["zeropp"])
    runs["zeropp_1node_nohpz_bf16"] = (base + one_node + ["--zero-quantized-weights",
                                                          "--zero-quantized-gradients"],
                                       "ref_bf16", TOL["zeropp"])
    # weight deltas over the same one-node hpZ group (point-to-point differences, the
    # references' in-node gathers on the side stream): int4 weight error, as ZeRO++'s
    runs[f"deltas_1node_hpz{g}_bf16"] = (base + one_node + ["--zero-hpz-partition-size", str(g),
                                                            "--zero-weight-deltas",
                                                            "--zero-quantized-gradients"],
                                         "ref_bf16", TOL["zeropp"])
    # tied embeddings: on one stage (the head reads the embedding unit, kept gathered
    # between the two), and split over the pipeline (the tied copies' gradient all-reduce)
    for tp, pp, dp in dict.fromkeys([(1, 1, g), next((x for x in splits if x[1] > 1), (1, 1, g))]):
        runs[f"tp{tp}_pp{pp}_dp{dp}_fp32_tied"] = (tied + ["--tensor-model-parallel-size", str(tp),
                                                           "--pipeline-model-parallel-size", str(pp)],
                                                   "ref_fp32_tied", TOL["fp32"])
    # deep pipelines (PP > 2: middle stages) run last, whatever their precision
    runs = dict(sorted(runs.items(), key=lambda kv: "_pp" in kv[0] and
                       int(kv[0].split("_pp")[1].split("_")[0]) > 2))
    for label in list(ref_runs) + list(runs):
        if os.path.exists(mf(label)):
            os.remove(mf(label))
    device = args.device
    launch({"device": device, "entries": [{"argv": a + ["--metrics-file", mf(k)], "label": k}
                                          for k, a in ref_runs.items()]},
           1, env, log_dir, "numerics_reference", args.timeout)
    failure = None
    try:
        launch({"device": device, "entries": [{"argv": a + ["--metrics-file", mf(k)], "label": k}
                                              for k, (a, _, _) in runs.items()]},
               g, env, log_dir, "numerics_layouts", args.timeout)
    except CheckError as e:  # compare what finished; name the rest
        failure = e
    refs = {k: read_train_lines(mf(k)) for k in ref_runs}
    for ref_name, ref in refs.items():
        if len(ref) != steps:
            raise CheckError(f"{ref_name}: {len(ref)} training lines, expected {steps}")
    out = compare_runs("numerics", {label: (mf(label), ref_name, refs[ref_name], tol)
                                    for label, (_, ref_name, tol) in runs.items()},
                       range(1, steps + 1), failure)
    hpz_run, plain = f"zeropp_1node_hpz{g}_bf16", "zeropp_1node_nohpz_bf16"
    out.update(compare_runs("numerics", {f"{hpz_run}_vs_nohpz": (mf(hpz_run), plain, read_train_lines(mf(plain)),
                                                                 TOL["exact"])},
                            range(1, steps + 1), None))
    return out


def compare_runs(stage: str, runs: dict, iterations, failure: Exception | None) -> dict:
    """runs: {label: (metrics file, reference name, reference lines, (tol loss, tol norm))}.
    Each run's loss and grad norm at `iterations` against its reference's, relative;
    CheckError naming every run out of tolerance or unfinished (after printing all)."""
    out, bad, want = {}, [], list(iterations)
    for label, (path, ref_name, ref_lines, tol) in runs.items():
        got = {r["iteration"]: r for r in (read_train_lines(path) if os.path.exists(path) else [])}
        ref = {r["iteration"]: r for r in ref_lines}
        if any(i not in got for i in want):
            out[label] = {"reference": ref_name, "ok": False, "error": "did not finish"}
            print(f"[{stage}] {label:22s} did not finish", flush=True)
            bad.append(label)
            continue
        pairs = [(got[i], ref[i]) for i in want]
        err_loss = max(abs(a["lm_loss"] - b["lm_loss"]) / abs(b["lm_loss"]) for a, b in pairs)
        err_norm = max(abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"]) for a, b in pairs)
        ok = err_loss <= tol[0] and err_norm <= tol[1]
        out[label] = {"reference": ref_name, "iterations": want, "rel_err_loss": err_loss,
                      "rel_err_grad_norm": err_norm, "tolerance": {"loss": tol[0], "grad_norm": tol[1]},
                      "ok": ok, "losses": [a["lm_loss"] for a, _ in pairs],
                      "ref_losses": [b["lm_loss"] for _, b in pairs],
                      "grad_norms": [a["grad_norm"] for a, _ in pairs],
                      "ref_grad_norms": [b["grad_norm"] for _, b in pairs]}
        print(f"[{stage}] {label:22s} vs {ref_name}: rel. err loss {err_loss:.1e} "
              f"(tol {tol[0]:.0e}), grad norm {err_norm:.1e} (tol {tol[1]:.0e}) "
              f"{'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            bad.append(label)
    if bad:
        why = f"; {str(failure).splitlines()[0]}" if failure else ""
        raise CheckError(f"{stage} out of tolerance or not finished: {', '.join(bad)}{why}", out)
    return out


# ---------------------------------------------------------------- resume stage
def resume(args, env, log_dir) -> dict:
    """A run stopped at iteration 2 (--exit-interval saves on the way out) and resumed
    from that checkpoint must continue as the run that never stopped: with full ZeRO++
    and qgZ error feedback on the same layout (each rank's residuals restored), and
    with plain ZeRO-3 resharded onto the most model-parallel split of the G ranks.
    fp32; iterations 3 and 4 compared within TOL["fp32"]."""
    g, m, iters, stop = args.gpus, NUMERICS_MODEL, 4, 2
    base = model_argv(m, 32) + ["--micro-batch-size", "2", "--global-batch-size", str(4 * g),
                                "--train-iters", str(iters), "--lr", "3e-3", "--seed", "7",
                                "--data-cache-path", os.path.join(log_dir, "data"), "--zero-stage", "3"]
    hpz = max(1, g // 2)
    zpp = (["--gpus-per-node", str(hpz)] + bench_variants(hpz)["ZeRO++"]
           + ["--zero-gradient-error-feedback"])
    tp, pp, _ = layouts(g, m)[0]
    split = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    ck = {k: os.path.join(log_dir, f"resume_ckpt_{k}") for k in ("zeropp", "zero3")}
    for d in ck.values():
        shutil.rmtree(d, ignore_errors=True)
    stop_at = ["--exit-interval", str(stop), "--save"]
    runs = {"zeropp_straight": base + zpp,
            "zeropp_first": base + zpp + stop_at + [ck["zeropp"]],
            "zeropp_resumed": base + zpp + ["--load", ck["zeropp"]],
            "zero3_straight": base,
            "zero3_first": base + stop_at + [ck["zero3"]],
            f"zero3_resumed_tp{tp}_pp{pp}": base + split + ["--load", ck["zero3"]]}
    mf = lambda label: os.path.join(log_dir, f"resume_{label}.jsonl")  # noqa: E731
    for label in runs:
        if os.path.exists(mf(label)):
            os.remove(mf(label))
    failure = None
    try:
        launch({"device": args.device, "entries": [{"argv": a + ["--metrics-file", mf(k)], "label": k}
                                                   for k, a in runs.items()]},
               g, env, log_dir, "resume", args.timeout)
    except CheckError as e:
        failure = e
    straight = {k: read_train_lines(mf(k)) if os.path.exists(mf(k)) else []
                for k in ("zeropp_straight", "zero3_straight")}
    pairs = {"zeropp_resumed": (mf("zeropp_resumed"), "zeropp_straight", straight["zeropp_straight"], TOL["fp32"]),
             f"zero3_resumed_tp{tp}_pp{pp}": (mf(f"zero3_resumed_tp{tp}_pp{pp}"), "zero3_straight",
                                             straight["zero3_straight"], TOL["fp32"])}
    return compare_runs("resume", pairs, range(stop + 1, iters + 1), failure)


# ---------------------------------------------------------------- stages 2 + 3
def bench_plan(args, log_dir) -> tuple[dict, dict[str, str], dict[str, str]]:
    """The bench launch: the split-link probe, then each variant for warmup + steps
    iterations; with --comm-time each variant once more for warmup + 1 iterations with
    --log-comm-time (milliseconds per phase; collectives synchronous there)."""
    m = MODELS[args.model]
    per_node = max(1, args.gpus // 2)
    iters = args.warmup + args.steps
    base = model_argv(m, args.seq_length) + [
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.micro_batch_size * args.gpus),
        "--train-iters", str(iters), "--lr", "1e-4", "--gpus-per-node", str(per_node),
        "--data-cache-path", os.path.join(log_dir, "data")]
    if args.device == "cuda":
        base.append("--bf16")
    files, timed_files, entries = {}, {}, [{"probe": "split", "mib": args.probe_mib}]
    timed = []  # after every plain run, so the step times are taken first
    for name, flags in bench_variants(per_node, tuple(args.qgz_chunks)).items():
        stem = os.path.join(log_dir, f"bench_{re.sub(r'[^A-Za-z0-9]+', '_', name)}")
        files[name], timed_files[name] = stem + ".jsonl", stem + "_comm_time.jsonl"
        for f in (files[name], timed_files[name]):
            if os.path.exists(f):
                os.remove(f)
        entries.append({"label": name, "argv": base + ["--zero-stage", "3"] + flags
                        + ["--metrics-file", files[name]]})
        if args.comm_time:  # one more iteration after the warm-up, collectives timed
            argv = base + ["--zero-stage", "3"] + flags + ["--metrics-file", timed_files[name],
                                                           "--log-comm-time"]
            argv[argv.index("--train-iters") + 1] = str(args.warmup + 1)
            timed.append({"label": f"{name} (comm timed)", "argv": argv})
    plan = {"device": args.device, "split_hosts": per_node, "entries": entries + timed}
    return plan, files, (timed_files if args.comm_time else {})


def nccl_env(log_dir: str) -> dict:
    for old in glob.glob(os.path.join(log_dir, "nccl.*.log")):
        os.remove(old)
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
            "NCCL_DEBUG_FILE": os.path.join(log_dir, "nccl.%h.%p.log"),
            # no InfiniBand here: the cross-half traffic must take the socket transport
            "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
            "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo")}


CHANNEL = re.compile(r"Channel (\d+)/\d+ : (\d+)\[([0-9a-fA-F]+)\] -> (\d+)\[([0-9a-fA-F]+)\]"
                     r"(?: \[(send|receive)\])? via (\S+)")
# "... rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 ... Init COMPLETE": some NCCL
# versions name a channel's GPUs by bus id, others by device index
BUS = re.compile(r"nvmlDev (\d+) busId ([0-9a-fA-F]+)")


def transport_lines(log_dir: str, per_node: int) -> dict:
    """NCCL INFO lines saying which transport each channel took; checks the split:
    channels between GPUs of different halves must be NET, inside a half must not."""
    text = []
    for path in sorted(glob.glob(os.path.join(log_dir, "nccl.*.log"))):
        text += open(path, errors="replace").read().splitlines()
    dev_of = {bus.lower().lstrip("0") or "0": int(dev)
              for dev, bus in (m.groups() for m in map(BUS.search, text) if m)}

    def device(tag: str) -> int | None:
        t = tag.lower().lstrip("0") or "0"
        return dev_of[t] if t in dev_of else int(tag) if tag.isdigit() else None

    lines, checked, wrong = [], 0, []
    for line in text:
        mt = CHANNEL.search(line)
        if mt or "Using network" in line or ("NET/" in line and ("Using" in line or "Socket" in line)):
            lines.append(line.rstrip())
        a, b = (device(mt.group(3)), device(mt.group(5))) if mt else (None, None)
        if a is None or b is None:
            continue
        via = mt.group(7)
        cross = a // per_node != b // per_node
        checked += 1
        if cross != via.startswith("NET"):
            wrong.append(line.strip())
    uniq = sorted(set(x.split("NCCL INFO ", 1)[-1] for x in lines))
    return {"lines": uniq, "channels_checked": checked, "wrong": wrong}


def summarize(files: dict[str, str], warmup: int, timed_files: dict[str, str] | None = None) -> list[dict]:
    rows, base_ms = [], None
    for name, path in files.items():
        recs = read_train_lines(path)
        timed = recs[warmup:] or recs[-1:]
        ms = statistics.median(r["elapsed_ms"] for r in timed)
        comm = timed[-1]["comm"]
        phases = {p: comm.get(p, {"intra_node": 0.0, "inter_node": 0.0}) for p in PHASES}
        row = {"variant": name, "step_ms": ms, "step_ms_all": [r["elapsed_ms"] for r in recs],
               "timed_iterations": [r["iteration"] for r in timed], "comm": comm,
               "inter_node_bytes": sum(v["inter_node"] for v in comm.values()),
               "intra_node_bytes": sum(v["intra_node"] for v in comm.values()),
               "phases": phases, "lm_loss": [r["lm_loss"] for r in recs],
               "nodes": timed[-1]["nodes"], "world_size": timed[-1]["world_size"],
               "zero_model_bytes": timed[-1].get("zero_model_bytes")}
        if name == "ZeRO-3":
            base_ms = ms
        row["speedup_vs_zero3"] = base_ms / ms if base_ms else None
        timed_path = (timed_files or {}).get(name)
        timed_recs = read_train_lines(timed_path) if timed_path and os.path.exists(timed_path) else []
        if timed_recs and "comm_time_ms" in timed_recs[-1]:  # the iteration after the warm-up
            row["comm_time_ms"] = timed_recs[-1]["comm_time_ms"]
            row["comm_timed_step_ms"] = timed_recs[-1]["elapsed_ms"]
        rows.append(row)
    return rows


def fmt_bytes(b: float) -> str:
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= s:
            return f"{b / s:.2f} {unit}"
    return f"{b:.0f} B"


def table(rows: list[dict]) -> str:
    head = ("| variant | step ms (median) | speedup vs ZeRO-3 | " +
            " | ".join(f"{p} intra / inter" for p in PHASES) + " | inter-node total |")
    out = [head, "|" + "---|" * (4 + len(PHASES))]
    for r in rows:
        cells = [f"{fmt_bytes(r['phases'][p]['intra_node'])} / {fmt_bytes(r['phases'][p]['inter_node'])}"
                 for p in PHASES]
        speedup = "n/a" if r["speedup_vs_zero3"] is None else f"{r['speedup_vs_zero3']:.2f}x"
        out.append(f"| {r['variant']} | {r['step_ms']:.1f} | {speedup} | "
                   + " | ".join(cells) + f" | {fmt_bytes(r['inter_node_bytes'])} |")
    return "\n".join(out)


def time_table(rows: list[dict]) -> str:
    """Milliseconds per iteration in each phase's collectives (from --log-comm-time runs)."""
    head = ("| variant | step ms, collectives synchronous | " + " | ".join(f"{p} ms" for p in PHASES)
            + " | other phases ms | communication total ms |")
    out = [head, "|" + "---|" * (4 + len(PHASES))]
    for r in rows:
        t = r["comm_time_ms"]
        other = sum(v for p, v in t.items() if p not in PHASES)
        out.append(f"| {r['variant']} | {r['comm_timed_step_ms']:.1f} | "
                   + " | ".join(f"{t.get(p, 0.0):.1f}" for p in PHASES)
                   + f" | {other:.1f} | {sum(t.values()):.1f} |")
    return "\n".join(out)


def bench(args, env: dict, log_dir: str, record: dict) -> None:
    """Stages 2 + 3: link probes, the 2-"node" bench run, NCCL's transport lines."""
    if args.device == "cuda":  # the same probe without the split: what the halves lose
        probe_plan = {"device": args.device, "entries": [{"probe": "one-host",
                                                          "mib": args.probe_mib}]}
        launch(probe_plan, args.gpus, env, log_dir, "probe_one_host", args.timeout)
    plan, files, timed_files = bench_plan(args, log_dir)
    failure = None
    try:
        launch(plan, args.gpus, {**env, **nccl_env(log_dir)}, log_dir, "bench", args.timeout)
    except CheckError as e:  # keep what the variants that finished measured
        failure = e
    record["link_probe"], record["peak_memory"] = [], []
    for name in ("probe_one_host", "bench"):
        out = os.path.join(log_dir, f"{name}.plan.json.out.json")
        if os.path.exists(out):
            done = json.load(open(out))
            record["link_probe"] += [r for r in done if "probe" in r]
            record["peak_memory"] += [r for r in done if "label" in r]
    finished = {k: v for k, v in files.items() if os.path.exists(v) and read_train_lines(v)}
    if finished:
        record["bench"] = summarize(finished, args.warmup, timed_files)
    if args.device == "cuda":
        tl = transport_lines(log_dir, max(1, args.gpus // 2))
        record["nccl_transport"] = tl
        print("[transport] NCCL INFO lines (INIT,NET), deduplicated:", flush=True)
        for line in tl["lines"]:
            print("   " + line, flush=True)
        print(f"[transport] {tl['channels_checked']} channel lines checked, "
              f"{len(tl['wrong'])} on the wrong transport", flush=True)
        if tl["channels_checked"] == 0 or tl["wrong"]:
            record["errors"]["transport"] = (
                "no channel lines in NCCL's log" if not tl["channels_checked"]
                else f"{len(tl['wrong'])} channels on the wrong transport: {tl['wrong'][:3]}")
    if failure is not None:
        raise failure


# ----------------------------------------------------------------------- worker
def probe_link(mib: int, device: str, per_node: int) -> dict:
    """Timed all-gather over the world group (through megaq.parallel.comm)."""
    import torch
    import torch.distributed as dist
    from megaq.parallel import comm
    world = dist.get_world_size()
    group = comm.Group.create(list(range(world)), lambda r: r // per_node, world=True)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu"
    n = mib * 2 ** 20 // 2
    shard = torch.ones(n // world, dtype=torch.bfloat16, device=dev)
    full = torch.empty(shard.numel() * world, dtype=torch.bfloat16, device=dev)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(4):
        comm.barrier(group)
        sync()
        t0 = time.perf_counter()
        comm.all_gather(full, shard, group, "probe")
        sync()
        times.append(time.perf_counter() - t0)
    t = min(times[1:])
    return {"bytes": full.numel() * 2, "seconds": t,
            "busbw_GBps": full.numel() * 2 * (world - 1) / world / t / 1e9}


def worker(plan_path: str) -> int:
    with open(plan_path) as f:
        plan = json.load(f)
    assert all(os.environ.get(k) == v for k, v in NO_MULTICAST.items()), "multicast env not set"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    split = plan.get("split_hosts")
    if split:  # each half of the host is its own "host" to NCCL: NET between halves
        os.environ["NCCL_HOSTID"] = f"megaq-half{local // split}"
    import torch
    from megaq import pretrain
    from megaq.parallel.launch import init_from_env
    device = plan["device"]
    init_from_env("nccl" if device == "cuda" else "gloo")
    rank = int(os.environ.get("RANK", "0"))
    import gc
    results = []
    for e in plan["entries"]:
        if "probe" in e:
            r = probe_link(e["mib"], device, split or 1)
            if rank == 0:
                print(f"[probe] all-gather {r['bytes'] / 2 ** 20:.0f} MiB: "
                      f"{r['seconds'] * 1e3:.1f} ms, bus bandwidth {r['busbw_GBps']:.2f} GB/s",
                      flush=True)
                results.append({"probe": e["probe"], **r})
            continue
        if rank == 0:
            print(f"[worker] === {e['label']} ===", flush=True)
        pretrain.main(e["argv"])
        gc.collect()
        if device == "cuda":
            if rank == 0:
                results.append({"label": e["label"],
                                "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30})
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    if rank == 0:
        with open(plan_path + ".out.json", "w") as f:
            json.dump(results, f)
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------- main
def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="cuda: one rank per GPU over nccl; cpu: gloo ranks (auto: cuda if any GPU)")
    p.add_argument("--gpus", type=int, default=None,
                   help="ranks G (default: every GPU; on cpu 2); even, to pose as 2 nodes")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="bench model (default 1b on cuda, tiny on cpu)")
    p.add_argument("--steps", type=int, default=4, help="timed bench iterations per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed bench iterations first")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default 2 (cuda), 1 (cpu)")
    p.add_argument("--seq-length", type=int, default=None, help="default 1024 (cuda), 32 (cpu)")
    p.add_argument("--probe-mib", type=int, default=None, help="link probe size (256 cuda, 4 cpu)")
    p.add_argument("--stages", default="numerics,resume,bench",
                   help="comma list of numerics, resume, bench (bench includes the transport check)")
    p.add_argument("--log-dir", default=None, help="logs and metrics (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the JSON record here")
    p.add_argument("--timeout", type=float, default=900, help="seconds per torchrun launch")
    p.add_argument("--qgz-chunks", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                   help="bench: also run ZeRO++ with each of these qgZ chunk sizes (elements of a "
                        "rank's shard per chunk, comma-separated, e.g. 4194304,16777216)")
    p.add_argument("--comm-time", action=argparse.BooleanOptionalAction, default=True,
                   help="bench: run each variant once more (warmup + 1 iterations) with "
                        "--log-comm-time and report milliseconds per phase (default: on)")
    a = p.parse_args(argv)
    if a.device == "auto":
        import torch
        a.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    if a.gpus is None:
        if a.device == "cuda":
            import torch
            a.gpus = torch.cuda.device_count()
        else:
            a.gpus = 2
    if a.gpus < 2 or a.gpus % 2:
        p.error(f"--gpus {a.gpus}: need an even count >= 2 to pose as 2 nodes")
    if a.device == "cuda":
        import torch
        if torch.cuda.device_count() < a.gpus:
            p.error(f"--gpus {a.gpus} but only {torch.cuda.device_count()} GPUs are visible; "
                    f"lower --gpus or use --device cpu")
    cuda = a.device == "cuda"
    a.model = a.model or ("1b" if cuda else "tiny")
    a.micro_batch_size = a.micro_batch_size or (2 if cuda else 1)
    a.seq_length = a.seq_length or (1024 if cuda else 32)
    a.probe_mib = a.probe_mib or (256 if cuda else 4)
    a.stages = [s for s in a.stages.split(",") if s]
    for s in a.stages:
        if s not in ("numerics", "resume", "bench"):
            p.error(f"--stages: unknown stage {s!r}; use numerics, resume and/or bench")
    return a


def write_json(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        wp = argparse.ArgumentParser()
        wp.add_argument("--plan", required=True)
        return worker(wp.parse_args(argv[1:]).plan)
    args = parse(argv)
    os.environ.update(NO_MULTICAST)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs launch()'s cleanup
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="multigpu_check.")
    os.makedirs(log_dir, exist_ok=True)
    env = child_env(args.device, args.gpus)
    record = {"device": args.device, "ranks": args.gpus, "model": args.model,
              "model_shape": MODELS[args.model], "micro_batch_size": args.micro_batch_size,
              "seq_length": args.seq_length, "warmup": args.warmup, "steps": args.steps,
              "command": " ".join([os.path.relpath(__file__, REPO)] + list(argv)),
              "env": {k: env.get(k) for k in NO_MULTICAST}, "errors": {},
              "comm_time": ("bench rows' comm_time_ms: one more iteration per variant with "
                            "--log-comm-time (collectives synchronous, ms per iteration)"
                            if args.comm_time else "not measured (--no-comm-time)")}
    if args.device == "cuda":
        import torch
        record["gpu"] = torch.cuda.get_device_name(0)
        record["torch"] = torch.__version__
        v = torch.cuda.nccl.version()
        record["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    stages = {"numerics": lambda: record.update(numerics=numerics(args, env, log_dir)),
              "resume": lambda: record.update(resume=resume(args, env, log_dir)),
              "bench": lambda: bench(args, env, log_dir, record)}
    for stage in args.stages:  # in the order given; the record is rewritten after each
        try:
            stages[stage]()
        except CheckError as e:
            record["errors"][stage] = str(e.args[0])
            if len(e.args) > 1:
                record[stage] = e.args[1]
            print(f"[{stage}] FAILED: {e.args[0]}", flush=True)
        if args.out:
            write_json(args.out, record)
    rows = record.get("bench", [])
    if args.out:
        write_json(args.out, record)
        print(f"[multigpu_check] wrote {args.out}", flush=True)
    for p in record.get("link_probe", []):
        print(f"link probe ({p['probe']}): all-gather of {p['bytes'] / 2 ** 20:.0f} MiB over "
              f"{args.gpus} ranks: {p['busbw_GBps']:.2f} GB/s bus bandwidth", flush=True)
    if record["errors"]:
        print("errors: " + "; ".join(f"{k}: {v.splitlines()[0]}" for k, v in record["errors"].items()),
              flush=True)
    if rows:
        timed_rows = [r for r in rows if "comm_time_ms" in r]
        if timed_rows:
            print("\ncommunication time per iteration: one more iteration per variant with "
                  "--log-comm-time (each collective between two device synchronizations: no "
                  "overlap, so these steps are slower than the ones below)", flush=True)
            print(time_table(timed_rows), flush=True)
        print(f"\nZeRO-3 vs ZeRO++: {args.gpus} {args.device} ranks as 2 nodes x {args.gpus // 2}, "
              f"model {args.model}, micro-batch {args.micro_batch_size} x seq {args.seq_length}; "
              f"bytes per node per iteration", flush=True)
        if args.gpus // 2 == 1:
            print("note: one rank per node, so the hpZ partition (in-node) has size 1: "
                  "qwZ+hpZ runs as qwZ and ZeRO++ as qwZ+qgZ", flush=True)
        print(table(rows), flush=True)
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
