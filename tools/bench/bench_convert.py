#!/usr/bin/env python
"""Time and peak memory of tools/convert_checkpoint.py on the 1.3B benchmark model (CPU).

    nice -n 10 python tools/bench/bench_convert.py --workdir /tmp/bench_convert --tp 2 --pp 2

1. writes a random-weight transformers Llama directory of tools/bench/bench_train.py's 1.3B
   shape (24 layers, hidden 2048, 16 heads, SwiGLU 5440, vocab 32000, untied), fp32;
2. imports it into a megaq checkpoint at TP x PP (`--from hf --to megaq`);
3. exports that checkpoint back (`--to hf`) in each --dtypes.

Each conversion runs as its own process; this one samples its /proc status every 20 ms:
peak anonymous memory (RssAnon: what the process allocated) and peak resident set
(VmHWM, which also counts pages of the memory-mapped checkpoint it has touched; those
are file cache the kernel can drop). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import torch

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
REPO = _checkout.ROOT


def _bench_train():
    spec = importlib.util.spec_from_file_location("bench_train", os.path.join(REPO, "tools", "bench",
                                                                             "bench_train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_random_hf(out_dir: str, config) -> int:
    """A LlamaForCausalLM directory with N(0, 0.02) weights; returns the largest tensor's bytes."""
    from megaq.interop.common import megaq_layout, write_json
    from megaq.interop.hf import MAPPINGS, SafetensorsWriter, hf_config
    os.makedirs(out_dir, exist_ok=True)
    mapping = MAPPINGS["llama"](config, config.vocab_size)
    writer = SafetensorsWriter(out_dir, 2 * 2**30)
    g = torch.Generator().manual_seed(0)
    largest = 0
    h, f = config.hidden_size, config.ffn_hidden_size
    qkv = (config.num_attention_heads + 2 * config.num_query_groups) * config.kv_channels
    shapes = {"embedding.word_embeddings.weight": (config.vocab_size, h),
              "output_layer.weight": (config.vocab_size, h),
              "self_attention.linear_qkv.weight": (qkv, h),
              "self_attention.linear_proj.weight": (h, config.num_attention_heads * config.kv_channels),
              "mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f)}
    for info in megaq_layout(config, 1, 1):
        rest = info.name.split(".", 2)[2] if info.name.startswith("layers.") else info.name
        shape = shapes.get(rest, (h,))
        t = torch.empty(shape).normal_(0.0, 0.02, generator=g) if len(shape) > 1 else torch.ones(shape)
        for name, part in mapping.to_hf(info.name, t):
            writer.add(name, part.contiguous())
            largest = max(largest, part.numel() * part.element_size())
    writer.close()
    write_json(os.path.join(out_dir, "config.json"),
                hf_config(config, "llama", config.vocab_size, torch.float32, {}))
    return largest


def measure(cmd: list[str]) -> dict:
    """Run cmd; wall seconds, peak RssAnon and VmHWM (bytes) of the process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peak = {"RssAnon": 0, "VmHWM": 0}

    def poll():
        path = f"/proc/{proc.pid}/status"
        while proc.poll() is None:
            try:
                for line in open(path):
                    key = line.split(":")[0]
                    if key in peak:
                        peak[key] = max(peak[key], int(line.split()[1]) * 1024)
            except OSError:
                return
            time.sleep(0.02)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    out, _ = proc.communicate()
    th.join()
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed ({proc.returncode}):\n{out}")
    return {"seconds": time.perf_counter() - t0, "peak_anon_bytes": peak["RssAnon"],
            "peak_rss_bytes": peak["VmHWM"],
            "output": next((line for line in out.splitlines() if line.startswith("[convert]")), "")}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="scratch space (~3x the model in fp32)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dtypes", nargs="*", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    p.add_argument("--output-json", default=os.path.join(REPO, "docs", "results",
                                                         "convert_1p3b_cpu.json"))
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    a = p.parse_args(argv)
    config = _bench_train().megaq_config("1.3B")  # shapes only; weights written fp32
    shutil.rmtree(a.workdir, ignore_errors=True)
    hf_dir, mq_dir = os.path.join(a.workdir, "hf_random"), os.path.join(a.workdir, "megaq")
    t0 = time.perf_counter()
    largest = write_random_hf(hf_dir, config)
    params = _dir_bytes(hf_dir) // 4
    print(f"[bench_convert] random 1.3B Llama ({params / 1e9:.2f}B params, fp32 "
          f"{_dir_bytes(hf_dir) / 2**30:.2f} GiB) written in {time.perf_counter() - t0:.0f} s", flush=True)
    tool = [sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py")]
    rows = []
    r = measure(tool + ["--from", "hf", "--to", "megaq", "--input", hf_dir, "--output", mq_dir,
                        "--tensor-model-parallel-size", str(a.tp),
                        "--pipeline-model-parallel-size", str(a.pp)])
    rows.append({"step": f"import hf -> megaq TP={a.tp} x PP={a.pp}", **r,
                 "output_bytes": _dir_bytes(mq_dir)})
    for dt in a.dtypes:
        out = os.path.join(a.workdir, f"hf_{dt}")
        r = measure(tool + ["--to", "hf", "--input", mq_dir, "--output", out, "--dtype", dt])
        rows.append({"step": f"export megaq TP={a.tp} x PP={a.pp} -> hf {dt}", **r,
                     "output_bytes": _dir_bytes(out)})
        shutil.rmtree(out, ignore_errors=True)
    print("\n| step | seconds | peak anon memory (GiB) | peak RSS incl. mmapped file (GiB) | "
          "output (GiB) |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['step']} | {row['seconds']:.1f} | {row['peak_anon_bytes'] / 2**30:.2f} | "
              f"{row['peak_rss_bytes'] / 2**30:.2f} | {row['output_bytes'] / 2**30:.2f} |")
    print(f"largest tensor: {largest / 2**20:.0f} MiB (fp32 embedding / head); model "
          f"{params * 4 / 2**30:.2f} GiB fp32")
    os.makedirs(os.path.dirname(a.output_json), exist_ok=True)
    with open(a.output_json, "w") as f:
        json.dump({"model": "1.3B (tools/bench/bench_train.py shape)", "params": params,
                   "largest_tensor_bytes": largest, "cpu_count": os.cpu_count(),
                   "load_average_at_end": os.getloadavg(), "rows": rows}, f, indent=2)
    print(f"[bench_convert] wrote {a.output_json}")
    if not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
