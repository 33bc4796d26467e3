"""Failures are loud on every rank, hangs end, nothing unhealthy or half-written is kept.

Every test runs the real program (megaq.pretrain.cli) on forked CPU gloo ranks through
megaq.testing.ranks.run_cli_on_ranks, which gives each rank torchrun's environment
and applies torchrun's failure policy (a rank exiting non-zero gets the others
SIGTERMed). Faults are real: flipped and truncated files, signals (SIGINT, SIGSTOP,
SIGKILL), a file-size limit standing in for a full disk, a learning rate that
overflows the weights. One test starts real torchrun and SIGKILLs it.
"""

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megaq import pretrain
from megaq.checkpoint import paths
from megaq.testing.ranks import run_cli_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_argv(iters, *extra):
    return ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
            "--vocab-size", "64", "--eval-iters", "0", "--log-interval", "1",
            # one LR schedule whatever the length, so runs of 2..4 iterations resume each other
            "--lr-decay-iters", "4", "--train-iters", str(iters), *extra]


def run(argv, world=4, **kw):
    return run_cli_on_ranks(pretrain.cli, argv, world, **kw)


def error_lines(r):
    return [x for x in r["stderr"].splitlines() if "error:" in x]


def all_failed(r, world):
    """Every rank stopped with the agreed error: exit 2, or SIGTERM from the launcher
    (torchrun's policy) once a peer has exited 2, which can only come after rank 0's
    line is out: the ranks meet at a barrier after it (megaq.runtime.failure.report)."""
    codes = r["codes"]
    return len(codes) == world and 2 in codes and all(c in (2, -signal.SIGTERM) for c in codes)


def wait_for(path, text, timeout=120.0):
    """Block until file `path` contains `text` (a rank's output file)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if os.path.exists(path) and text in open(path, errors="replace").read():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    """A 4-rank checkpoint at iteration 2 (a copy per test: tests damage it)."""
    root = str(tmp_path_factory.mktemp("ck4"))
    r = run(tiny_argv(2, "--save", root, "--save-interval", "2"))
    assert r["codes"] == [0] * 4, r["stderr"]
    return root


@pytest.fixture
def ck4(saved4, tmp_path):
    dst = str(tmp_path / "ck")
    shutil.copytree(saved4, dst)
    return dst


# --------------------------------------------------------- errors reach the user
def _flip(path, pos=None):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2 if pos is None else pos] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_error_found_only_on_rank_3_is_printed_20_of_20(ck4):
    """Rank 3 alone reads rng/rank_00003.pt. 10 runs with it damaged (caught by the
    manifest), 10 with it truncated under --no-verify-checkpoint (caught by the read):
    every run prints the one line naming the file, and no rank exits 0."""
    rng = os.path.join(paths.iteration_dir(ck4, 2), "rng", "rank_00003.pt")
    good = open(rng, "rb").read()
    seen = []
    for i in range(20):
        if i < 10:
            _flip(rng, pos=(97 * i) % len(good))
            extra = []
        else:
            open(rng, "wb").write(good[:len(good) // 3])
            extra = ["--no-verify-checkpoint"]
        r = run(tiny_argv(3, "--load", ck4, *extra))
        open(rng, "wb").write(good)
        lines = error_lines(r)
        seen.append(len(lines) == 1 and rng in lines[0] and "found on rank 3" in lines[0]
                    and all_failed(r, 4)
                    and "Traceback" not in r["stderr"])
        assert seen[-1], (i, r["codes"], r["stderr"])
    assert sum(seen) == 20


def shard_file(ckpt_dir, rank):
    """The file DCP wrote with `rank`'s own pieces (--ckpt-format torch_dist)."""
    return os.path.join(ckpt_dir, f"__{rank}_0.distcp")


@pytest.mark.parametrize("where", ["shard", "rng", "truncated_shard", "metadata",
                                   "empty_rng_unverified"])
def test_damaged_checkpoint_file_one_line_naming_it(ck4, where):
    it = paths.iteration_dir(ck4, 2)
    model = shard_file(it, 0)  # read by rank 0 (same layout: every rank reads its own)
    rng = paths.rng_file(it, 1)
    extra = []
    if where == "shard":
        _flip(model)
        path, expect = model, "is damaged: sha256"
    elif where == "metadata":
        path = os.path.join(it, ".metadata")
        _flip(path)
        expect = "is damaged: sha256"
    elif where == "rng":
        _flip(rng)
        path, expect = rng, "is damaged: sha256"
    elif where == "truncated_shard":
        open(model, "r+b").truncate(os.path.getsize(model) // 2)
        path, expect = model, "is damaged: sha256"
    else:  # an empty RNG file, read without the manifest: still one line naming it
        open(rng, "wb").close()
        path, expect, extra = rng, "cannot be read (EOFError", ["--no-verify-checkpoint"]
    r = run(tiny_argv(3, "--load", ck4, *extra))
    lines = error_lines(r)
    assert all_failed(r, 4) and len(lines) == 1, r["stderr"]
    assert lines[0].startswith("error: ") and path in lines[0] and expect in lines[0]


def test_flipped_rng_state_without_manifest_is_a_clear_line(ck4):
    """A byte flip inside the mt19937 state tensor (not the zip structure) loads as a
    tensor; restoring it fails: the line names the file instead of 'Invalid mt19937'."""
    import torch
    rng = paths.rng_file(paths.iteration_dir(ck4, 2), 2)
    state = torch.load(rng, weights_only=True)
    state["torch_cpu"] = state["torch_cpu"][:100]  # a wrong-sized generator state
    torch.save(state, rng)
    r = run(tiny_argv(3, "--load", ck4, "--no-verify-checkpoint"))
    lines = error_lines(r)
    assert all_failed(r, 4) and len(lines) == 1, r["stderr"]
    assert rng in lines[0] and "holds no valid RNG state" in lines[0] and "--no-load-rng" in lines[0]


def test_directory_without_manifest_is_never_loaded(ck4):
    os.remove(os.path.join(paths.iteration_dir(ck4, 2), "MANIFEST.sha256.json"))
    r = run(tiny_argv(3, "--load", ck4), world=2)
    lines = error_lines(r)
    assert all_failed(r, 2) and len(lines) == 1 and "has no integrity manifest" in lines[0]
    ok = run(tiny_argv(3, "--load", ck4, "--no-verify-checkpoint"))
    assert ok["codes"] == [0] * 4 and "loaded checkpoint" in ok["stdout"], ok["stderr"]


def test_reshard_reads_are_verified(tmp_path):
    """TP=2 checkpoint loaded at TP=1: every rank reads both TP ranks' pieces."""
    root = str(tmp_path / "ck")
    r = run(tiny_argv(1, "--save", root, "--save-interval", "1",
                      "--tensor-model-parallel-size", "2"), world=2)
    assert r["codes"] == [0, 0], r["stderr"]
    shard = shard_file(paths.iteration_dir(root, 1), 1)
    _flip(shard)
    r = run(tiny_argv(2, "--load", root), world=2)
    lines = error_lines(r)
    assert all_failed(r, 2) and len(lines) == 1 and shard in lines[0], r["stderr"]


# ----------------------------------------------------------------- write errors
def _file_size_limit(limit):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_disk_full_save_one_line_no_tmp_previous_stays_latest(ck4):
    it = paths.iteration_dir(ck4, 2)
    model_bytes = os.path.getsize(shard_file(it, 0))
    biggest_other = max(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(it)
                        for n in ns if not n.endswith(".distcp"))
    assert biggest_other + 4096 < model_bytes  # the limit lets everything but the model through
    os.makedirs(os.path.join(ck4, ".iter_0000009.tmp"))  # a stale save of a killed run
    r = run(tiny_argv(4, "--load", ck4, "--save", ck4, "--save-interval", "2"),
            before=_file_size_limit(biggest_other + 4096))
    lines = error_lines(r)
    assert all_failed(r, 4) and len(lines) == 1, r["stderr"]
    assert f"cannot write the checkpoint to {ck4}: File too large" in lines[0]
    assert "needs about" in lines[0] and "(iteration 2) stays latest" in lines[0]
    assert "Traceback" not in r["stderr"]
    assert paths.read_tracker(ck4) == 2
    assert sorted(n for n in os.listdir(ck4) if n.startswith((".iter", "iter"))) == ["iter_0000002"]
    # and the previous checkpoint still loads
    ok = run(tiny_argv(3, "--load", ck4, "--global-batch-size", "4"), world=2)
    assert ok["codes"] == [0, 0] and "loaded checkpoint" in ok["stdout"], ok["stderr"]


# ------------------------------------------------------------ unhealthy weights
def test_nan_streak_leaves_latest_at_last_healthy_checkpoint(tmp_path):
    """--lr 1e30: iteration 1's loss is finite and its update overflows the weights, so
    every later loss is non-finite. Saves fall at every iteration: 1 is saved, 2 and 3
    are postponed, and the run stops at 4 with latest = 1, the last one before the streak."""
    root = str(tmp_path / "ck")
    argv = tiny_argv(10, "--save", root, "--save-interval", "1", "--max-consecutive-skipped-iters",
                     "3")
    argv[argv.index("--lr") + 1] = "1e30"
    r = run(argv, world=2)
    assert all_failed(r, 2), r["stderr"]
    lines = error_lines(r)  # decided on the all-reduced loss: rank 0 prints it for all
    assert len(lines) == 1 and lines[0].startswith("error: stopping at iteration 4: 3 iterations "
                                                   "in a row"), r["stderr"]
    assert "checkpoint at iteration 2 postponed" in r["stdout"]
    assert "checkpoint at iteration 3 postponed" in r["stdout"]
    assert paths.read_tracker(root) == 1
    assert sorted(n for n in os.listdir(root) if "iter_" in n) == ["iter_0000001"]


def test_weights_that_overflow_never_become_latest(tmp_path):
    """A resume with an absurd learning rate: SGD's update (lr 1e38 x a gradient with
    weight decay) overflows fp32, so iteration 2's weights hold inf while its loss (computed
    before the update) is finite. The save at 2 is refused on every rank in one line
    before anything is staged (--async-save), and iteration 1 stays latest."""
    root = str(tmp_path / "ck")
    sgd = ["--optimizer", "sgd", "--save", root, "--save-interval", "1"]
    r = run(tiny_argv(1, *sgd), world=2)
    assert r["codes"] == [0, 0] and paths.read_tracker(root) == 1, r["stderr"]
    argv = tiny_argv(3, *sgd, "--load", root, "--weight-decay", "100", "--async-save",
                     "--override-opt_param-scheduler")
    argv[argv.index("--lr") + 1] = "1e38"
    r = run(argv, world=2)
    lines = error_lines(r)
    assert all_failed(r, 2) and len(lines) == 1, r["stderr"]
    assert lines[0] == (f"error: refusing to save iteration 2 to {root}: the weights hold inf or "
                        f"nan (an update overflowed them); the previous checkpoint (iteration 1) "
                        f"stays latest; resume from it with a lower --lr (plus "
                        f"--override-opt_param-scheduler) or a smaller --weight-decay")
    assert "lm loss: 4." in r["stdout"].split("iteration        2/")[1].splitlines()[0]  # finite
    assert paths.read_tracker(root) == 1
    assert sorted(n for n in os.listdir(root) if "iter_" in n) == ["iter_0000001"]


# --------------------------------------------------------------------- signals
def _signal_when_training(sig, ranks, after="iteration        2/"):
    def inject(pids, outdir):
        wait_for(os.path.join(outdir, "0.out"), after)
        for r in ranks:
            os.kill(pids[r], sig)
    return inject


def test_sigint_saves_at_next_iteration_and_exits_0(tmp_path):
    root = str(tmp_path / "ck")
    r = run(tiny_argv(100000, "--save", root, "--exit-signal-handler"), world=2,
            on_start=_signal_when_training(signal.SIGINT, [0, 1]))
    assert r["codes"] == [0, 0], r["stderr"]
    assert "Traceback" not in r["stderr"] and "KeyboardInterrupt" not in r["stderr"]
    saved = paths.read_tracker(root)
    assert saved and f"exiting program at iteration {saved}" in r["stdout"]
    assert "saved checkpoint at iteration" in r["stdout"]


def _running(pid) -> bool:
    """Not yet exited (the launcher reaps its ranks only after on_start returns, so an
    exited rank is a zombie until then)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _ctrl_c_until_exit(rank, gap=0.01, limit=120.0):
    """Ctrl-C `rank` every `gap` s, from the start of an iteration on, until it exits.

    Why a stream, not two signals `gap` apart: Python runs a signal's handler only when
    the main thread next executes bytecode, and two SIGINTs that arrive before that (the
    rank not scheduled on a loaded machine, or blocked in a collective) make one handler
    call. With a stream, once the first handler call has requested the stop, any SIGINT
    that arrives before the stop takes effect is a second Ctrl-C; the stream starts as
    rank 0 logs an iteration (all ranks are past its boundary), so the first call comes
    early in the next iteration and the stop is a whole iteration of compute away: the
    injector, which needs almost no CPU, has that long to send one more. A run that
    ignored the second Ctrl-C would stop at the boundary and exit 0, and fail."""
    def inject(pids, outdir):
        log = os.path.join(outdir, "0.out")
        wait_for(log, "iteration        2/")  # training, signal handler installed
        t0 = time.monotonic()
        while "iteration        3/" not in open(log, errors="replace").read():
            assert time.monotonic() - t0 < limit, "iteration 3 never logged"
            time.sleep(0.002)
        while _running(pids[rank]) and time.monotonic() - t0 < limit:
            os.kill(pids[rank], signal.SIGINT)
            time.sleep(gap)
    return inject


def test_second_ctrl_c_exits_at_once(tmp_path):
    # iterations of ~0.1 s or more: the stop takes effect only at an iteration boundary
    argv = tiny_argv(100000, "--exit-signal-handler", "--micro-batch-size", "8")
    argv[argv.index("--hidden-size") + 1] = "128"
    argv[argv.index("--seq-length") + 1] = "128"
    r = run(argv, world=2, on_start=_ctrl_c_until_exit(1))
    assert r["codes"][1] == 130, r
    assert "[rank 1] error: interrupted again (second Ctrl-C)" in r["stderr"]


def test_exit_line_from_a_signal_handler_inside_a_stderr_write():
    """A second Ctrl-C's handler (exit_now) may run while the main thread is inside a write
    to stderr, holding its buffered writer's lock; its line must still come out and the
    rank exit with its code. Through print the handler met the lock and raised
    RuntimeError("reentrant call inside <_io.BufferedWriter name=2>"): exit code 1 and no
    line (CI, 2026-12-07, the test above). Here the handler is called from inside the raw
    write that stderr's buffered writer makes, which is where a signal lands then."""
    code = ("import io, os, sys\n"
            "from megaq.runtime import failure\n"
            "class Fd2(io.RawIOBase):  # stderr's file descriptor, a signal in its first write\n"
            "    signalled = False\n"
            "    def writable(self): return True\n"
            "    def fileno(self): return 2\n"
            "    def write(self, b):\n"
            "        if not Fd2.signalled:\n"
            "            Fd2.signalled = True\n"
            "            failure.exit_now(130, 'error: interrupted again')\n"
            "        return os.write(2, b)\n"
            "sys.stderr = io.TextIOWrapper(io.BufferedWriter(Fd2()), write_through=True)\n"
            "print('go', file=sys.stderr, flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 130, r.stderr[-1000:]
    assert r.stderr.splitlines()[-1] == "error: interrupted again", r.stderr[-1000:]


# ------------------------------------------------------------------------ hangs
def test_sigstopped_rank_ends_job_within_hang_bound_with_diagnosis(tmp_path):
    bound = 0.05 * 60  # --hang-timeout-minutes 0.05
    stopped = {}

    def stop_rank_1(pids, outdir):
        wait_for(os.path.join(outdir, "0.out"), "iteration        3/")
        os.kill(pids[1], signal.SIGSTOP)  # a hung node
        stopped["at"] = time.monotonic()

    r = run(tiny_argv(100000, "--hang-timeout-minutes", "0.05"), world=2, on_start=stop_rank_1,
            grace=2.0)
    elapsed = time.monotonic() - stopped["at"]
    err = r["stderr"]
    assert r["codes"][0] == 124, r
    assert "[rank 0] error: hang watchdog: no iteration completed for" in err
    diagnosis = err.split("[rank 0] error: hang watchdog:")[1].splitlines()[0]
    assert "last completed iteration: " in diagnosis, diagnosis
    assert "last collective entered: " in diagnosis and "none yet" not in diagnosis, diagnosis
    assert "Thread" in err and "megaq/training.py" in err  # faulthandler's dump of every thread
    # the bound, the watchdog's polling and the launcher's 2 s grace; generous for a loaded CI
    assert elapsed < bound + 2.0 + 20.0, elapsed


def test_process_group_timeout_reaches_new_groups():
    """--distributed-timeout-minutes 0.02 (1.2 s): a collective on a group the topology
    created after init (build_topology -> comm.Group.create) that a peer never joins
    fails in seconds, not torch's 30 min."""
    def entry(argv):
        from datetime import timedelta
        from megaq.parallel import comm
        from megaq.parallel.launch import group_timeout, init_from_env
        from megaq.parallel.topology import Layout, build_topology
        import torch
        rank, world = init_from_env("gloo", timeout_minutes=0.02)
        topo = build_topology(Layout(world), rank, timeout=group_timeout(0.02))
        assert topo.timeout == timedelta(seconds=1.2)
        group = topo.dp
        if rank == 1:
            time.sleep(15)
            return 0
        t0 = time.monotonic()
        try:
            comm.all_reduce(torch.ones(1), group, "dp_misc")
        except RuntimeError:
            print(f"timed out after {time.monotonic() - t0:.1f} s", flush=True)
            return 3
        return 0

    r = run_cli_on_ranks(entry, [], 2, timeout=60)
    assert r["codes"][0] == 3, r
    seconds = float(r["stdout"].split("timed out after ")[1].split()[0])
    assert seconds < 10, seconds


# ------------------------------------------------------------------- a lost rank
def test_killed_rank_is_named_by_every_survivor_in_one_line(tmp_path):
    """kill -9 of rank 2 of 4, the ranks posing as 2 nodes of 2: each survivor prints one
    line naming rank 2 (node 1, its host), the phase, the group and the iteration; the
    backend's traceback goes to the log file the line names, none to the terminal; the
    job ends within seconds (run_cli_on_ranks reaps every rank: no orphan)."""
    killed = {}

    def kill_rank_2(pids, outdir):
        wait_for(os.path.join(outdir, "0.out"), "iteration        3/")
        os.kill(pids[2], signal.SIGKILL)
        killed["at"] = time.monotonic()

    r = run(tiny_argv(100000, "--gpus-per-node", "2"), world=4, on_start=kill_rank_2,
            env={"MEGAQ_LOG_DIR": str(tmp_path / "logs")})
    elapsed = time.monotonic() - killed["at"]
    assert r["codes"][2] == -signal.SIGKILL and all(r["codes"][i] == 1 for i in (0, 1, 3)), r
    lines = error_lines(r)
    assert len(lines) == 3, r["stderr"]
    for rank, line in zip((0, 1, 3), lines):
        assert line.startswith(f"[rank {rank}] error: lost rank 2 (node 1, host "), line
        assert ") in " in line and " group (ranks " in line and " after iteration " in line
        assert "its process ended (the connection to it closed); this rank stops" in line
        log = line.split("The backend's traceback: ")[1]
        assert log.startswith(str(tmp_path / "logs")) and "Traceback" in open(log).read()
    assert "Traceback" not in r["stderr"] and "GLHF" not in r["stderr"]
    # the roll call (2 s) and the launcher's polling; generous for a loaded CI
    assert elapsed < 20, elapsed


# ------------------------------------------------------------------ job ownership
def test_second_job_refused_by_lock_and_stale_lock_taken_over(tmp_path):
    root = str(tmp_path / "ck")
    second = {}

    def start_second_job(pids, outdir):
        wait_for(os.path.join(outdir, "0.out"), "iteration        2/")
        second["r"] = run(tiny_argv(2, "--save", root, "--save-interval", "1"), world=2)
        for p in pids:  # the first job dies without cleaning up, as on a node failure
            os.kill(p, signal.SIGKILL)

    run(tiny_argv(100000, "--save", root), world=2, on_start=start_second_job)
    r = second["r"]
    lines = error_lines(r)
    assert all_failed(r, 2) and len(lines) == 1, r["stderr"]
    assert f"{root} is in use by another running job (pid" in lines[0]
    assert not os.path.exists(paths.iteration_dir(root, 1))
    third = run(tiny_argv(1, "--save", root, "--save-interval", "1"), world=2)
    assert third["codes"] == [0, 0], third["stderr"]
    assert "took over the stale checkpoint lock" in third["stdout"]
    assert paths.read_tracker(root) == 1


def test_sigkill_of_torchrun_leaves_no_rank_alive(tmp_path):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.join(REPO, "pretrain_gpt.py"), *tiny_argv(100000)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path),
        start_new_session=True)
    ranks = []
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.decode(errors="replace"))
            if "iteration        2/" in lines[-1]:
                break
        else:
            pytest.fail("training never started:\n" + "".join(lines))
        ranks += _children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(proc.pid, signal.SIGKILL)  # the launcher dies (its ranks are in their own sessions)
        # every rank gone within 5 s of the kill (polled: the test ends when they are)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [p for p in ranks if _alive(p)]
        assert not alive, f"ranks {alive} outlived torchrun"
    finally:
        for p in [proc.pid] + ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        proc.wait()


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
