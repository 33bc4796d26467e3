"""Run a torchrun job as two "nodes" joined by a rate-limited link, on one machine.

Each node is a network namespace (tools/cluster/netns_link.py) running one torchrun agent
with --nproc-per-node ranks; the agents meet through c10d rendezvous on the first
namespace's veth address. gloo is pinned to the veth interface
(GLOO_SOCKET_IFNAME), so every rank advertises its namespace's veth address: peers
in the same namespace reach that local address over the namespace's loopback, peers
in the other namespace over the veth pair, where tc limits the rate and the kernel
counts the bytes. The record of a run holds the link counters before/after, the
trainer's metrics (step time, megaq's own inter-node byte accounting) and both
compared.

    python tools/cluster/emulate_cluster.py probe --rate 1gbit            # gloo-only check
    python tools/cluster/emulate_cluster.py run --rate 500mbit -- pretrain_gpt.py ...args
    python tools/cluster/emulate_cluster.py sweep                          # stale namespaces
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from netns_link import EmulatedLink, NetnsError, sweep_stale, why_unavailable  # noqa: E402
from netns_measure import IterationSampler, Segment, plan_segments, whole_run, window  # noqa: E402

import _checkout  # noqa: E402  (a link to tools/_checkout.py: where the checkout is)

REPO = _checkout.ROOT
RDZV_PORT = 29400        # free by construction: the namespaces have nothing else listening


class _Terminated(BaseException):
    """SIGTERM/SIGHUP turned into an exception so every `finally` and `with` runs."""


def _raise_terminated(signum, _frame):
    raise _Terminated(f"received signal {signum}")


def install_signal_cleanup() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_terminated)
    # Ctrl-C -> KeyboardInterrupt even when started with SIGINT ignored (a background
    # job of a non-interactive shell inherits SIG_IGN and Python would keep it).
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ---------------------------------------------------------------------- launching
def torchrun_command(link: EmulatedLink, node: int, nproc: int, run_id: str,
                     script_argv: list[str]) -> list[str]:
    return link.exec_prefix(node) + [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{link.addr[0]}:{RDZV_PORT}",
        "--rdzv-id", run_id,
        # Who hosts the rendezvous store: torchrun guesses by comparing the endpoint
        # with the machine's hostname, which resolves outside the namespaces; say it.
        "--rdzv-conf", f"is_host={1 if node == 0 else 0}",
        # The address this agent advertises (workers' MASTER_ADDR when it is node 0,
        # and the sort key that makes namespace a node 0); the hostname would not work.
        "--local-addr", link.addr[node],
        "--max-restarts", "0", "--monitor-interval", "0.5",
        *script_argv,
    ]


def node_env(link: EmulatedLink, node: int) -> dict:
    env = dict(os.environ)
    env.update(
        # gloo binds its listening socket to this interface's address and advertises
        # it; without it gloo resolves the hostname (127.0.0.1 here: unreachable from
        # the other namespace) and the cross-node connections fail.
        GLOO_SOCKET_IFNAME=link.dev[node],
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        PYTHONUNBUFFERED="1",
        # a rank that dies of a signal (SIGABRT from C++, SIGSEGV) prints every
        # thread's Python stack into the node's log
        PYTHONFAULTHANDLER="1",
        EMULATED_NODE=str(node),
    )
    return env


def launch(link: EmulatedLink, nproc: int, script_argv: list[str], log_dir: str,
           timeout: float, on_poll=None) -> dict:
    """Run both torchrun agents to completion; raise with the logs' tails on failure."""
    run_id = secrets.token_hex(4)
    procs, logs = [], []
    t0 = time.perf_counter()
    try:
        for node in (0, 1):
            log = os.path.join(log_dir, f"node{node}.log")
            logs.append(log)
            with open(log, "w") as f:
                procs.append(subprocess.Popen(
                    torchrun_command(link, node, nproc, run_id, script_argv), cwd=REPO,
                    env=node_env(link, node), stdout=f, stderr=subprocess.STDOUT,
                    start_new_session=True))   # own process group: killed as a whole
        deadline = t0 + timeout
        while any(p.poll() is None for p in procs):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"emulated cluster job ran past {timeout:.0f} s")
            if any(p.returncode not in (None, 0) for p in procs):
                break    # one node failed: do not wait for the other's timeout
            if on_poll is not None:
                on_poll()
            time.sleep(0.002)
    finally:
        for p in procs:
            _kill_group(p)
    wall = time.perf_counter() - t0
    rcs = [p.returncode for p in procs]
    if any(rcs):
        tails = "\n".join(f"--- node {i} (rc {rc}) {log}:\n{_tail(log)}"
                          for i, (rc, log) in enumerate(zip(rcs, logs)))
        raise RuntimeError(f"emulated cluster job failed (exit codes {rcs}):\n{tails}")
    return {"wall_s": wall, "logs": logs}


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, n: int = 25) -> str:
    """The first error-looking lines (the cause) and the last lines (torchrun's summary)."""
    try:
        with open(path, errors="replace") as f:
            lines = [x for x in f.readlines() if not x.startswith("[W")]   # c10d warnings
    except OSError as e:
        return f"(no log: {e})"
    cause = [x for x in lines if any(k in x for k in ("Error", "error:", "Traceback", "Abort",
                                                        "terminate called", "Fatal Python",
                                                        "File \""))][:30]
    # how far the trainer got: its banner, setup and last iteration lines
    progress = [x for x in lines if x.startswith((" megaq:", " setup", " iteration"))][-3:]
    return "".join(["progress:\n"] + progress + ["causes:\n"] + cause + ["...\n"] + lines[-n:])


# ---------------------------------------------------------------------- measuring
def run_measured(script_argv: list[str], *, rate: str | list[str], delay: str = "0ms",
                 mtu: int = 1500, nproc: int = 2, metrics_file: str, timeout: float = 600,
                 warmup: int = 1, iters_per_rate: int | None = None, settle: int = 1,
                 log_dir: str | None = None) -> dict:
    """Build a fresh link, run the job on it, return one record.

    `rate` may be a list: the job then runs `warmup` iterations plus `iters_per_rate`
    per rate (its --train-iters must match), and the link's rate is switched in place
    between segments, so one launch measures every rate. record["segments"] holds one
    window per rate (netns_measure.window); the record's top level holds the first.
    """
    rates = [rate] if isinstance(rate, str) else list(rate)
    segments = None
    if len(rates) > 1:
        if not iters_per_rate:
            raise ValueError("several rates need iters_per_rate")
        segments = plan_segments(rates, iters_per_rate, warmup, settle)
    log_dir = log_dir or tempfile.mkdtemp(prefix="emulated_cluster_")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)   # the trainer appends; never mix runs
    with EmulatedLink(rate=rates[0], delay=delay, mtu=mtu) as link:
        before = [link.counters(n) for n in (0, 1)]
        lo_before = [link.counters(n, "lo") for n in (0, 1)]
        sampler = IterationSampler(link, metrics_file, segments)
        job = launch(link, nproc, script_argv, log_dir, timeout, on_poll=sampler.poll)
        sampler.poll()
        after = [link.counters(n) for n in (0, 1)]
        lo_after = [link.counters(n, "lo") for n in (0, 1)]
        ip_s = [link.ip_s_link(n) for n in (0, 1)]
        shaping = dict(link.shaping)
    veth = [a - b for a, b in zip(after, before)]
    lo = [a - b for a, b in zip(lo_after, lo_before)]
    with open(metrics_file) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    lines = [x for x in lines if x.get("type", "train") == "train" and "elapsed_ms" in x]
    if not lines:
        raise RuntimeError("the job wrote no training lines to its metrics file")
    if segments is None:
        last = lines[-1]["iteration"]
        segments = [Segment(rates[0], 1, min(warmup + 1, last), last)]
    elif lines[-1]["iteration"] != segments[-1].last:
        raise RuntimeError(f"the job ran {lines[-1]['iteration']} iterations but the rate "
                           f"schedule needs --train-iters {segments[-1].last}")
    windows = [window(lines, sampler.samples, before, seg) for seg in segments]
    rec = dict(windows[0])
    rec.update(whole_run(lines, veth, lo))
    first = sampler.samples.get(1)
    rec.update(
        segments=windows, shaping=shaping, nproc_per_node=nproc,
        seconds_to_first_iteration=(round(sampler.first_line_s, 2)
                                    if sampler.first_line_s is not None else None),
        link_bytes_to_first_iteration=(sum((a - b).tx_bytes for a, b in zip(first, before))
                                       if first else None),
        rate_changes=sampler.rate_changes, wall_s=round(job["wall_s"], 2), logs=job["logs"],
        ip_s_link_after=ip_s, command=script_argv)
    return rec


# ---------------------------------------------------------------------- CLI
def _print_record(rec: dict) -> None:
    mb = 1e6
    for w in rec["segments"]:
        line = (f"rate {w['rate']}: step {w['step_ms']:.1f} ms (median of iterations "
                f"{w['iterations_timed'][0]}..{w['iterations_timed'][1]}: {w['step_ms_all']})")
        if "steady_link_bytes_per_iteration" in w:
            line += (f"; link {w['steady_link_bytes_per_iteration'] / mb:.2f} MB/iteration "
                     f"vs megaq {w['steady_accounted_per_iteration'] / mb:.2f} MB/iteration "
                     f"(ratio {w['steady_link_over_accounted']}), "
                     f"link busy {w['link_busy_share']:.0%}")
        print(line)
    print(f"  whole run: link (veth tx, both ends) {rec['link_bytes'] / mb:.2f} MB in "
          f"{rec['link_packets']} frames ({rec['link_header_bytes'] / mb:.2f} MB headers); megaq "
          f"{rec['accounted_inter_node_bytes'] / mb:.2f} MB; set-up + iteration 1 on the link "
          f"{(rec['link_bytes_to_first_iteration'] or 0) / mb:.2f} MB; wall {rec['wall_s']:.1f} s")
    print(f"  loopback bytes per node {[round(b / mb, 2) for b in rec['loopback_bytes']]} MB "
          f"(in-node traffic stays off the link)")
    if rec["shaping"].get("note"):
        print(f"  note: {rec['shaping']['note']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "probe"):
        p = sub.add_parser(name)
        p.add_argument("--rate", default="1gbit",
                       help="link rate per direction, e.g. 200mbit or 1gbit; a comma list "
                            "switches the rate in place every --iters-per-rate iterations")
        p.add_argument("--iters-per-rate", type=int, default=None)
        p.add_argument("--delay", default="0ms", help="one-way delay (needs sch_netem), e.g. 0.5ms")
        p.add_argument("--mtu", type=int, default=1500)
        p.add_argument("--nproc-per-node", type=int, default=2)
        p.add_argument("--timeout", type=float, default=600)
        p.add_argument("--warmup", type=int, default=1, help="iterations left out of the step time")
        p.add_argument("--json", default=None, help="write the run's record here")
    sub.choices["probe"].add_argument("--numel", type=int, default=1 << 20)
    sub.choices["probe"].add_argument("--iters", type=int, default=3)
    sub.choices["probe"].add_argument("--ops", default="all_gather,reduce_scatter",
                                      help="collectives per iteration: all_gather, "
                                           "reduce_scatter, all_reduce, all_to_all")
    sub.choices["run"].add_argument("script", nargs=argparse.REMAINDER,
                                    help="-- script.py args (must write --metrics-file)")
    sw = sub.add_parser("sweep", help="delete namespaces left by dead runs")
    sw.add_argument("--owner", type=int, default=None, help="delete this owner pid's namespaces")
    sub.add_parser("check", help="say whether this machine can build the link")
    args = ap.parse_args(argv)

    if args.cmd == "sweep":
        removed = sweep_stale(args.owner)
        print(f"removed {len(removed)} namespace(s){': ' + ' '.join(removed) if removed else ''}")
        return 0
    reason = why_unavailable()
    if args.cmd == "check":
        print(reason or "ok: network namespaces, veth and tc are available")
        return 1 if reason else 0
    if reason:
        print(f"emulate_cluster: cannot build the emulated link: {reason}", file=sys.stderr)
        return 2
    install_signal_cleanup()
    sweep_stale()   # leftovers of killed runs (never a live run's namespaces)
    with tempfile.TemporaryDirectory(prefix="emulated_cluster_") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        if args.cmd == "probe":
            script = [os.path.join(REPO, "tools", "cluster", "netns_gloo_probe.py"),
                      "--numel", str(args.numel),
                      "--iters", str(args.iters), "--ops", args.ops, "--metrics-file", metrics]
        else:
            script = [a for a in args.script if a != "--"]
            if not script:
                ap.error("run needs a script after --, e.g. -- pretrain_gpt.py --mock-data ...")
            if "--metrics-file" in script:
                metrics = script[script.index("--metrics-file") + 1]
            else:
                script += ["--metrics-file", metrics]
        try:
            rates = [r for r in args.rate.split(",") if r]
            rec = run_measured(script, rate=rates, delay=args.delay, mtu=args.mtu,
                               nproc=args.nproc_per_node, metrics_file=metrics,
                               timeout=args.timeout, warmup=args.warmup,
                               iters_per_rate=args.iters_per_rate, log_dir=tmp)
        except (NetnsError, RuntimeError, TimeoutError, ValueError) as e:
            print(f"emulate_cluster: {e}", file=sys.stderr)
            return 1
        except (KeyboardInterrupt, _Terminated) as e:
            print(f"emulate_cluster: interrupted ({str(e) or 'SIGINT'}); namespaces removed",
                  file=sys.stderr)
            return 130
        _print_record(rec)
        if args.json:
            tmp_json = args.json + ".tmp"
            with open(tmp_json, "w") as f:
                json.dump(rec, f, indent=1)
            os.replace(tmp_json, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
