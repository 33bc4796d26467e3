"""Checkpoint benchmark on CPU gloo ranks: --ckpt-format torch against torch_dist, same run.

For each DP size (TP = PP = 1, ZeRO-3) it builds the model and its engine on DP ranks
(no training step: the state's values do not change the costs) and times, per format:

  torch        engine.full_state() gathered on every rank, DP rank 0 writes it (today's)
  torch_dist   every rank writes its own shard through torch.distributed.checkpoint
  async        torch_dist with --async-save: the time training is blocked (staging the
               shard into CPU memory), then the background write until committed

and the load of what was just saved (into the same engine), and (rank 0) the time to read
the torch_dist index (.metadata) with torch's reader (plain pickle) and with megaq's
(megaq.checkpoint.safe_unpickle), interleaved in the same process. Reported per rank: save
and load seconds (the slowest rank: saves and loads are collective), bytes written,
and peak host memory added during the save and during the load (VmHWM after the
phase minus VmRSS before it, the high-water mark reset through /proc/self/clear_refs;
glibc's mmap threshold fixed at 64 KiB so that freed tensors leave RSS), and the bytes
--async-save staged.

    nice python tools/bench/bench_checkpoint.py --dp 1 2 4 8 --json docs/results/bench_checkpoint_cpu.json
    python tools/bench/bench_checkpoint.py --dp 1 2 --layers 2 --hidden 256   # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

FORMATS = ("torch", "torch_dist", "async")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRSS:
    """Bytes of host memory a phase adds at its peak (VmHWM after - VmRSS before)."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:  # no /proc (not Linux): the peak then counts from process start
            pass
        self.before = _status_kb("VmRSS")
        return self

    def __exit__(self, *exc):
        self.added = max(0, _status_kb("VmHWM") - self.before) * 1024


def _written_by(ckpt_dir: str, fmt: str, rank: int, dp_rank: int) -> int:
    """Bytes of the files rank `rank` wrote into a checkpoint directory."""
    from megaq.checkpoint import dcp_format
    from megaq.checkpoint.paths import common_file, model_file, rng_file
    files = [rng_file(ckpt_dir, rank)]
    if fmt == "torch":
        files += [model_file(ckpt_dir, 0, 0)] if dp_rank == 0 else []
    else:
        files += [os.path.join(ckpt_dir, n) for n in os.listdir(ckpt_dir)
                  if n.startswith(f"__{rank}_")]
        if rank == 0:
            files += [common_file(ckpt_dir), os.path.join(ckpt_dir, dcp_format.METADATA_FILE)]
    return sum(os.path.getsize(f) for f in files if os.path.isfile(f))


def _exact_malloc() -> None:
    """glibc serves large blocks from mmap only above a threshold that grows after each
    free (up to 32 MiB), and keeps freed heap memory resident: a later phase would reuse
    it without raising RSS. A fixed 64 KiB threshold makes every large tensor its own
    mapping, returned on free, so each phase's peak RSS counts what it allocates."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 64 * 1024)


def _bench_rank(topo, argv, work, formats=FORMATS):
    import torch

    from megaq.config.arguments import parse_config
    from megaq.checkpoint import staging
    from megaq.checkpoint.load import load_checkpoint
    from megaq.checkpoint.paths import iteration_dir
    from megaq.checkpoint.save import save_checkpoint
    from megaq.lr_schedule import LRSchedule
    from megaq.parallel import comm
    from megaq.parallelize import parallelize

    _exact_malloc()
    torch.manual_seed(0)
    config = parse_config(argv, world_size=topo.layout.world_size)
    config = config.resolved(config.data, config.data.vocab_size)
    chunks, engine = parallelize(config.model, topo, config.zero, optimizer=config.optimizer,
                                 vp_size=config.virtual_pipeline_size)
    schedule = LRSchedule.from_config(config.optimizer, unit=config.training.schedule_unit)
    params = sum(p.numel() for c in chunks for p in c.parameters())
    out = {"rank": topo.rank, "params": params, "formats": {}}
    for fmt in formats:
        cp = dataclasses.replace(config.checkpointing,
                                 ckpt_format="torch" if fmt == "torch" else "torch_dist",
                                 async_save=fmt == "async")
        cfg = dataclasses.replace(config, checkpointing=cp)
        root = os.path.join(work, fmt)
        comm.barrier(topo.world)
        with PeakRSS() as save_mem:
            t0 = time.perf_counter()
            save_checkpoint(root, 1, config=cfg, topo=topo, engine=engine,
                                 lr_schedule=schedule, consumed_samples=0)
            blocked = time.perf_counter() - t0
            staging.wait_for_async_save()
            saved = time.perf_counter() - t0
        comm.barrier(topo.world)
        written = _written_by(iteration_dir(root, 1), fmt, topo.rank, topo.dp_rank)
        with PeakRSS() as load_mem:
            t0 = time.perf_counter()
            load_checkpoint(root, config=cfg, topo=topo, engine=engine, lr_schedule=schedule,
                                 model_chunks=chunks)
            loaded = time.perf_counter() - t0
        comm.barrier(topo.world)
        if topo.rank == 0 and fmt == "torch_dist":
            out["index"] = _time_index(iteration_dir(root, 1))
        if topo.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        out["formats"][fmt] = {"save_s": saved, "blocked_s": blocked, "load_s": loaded,
                               "bytes_written": written, "save_peak_bytes": save_mem.added,
                               "load_peak_bytes": load_mem.added,
                               "staged_bytes": staging.HOST_BYTES.peak}
        staging.HOST_BYTES.reset()
    return out


def _time_index(ckpt_dir: str, repeats: int = 25) -> dict:
    """Reading the DCP index (.metadata) as torch's FileSystemReader does (plain
    pickle) against megaq's reader (megaq.checkpoint.safe_unpickle's allow-listed unpickler and the
    shape check), interleaved, same timer, no garbage collection inside a read: the
    fastest of `repeats` reads each (the file is in the page cache, so that is the
    unpickling's own cost on a loaded machine; the manifest check, the same in both,
    is left out)."""
    import torch.distributed.checkpoint as dcp

    from megaq.checkpoint import dcp_format, safe_unpickle
    path = os.path.join(ckpt_dir, dcp_format.METADATA_FILE)

    def safe():
        dcp_format._check_index(safe_unpickle.load(path, safe_unpickle.DCP_INDEX), path)
    times = {"plain": [], "safe": []}
    for _ in range(repeats):
        for name, read in (("plain", lambda: dcp.FileSystemReader(ckpt_dir).read_metadata()),
                           ("safe", safe)):
            # a collection of the whole heap (torch's objects: ~100 ms) would land on the
            # same read of every round: collect before, none during
            gc.collect()
            gc.disable()
            t0 = time.perf_counter()
            read()
            times[name].append(time.perf_counter() - t0)
            gc.enable()
    return {"bytes": os.path.getsize(path), "plain_s": min(times["plain"]),
            "safe_s": min(times["safe"])}


def summarise(dp: int, ranks: list[dict]) -> list[dict]:
    rows = []
    for fmt in ranks[0]["formats"]:
        per = [r["formats"][fmt] for r in ranks]
        rows.append({
            "dp": dp, "format": fmt, "params": ranks[0]["params"],
            "save_s": max(p["save_s"] for p in per), "blocked_s": max(p["blocked_s"] for p in per),
            "load_s": max(p["load_s"] for p in per),
            "bytes_written_max": max(p["bytes_written"] for p in per),
            "bytes_written_total": sum(p["bytes_written"] for p in per),
            "save_peak_max": max(p["save_peak_bytes"] for p in per),
            "save_peak_rank0": per[0]["save_peak_bytes"],
            "load_peak_max": max(p["load_peak_bytes"] for p in per),
            "per_rank": per})
        if fmt == "torch_dist" and "index" in ranks[0]:
            rows[-1]["index"] = ranks[0]["index"]
    return rows


def index_table(rows: list[dict]) -> str:
    """The DCP index read by megaq's allow-listed unpickler against plain pickle, and
    what the difference is of the whole torch_dist load (every rank reads the index)."""
    out = ["| DP | .metadata KiB | plain pickle ms | megaq reader ms | ratio | extra, % of the "
           "torch_dist load |", "|" + "---|" * 6]
    for r in rows:
        if "index" not in r:
            continue
        i = r["index"]
        out.append(f"| {r['dp']} | {i['bytes'] / 1024:.0f} | {1e3 * i['plain_s']:.2f} | "
                   f"{1e3 * i['safe_s']:.2f} | {i['safe_s'] / i['plain_s']:.2f} | "
                   f"{100 * (i['safe_s'] - i['plain_s']) / r['load_s']:.2f} |")
    return "\n".join(out) if len(out) > 2 else ""


def table(rows: list[dict]) -> str:
    head = ("| DP | format | save s | blocked s | load s | MiB written (max rank) | "
            "save peak MiB (max rank) | load peak MiB (max rank) |")
    out = [head, "|" + "---|" * 8]
    for r in rows:
        out.append(f"| {r['dp']} | {r['format']} | {r['save_s']:.2f} | {r['blocked_s']:.2f} | "
                   f"{r['load_s']:.2f} | {r['bytes_written_max'] / 2**20:.0f} | "
                   f"{r['save_peak_max'] / 2**20:.0f} | {r['load_peak_max'] / 2**20:.0f} |")
    return "\n".join(out)


# (model, parameters, GPUs, TP, PP): the layouts the projection prices
PROJECTED = [("7B", 7e9, 64, 1, 1), ("7B", 7e9, 512, 1, 1),
             ("70B", 70e9, 64, 8, 1), ("70B", 70e9, 512, 8, 4)]


def project(rows: list[dict]) -> list[dict]:
    """Save time, blocked time and host memory per rank for 7B / 70B at 64 / 512 GPUs,
    from this run's per-byte costs at DP = 1 (one writer, no contention): seconds per
    byte of a torch-format save (gather + serialise + write of the full slice), of a
    torch_dist save (its own shard), of --async-save's staging. Assumes the storage's
    aggregate bandwidth grows with the writers (a parallel filesystem, or node-local
    disks); `new_save_s_shared` instead caps all writers at the aggregate rate this
    machine reached at its largest DP."""
    by = {(r["dp"], r["format"]): r for r in rows}
    one = {f: by[(1, f)] for f in FORMATS}
    per_byte = {f: one[f]["save_s"] / one[f]["bytes_written_max"] for f in FORMATS}
    stage_per_byte = one["async"]["blocked_s"] / one["async"]["bytes_written_max"]
    top = max(r["dp"] for r in rows)
    agg = by[(top, "torch_dist")]
    agg_rate = agg["bytes_written_total"] / agg["save_s"]
    out = []
    for name, params, gpus, tp, pp in PROJECTED:
        dp = gpus // (tp * pp)
        slice_bytes = 12 * params / (tp * pp)   # fp32 master + 2 moments of a TP x PP slice
        shard = slice_bytes / dp                 # what one rank owns under ZeRO-3
        out.append({
            "model": name, "gpus": gpus, "tp": tp, "pp": pp, "dp": dp,
            "old_save_s": slice_bytes * per_byte["torch"],
            "old_peak_host_GB": slice_bytes / 1e9,
            "new_save_s": shard * per_byte["torch_dist"],
            "new_save_s_shared": 12 * params / agg_rate,
            "async_blocked_s": shard * stage_per_byte,
            "new_peak_host_GB": shard / 1e9})
    return out


def projection_table(proj: list[dict]) -> str:
    out = ["| model | GPUs | TP x PP x DP | torch save s | torch peak host GB/rank | "
           "torch_dist save s | (one shared disk) | async blocked s | "
           "torch_dist shard (async staging) GB/rank |", "|" + "---|" * 9]
    for p in proj:
        out.append(f"| {p['model']} | {p['gpus']} | {p['tp']} x {p['pp']} x {p['dp']} | "
                   f"{p['old_save_s']:.0f} | {p['old_peak_host_GB']:.1f} | "
                   f"{p['new_save_s']:.1f} | {p['new_save_s_shared']:.0f} | "
                   f"{p['async_blocked_s']:.2f} | {p['new_peak_host_GB']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--work", default=None, help="where checkpoints are written (default: a "
                   "temporary directory next to the system's)")
    p.add_argument("--json", default=None)
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS),
                   help="which to time (the projection needs all three)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no run: print the tables and projection of earlier runs' JSON files "
                        "(e.g. DP 1 2 4 and DP 8 run separately), and write them to --json")
    a = p.parse_args(argv)
    if a.merge:
        runs = [json.load(open(path)) for path in a.merge]
        rows = sorted((r for run in runs for r in run["rows"]), key=lambda r: r["dp"])
        a.dp = sorted({r["dp"] for r in rows})
        return _report(rows, runs[0]["argv"], a)
    from megaq.testing.ranks import run_on_ranks
    model = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
             "--num-attention-heads", str(a.heads), "--seq-length", "128",
             "--max-position-embeddings", "128", "--vocab-size", str(a.vocab), "--mock-data",
             "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4"]
    rows = []
    for dp in a.dp:
        if a.work:
            os.makedirs(a.work, exist_ok=True)
        work = tempfile.mkdtemp(prefix="megaq_bench_ckpt_", dir=a.work)
        try:
            ranks = run_on_ranks(_bench_rank, dp, args=(model, work, tuple(a.formats)),
                                 timeout=3600)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rows += summarise(dp, ranks)
        print(table([r for r in rows if r["dp"] == dp]), flush=True)
    return _report(rows, model, a)


def _report(rows: list[dict], model: list[str], a) -> int:
    params = rows[0]["params"]
    print(f"\n{params / 1e6:.1f}M parameters (fp32 masters + AdamW moments: "
          f"{12 * params / 2**20:.0f} MiB), CPU gloo ranks, {os.cpu_count()} cores\n")
    print(table(rows))
    if index_table(rows):
        print("\nreading the DCP index (rank 0; fastest of 25 reads each, interleaved):\n")
        print(index_table(rows))
    measured = {r["format"] for r in rows}
    proj = project(rows) if 1 in a.dp and measured == set(FORMATS) else []
    if proj:
        print("\nprojection from this run's per-byte costs at DP=1 (see project()):\n")
        print(projection_table(proj))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"params": params, "argv": model, "cpu_count": os.cpu_count(),
                       "rows": rows, "projection": proj}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
