"""Where qgZ's int4 error lands, on real gradients (issue 22's offline decomposition).

capture: train ZeRO-3 with tools/bench/convergence.py's setup (4 CPU ranks as 2 nodes x
2, bf16) and save every rank's full flat gradient of every unit at the given reduce
calls (one per iteration here: one micro-batch per rank and step).

analyze: replay qgZ's two hops on the saved gradients in float64 (scales not rounded to the
kernels' 20 bits: a model of the kernels, not them; the exact reference:
the mean of the 4 ranks' gradients) for 2 nodes x 2, and print per unit:

  relL2   ||result - exact|| / ||exact||
  adamN   mean over elements of ((result - exact) / rms)^2, rms = the root mean square
          of the exact gradient over the captured steps, per row of 64 elements (a
          vocabulary row in the embedding and the head): the error as an Adam-like
          optimiser sees it, per coordinate
  zeroed  the fraction of elements whose exact gradient is non-zero but whose qgZ
          result is exactly 0 (every contribution rounded to 0)

for the int4 code of the kernels (linear: levels k * absmax / 7, nearest), the same with
stochastic rounding (linear-sr, seeded), and the square-law code
(`--zero-quantized-gradients-code square`; levels k^2 * absmax / 49, nearest in value; replayed
here in float64 with unrounded scales), with every
row quantized or with each rank's own rows exact, block 2048. With --hadamard, also
each code after the blockwise randomized Hadamard transform of --zero-hadamard-gradients
(rows "<code>+had": every rank's gradient transformed per 64 elements, the result
transformed back; float64 here).

    python tools/bench/qgz_grad_error.py capture --dir /tmp/qgz_grads --steps 60,150,250 --iters 260
    python tools/bench/qgz_grad_error.py analyze --dir /tmp/qgz_grads --hadamard

synthetic: the same replay on heavy-tailed synthetic gradients (4 ranks of N(0,1) x
exp(N(0,1)), seeded), printing per code the relative L2 error, the median per-coordinate
error |err| / |x|, the share of coordinates whose error exceeds their value, and the
share sent as 0 (docs/FIDELITY.md "qgZ with the Hadamard transform"):

    python tools/bench/qgz_grad_error.py synthetic --elements 65536
"""

from __future__ import annotations

import argparse
import collections
import glob
import os

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

import convergence as cv  # noqa: E402

QMAX4 = 7


def _capture_rank(topo, argv, out_dir, steps):
    import torch

    torch.set_num_threads(1)
    from megaq import pretrain
    from megaq.zero import collectives

    plain = collectives.GradReducer.start_reduce
    calls = collections.Counter()

    def start_reduce(self, name, flat, out):
        c = calls[name]
        calls[name] += 1
        if c in steps:
            torch.save(flat.clone(), os.path.join(out_dir, f"g_{c}_{name}_{topo.rank}.pt"))
        return plain(self, name, flat, out)

    collectives.GradReducer.start_reduce = start_reduce
    pretrain.main(argv, topo=topo)


def capture(o):
    from megaq.testing.ranks import run_on_ranks

    a = cv.parse(["--iters", str(o.iters)])
    os.makedirs(o.dir, exist_ok=True)
    steps = {int(s) for s in o.steps.split(",")}
    run_on_ranks(_capture_rank, a.world, ranks_per_node=a.world // 2,
                 args=(cv.model_argv(a, o.seed, "bf16"), o.dir, steps), timeout=7200)


def _qdq(x, code: str, block: int, gen=None):
    """float64 quantize-dequantize of x with per-block absmax scale (see the docstring)."""
    import torch

    b = x.reshape(-1, block)
    am = b.abs().amax(-1, keepdim=True)
    am = torch.where(am == 0, torch.ones_like(am), am)
    if code == "linear":
        s = am / QMAX4
        return (torch.round(b / s) * s).reshape(-1)
    if code == "linear-sr":
        s = am / QMAX4
        return (torch.floor(b / s + torch.rand(b.shape, generator=gen, dtype=b.dtype)) * s).reshape(-1)
    s = am / QMAX4 ** 2
    y = b.abs() / s
    c = torch.zeros_like(y)
    for t in range(QMAX4):
        c += (y >= t * t + t + 0.5).double()
    return (torch.sign(b) * c * c * s).reshape(-1)


def _hadamard64(x, inverse=False):
    """The kernels' transform (kernels/reference.py: signs, butterfly, 1/8) in float64."""
    from megaq.kernels.reference import _hadamard_fp32  # dtype-generic despite the name

    return _hadamard_fp32(x, inverse)


def two_hops(G, code: str, own_exact: bool, block: int, gen=None):
    """What each rank (a, j) of 2 nodes x 2 ends with for its chunk 2a + j, all chunks.
    code "<code>+had": the hops run on the transformed gradients, the result is
    transformed back."""
    import torch

    if code.endswith("+had"):
        out = two_hops([_hadamard64(g) for g in G], code[:-4], own_exact, block, gen)
        return _hadamard64(out, inverse=True)

    n, k, m = 4, 2, 2
    S = G[0].numel() // n
    D = [_qdq(g, code, block, gen) for g in G]
    out = torch.zeros(n * S, dtype=torch.float64)
    for a in range(k):
        for j in range(m):
            sl = slice((a * m + j) * S, (a * m + j + 1) * S)
            parts = []
            for a2 in range(k):  # node a2's partial sum, formed on its rank (a2, j)
                me = a2 * m + j
                parts.append(sum(G[r][sl] if own_exact and r == me else D[r][sl]
                                 for r in range(a2 * m, a2 * m + m)))
            out[sl] = sum(parts[a2] if own_exact and a2 == a else _qdq(parts[a2], code, block, gen)
                          for a2 in range(k)) / n
    return out


def analyze(o):
    import torch

    from megaq.checkpoint import safe_unpickle
    files = collections.defaultdict(dict)
    for f in glob.glob(os.path.join(o.dir, "g_*.pt")):
        _, c, rest = os.path.basename(f)[:-3].split("_", 2)
        name, r = rest.rsplit("_", 1)
        files[(int(c), name)][int(r)] = safe_unpickle.load(f).double()
    steps = sorted({c for c, _ in files})
    units = sorted({u for _, u in files})
    exact = {key: sum(G[r] for r in range(4)) / 4 for key, G in files.items()}
    gen = torch.Generator().manual_seed(0)
    print(f"steps {steps}; block {o.block}; 2 nodes x 2")
    print("| unit | elements | code | own rows | relL2 | adamN | zeroed |")
    print("|---|---:|---|---|---:|---:|---:|")
    for u in units:
        rms = torch.sqrt(sum(exact[(c, u)].reshape(-1, 64).pow(2).mean(-1) for c in steps) / len(steps))
        w = rms.clamp_min(1e-30).repeat_interleave(64)
        for code in ("linear", "linear-sr", "square") + (("linear+had", "square+had") if o.hadamard else ()):
            for own in (False, True):
                l2 = e2 = an = z = 0.0
                for c in steps:
                    ex = exact[(c, u)]
                    res = two_hops([files[(c, u)][r] for r in range(4)], code, own, o.block, gen)
                    err = res - ex
                    l2 += float((err ** 2).sum())
                    e2 += float((ex ** 2).sum())
                    an += float(((err / w) ** 2).mean())
                    nz = ex != 0
                    z += float(((res == 0) & nz).sum() / nz.sum())
                print(f"| {u} | {exact[(steps[0], u)].numel()} | {code} | {'exact' if own else 'int4'} "
                      f"| {(l2 / e2) ** 0.5:.3f} | {an / len(steps):.3f} | {z / len(steps):.3f} |")


def synthetic(o):
    import torch

    g = torch.Generator().manual_seed(o.seed)
    G = [torch.randn(o.elements, dtype=torch.float64, generator=g)
         * torch.exp(torch.randn(o.elements, dtype=torch.float64, generator=g)) for _ in range(4)]
    ex = sum(G) / 4
    print(f"4 ranks x {o.elements} elements, N(0,1) x exp(N(0,1)), seed {o.seed}; block {o.block}; 2 nodes x 2")
    print("| code | relative L2 | median |err| / |x| | share with |err| > |x| | sent as 0 |")
    print("|---|---:|---:|---:|---:|")
    for code in ("linear", "linear+had", "square", "square+had"):
        res = two_hops(G, code, False, o.block)
        rel = (res - ex).abs() / ex.abs()
        print(f"| {code} | {float((res - ex).norm() / ex.norm()):.3f} | {float(rel.median()):.3f} "
              f"| {float((rel > 1).double().mean()):.3f} | {float(((res == 0) & (ex != 0)).double().mean()):.3f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--dir", required=True)
    c.add_argument("--steps", default="60,150,250")
    c.add_argument("--iters", type=int, default=300)
    c.add_argument("--seed", type=int, default=1234)
    an = sub.add_parser("analyze")
    an.add_argument("--dir", required=True)
    an.add_argument("--block", type=int, default=2048)
    an.add_argument("--hadamard", action="store_true", help="also the codes after the Hadamard transform")
    sy = sub.add_parser("synthetic")
    sy.add_argument("--elements", type=int, default=65536, help="per rank, a multiple of 4 x block")
    sy.add_argument("--block", type=int, default=2048)
    sy.add_argument("--seed", type=int, default=0)
    o = p.parse_args(argv)
    {"capture": capture, "analyze": analyze, "synthetic": synthetic}[o.cmd](o)


if __name__ == "__main__":
    main()
