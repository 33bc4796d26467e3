"""Plot one or more metrics files (pretrain_gpt.py --metrics-file) as PNG curves.

    python tools/plot_metrics.py run1.jsonl run2.jsonl --output curves.png [--labels a b]

Panels: training loss (with validation loss as markers), learning rate, grad norm,
throughput (tokens/s), and cross-node bytes per node per iteration. One line per file;
iterations logged again after a resume are drawn once, from the resumed run.
"""

from __future__ import annotations

import json
import os

from megaq.data.errors import ArgumentParser, DataError, run_cli


def read(path: str) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e.msg}); pass a file written "
                                f"by pretrain_gpt.py --metrics-file") from None
    return out


def one_history(records, kind="train"):
    """The records of one type as one history: a run resumed from a checkpoint logs
    the iterations after it again (files written before resumes truncated them), so
    when a record's iteration is not past the previous one, the earlier records from
    that iteration on are the stopped run's and are dropped. No zigzags."""
    kept = []
    for r in records:
        if r.get("type", "train") != kind or not isinstance(r.get("iteration"), (int, float)):
            continue
        while kept and kept[-1]["iteration"] >= r["iteration"]:
            kept.pop()
        kept.append(r)
    return kept


def series(records, key, kind="train"):
    pts = [(r["iteration"], r[key]) for r in one_history(records, kind)
           if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="metrics .jsonl files")
    p.add_argument("--output", "-o", default="metrics.png", help="PNG to write")
    p.add_argument("--labels", nargs="*", default=None, help="legend label per file")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.files):
        raise DataError(f"--labels has {len(args.labels)} labels for {len(args.files)} files; "
                        "give one label per file")
    for f in args.files:
        if not os.path.isfile(f):
            raise DataError(f"{f}: no such metrics file; pass a file written by pretrain_gpt.py "
                            "--metrics-file")
    runs = [(lab, read(f)) for lab, f in zip(args.labels or args.files, args.files)]
    for f, (_, recs) in zip(args.files, runs):
        # an empty figure would look like a plot of nothing: say which file holds no curve
        if not one_history(recs) and not one_history(recs, "validation"):
            raise DataError(f"{f}: no train or validation records (lines with \"type\" and "
                            "\"iteration\"); pass a file written by pretrain_gpt.py --metrics-file")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax_loss, ax_val, ax_lr, ax_gn, ax_tp, ax_comm = axes.flat
    for label, recs in runs:
        x, y = series(recs, "lm_loss")
        ax_loss.plot(x, y, label=label)
        vx, vy = series(recs, "val_loss", "validation")
        if vx:
            ax_val.plot(vx, vy, "o-", label=label)
            ax_loss.plot(vx, vy, "o", color=ax_loss.lines[-1].get_color(), alpha=0.6)
        ax_lr.plot(*series(recs, "lr"), label=label)
        ax_gn.plot(*series(recs, "grad_norm"), label=label)
        ax_tp.plot(*series(recs, "tokens_per_s"), label=label)
        with_comm = [r for r in one_history(recs) if "comm" in r]
        cx = [r["iteration"] for r in with_comm]
        cy = [sum(v.get("inter_node", 0) for v in r["comm"].values()) / 2**20 for r in with_comm]
        ax_comm.plot(cx, cy, label=label)
    for ax, title in ((ax_loss, "lm loss (train; o = validation)"), (ax_val, "validation loss"),
                      (ax_lr, "learning rate"), (ax_gn, "grad norm"),
                      (ax_tp, "throughput (tokens/s)"),
                      (ax_comm, "inter-node MiB per node per iteration")):
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".{os.path.basename(args.output)}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, args.output)
    finally:
        if os.path.exists(tmp):  # a failed save leaves no half-written file
            os.remove(tmp)
    print(f"wrote {args.output}")
    return 0


def cli() -> int:
    """The `megaq-plot_metrics` command and tools/plot_metrics.py."""
    return run_cli(main)
