"""FP8 training steps on one GPU under TP and ZeRO-3: do all layouts train alike?

Gloo ranks forked on one machine all put their tensors on the same GPU (cuda:0), so
TP and ZeRO-3 run with real FP8 GEMMs (torch._scaled_mm) while their collectives go
through gloo. A small Llama (bf16 weights, fp32 masters, FP8 block GEMMs) trains a
few steps on fixed batches as TP=1 and TP=2 under the ZeRO-3 engine; the losses are
compared with TP=1's. With the tensorwise recipe each layout also runs with FP8 weight
gathers (``--zero-quantized-weights fp8``: the engine casts the weights once per step and
the GEMMs read the gathered E4M3 weights); those losses are compared with the same
layout's bf16-gather run, which they should equal (the same casts of the same values:
docs/ZEROPP.md "FP8 weight gathers"). Gloo moves CUDA tensors for all-reduce, broadcast and
all-gather but has no CUDA send/recv, which megaq's gloo reduce-scatter (a ring of
send/recv) needs: sequence parallelism and DP > 1 cannot run this way on one GPU
(the CPU tests, tests/test_fp8.py, cover those layouts).

    python tools/bench/check_fp8_gpu.py --out fp8_tp_zero3.json

Run it in its own process: the ranks are forked, so the parent must not have touched
CUDA yet.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

LAYOUTS = [(1, 1), (2, 1)]  # (tp, dp)


def _steps(topo, fp8_format, fp8_recipe, steps, device, fp8_gathers=False):
    from megaq.model import GPTConfig
    from megaq.parallelize import parallelize
    from megaq.zero import OptimizerSettings, ZeroConfig

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cfg = GPTConfig.llama(num_layers=2, hidden_size=512, num_attention_heads=8, vocab_size=4096,
                          seq_length=512, params_dtype=torch.bfloat16,
                          fp8_format=fp8_format, fp8_recipe=fp8_recipe)
    (model,), engine = parallelize(cfg, topo, ZeroConfig(stage=3, gather_dtype=torch.bfloat16,
                                                        fp8_weights=fp8_gathers),
                                   optimizer=OptimizerSettings(lr=1e-3, adam_beta2=0.95,
                                                               weight_decay=0.1), device=dev)
    # the same global batch of 4 samples at every layout: DP ranks take their share
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 4096, (2, 4, 513), generator=g)
    dp, dp_rank = topo.dp.size, topo.dp_rank
    losses = []
    for i in range(steps):
        batch = data[i % 2].chunk(dp)[dp_rank].to(dev)
        engine.zero_grad()
        loss = model(batch[:, :-1], labels=batch[:, 1:]).float().mean()
        loss.backward()
        engine.finish_grad_sync()
        engine.clip_grad_norm(1.0)
        engine.step(1e-3)
        total = loss.detach().clone()
        if dp > 1:  # the global mean over DP ranks, for the comparison
            from megaq.parallel import comm
            comm.all_reduce(total, topo.dp, "dp")
            total /= dp
        losses.append(float(total))
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda:0", help="cpu: a quick dry run of the script itself")
    args = p.parse_args(argv)
    from megaq.testing.ranks import run_on_ranks

    report = {"steps": args.steps, "results": {}}
    runs = [("hybrid", "tensorwise", False), ("hybrid", "tensorwise", True), ("e4m3", "rowwise", False)]
    by_layout = {}  # (tp, dp) -> losses of the tensorwise run with bf16 gathers
    for fmt, recipe, gathers in runs:
        base = None
        for tp, dp in LAYOUTS:
            key = f"{fmt}-{recipe} tp{tp} dp{dp} zero3" + (" fp8-gathers" if gathers else "")
            try:
                losses = run_on_ranks(_steps, tp * dp, tp=tp,
                                      args=(fmt, recipe, args.steps, args.device, gathers))[0]
            except Exception as e:  # noqa: BLE001 - report and go on with the other layouts
                report["results"][key] = {"error": f"{type(e).__name__}: {e}"[-800:]}
                print(f"{key}: FAILED {report['results'][key]['error']}", flush=True)
                continue
            base = base or losses
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, base))
            row = report["results"][key] = {"losses": losses, "max_rel_diff_vs_tp1": diff}
            line = f"{key}: losses " + " ".join(f"{x:.4f}" for x in losses) + f"  max rel diff vs TP=1 {diff:.1e}"
            if recipe == "tensorwise" and not gathers:
                by_layout[(tp, dp)] = losses
            elif gathers and (tp, dp) in by_layout:
                ref = by_layout[(tp, dp)]
                row["max_rel_diff_vs_bf16_gathers"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
                row["bit_identical_to_bf16_gathers"] = losses == ref
                line += (f"  vs bf16 gathers: max rel diff {row['max_rel_diff_vs_bf16_gathers']:.1e}"
                         f" (bit-identical: {losses == ref})")
            print(line, flush=True)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
