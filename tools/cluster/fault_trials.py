#!/usr/bin/env python3
"""Fault trials: run pretrain_gpt.py through any launcher, inject real faults, check the outcome.

    python tools/cluster/fault_trials.py                       # torchrun, 4 CPU ranks
    python tools/cluster/fault_trials.py --repeats 20 --json trials.json
    python tools/cluster/fault_trials.py --launcher "bash scripts/launch_local.sh" --nproc 4
    python tools/cluster/fault_trials.py --launcher "srun -n 8 python {script}" --nproc 8

The launcher command is given pretrain_gpt.py's flags; ``{script}`` in it stands for
pretrain_gpt.py's path (the default launcher is torchrun on this machine, and
``scripts/launch_local.sh`` adds the script itself; its rank count comes from NPROC,
which is set to --nproc). Every trial runs a tiny model on mock data (or on a small
generated token dataset) and injects one real fault: damaged or truncated checkpoint
files, a checkpoint whose DCP index would run a command, a file-size limit for a full
disk, SIGKILL of every rank during a background save, an absurd learning rate, SIGINT,
SIGSTOP, SIGKILL of the launcher, a second job on the same checkpoint directory, empty
data, symbolic links planted in --save (lock, tracker, a stale .tmp), non-finite settings
and weights that overflow, SIGKILL of one rank.
Rank processes are found as the launcher's descendants that carry a RANK variable.

Prints a table (trial, expected, observed, pass/fail) and writes JSON (--json).
Exit status 0 when every trial passed. docs/RELIABILITY.md holds a run's output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
REPO = _checkout.ROOT
SCRIPT = os.path.join(REPO, "pretrain_gpt.py")

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--eval-iters", "0",
        "--log-interval", "1",
        # one LR schedule for every run: trials resume with another --train-iters, and a
        # schedule that follows the run's length would be refused on resume
        "--lr-decay-iters", "100000"]
MOCK = ["--mock-data", "--vocab-size", "64"]


class Job:
    """One launcher run in its own session; output collected in a file."""

    def __init__(self, trial: "Trials", flags: list[str], preexec=None):
        self.log = os.path.join(trial.work, f"job{len(trial.jobs)}.log")
        trial.jobs.append(self)
        cmd = trial.launcher.replace("{script}", shlex.quote(SCRIPT))
        full = f"{cmd} {' '.join(shlex.quote(f) for f in flags)}"
        env = dict(os.environ, NPROC=str(trial.nproc), GLOO_SOCKET_IFNAME="lo",
                   OMP_NUM_THREADS="1")
        self.t0 = time.monotonic()
        self.out = open(self.log, "wb")
        self.proc = subprocess.Popen(full, shell=True, stdout=self.out, stderr=subprocess.STDOUT,
                                     env=env, cwd=trial.work, start_new_session=True,
                                     preexec_fn=preexec)

    def text(self) -> str:
        return open(self.log, errors="replace").read()

    def wait_for(self, needle: str, timeout: float) -> bool:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if needle in self.text():
                return True
            if self.proc.poll() is not None:
                return needle in self.text()
            time.sleep(0.1)
        return False

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.seconds = time.monotonic() - self.t0

    def ranks(self) -> list[int]:
        """Pids of the rank processes: descendants of the launcher with RANK in their env."""
        return sorted(p for p in _descendants(self.proc.pid) if _has_rank_env(p))

    def rank_pid(self, rank: int) -> int | None:
        for p in self.ranks():
            if _env_of(p).get("RANK") == str(rank):
                return p
        return None

    def kill(self) -> None:
        pids = [self.proc.pid] + self.ranks()
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        self.wait(10)
        self.out.close()


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(int(name))
    return out


def _descendants(pid: int) -> list[int]:
    kids, todo, out = _children_map(), [pid], []
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _env_of(pid: int) -> dict:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return {}
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def _has_rank_env(pid: int) -> bool:
    env = _env_of(pid)
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False
    return "RANK" in env and b"pretrain_gpt.py" in cmd and b"torch.distributed.run" not in cmd


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _error_lines(text: str) -> list[str]:
    return [x.strip() for x in text.splitlines() if "error:" in x]


def _rank_traceback(text: str) -> bool:
    """A Python traceback through megaq's code (the launcher's own, e.g. torchrun's
    ChildFailedError report, does not count)."""
    return re.search(r'File "[^"]*(megaq/|pretrain_gpt\.py)', text) is not None


def _tracker(root: str):
    try:
        return int(open(os.path.join(root, "latest_checkpointed_iteration.txt")).read())
    except (OSError, ValueError):
        return None


def _flip(path: str, pos: int | None = None) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2 if pos is None else pos % len(data)] ^= 0xFF
    open(path, "wb").write(bytes(data))


class RunsCommand:
    """What a hostile file plants in a pickle: unpickling it runs `command` (through
    os.system, pickled as posix.system) and gives its exit status in its place."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def rehash(ckpt_dir: str, rel: str) -> None:
    """Put file `rel`'s new SHA-256 into the checkpoint's manifest, as whoever alters a
    checkpoint would (the manifest is not signed)."""
    from megaq.checkpoint import integrity
    path = os.path.join(ckpt_dir, integrity.MANIFEST_NAME)
    manifest = json.load(open(path))
    digest, size = integrity.sha256_of(os.path.join(ckpt_dir, rel))
    manifest["files"][rel] = {"sha256": digest, "bytes": size}
    with open(path, "w") as f:
        json.dump(manifest, f)


def plant_in_dcp_index(ckpt_dir: str, marker: str) -> str:
    """Rewrite the DCP index (.metadata) of a torch_dist checkpoint directory so that
    unpickling it touches `marker`, then gives the real index (its planner_data, unused,
    becomes the command's exit status), and re-hash it: a plain pickle.load runs the
    command and the load goes on as if nothing happened. Returns the file's path."""
    import pickle
    path = os.path.join(ckpt_dir, ".metadata")
    with open(path, "rb") as f:
        index = pickle.load(f)  # megaq's own index, written by the trial's run
    index.planner_data = RunsCommand(f"touch {shlex.quote(marker)}")
    with open(path, "wb") as f:
        pickle.dump(index, f)
    rehash(ckpt_dir, ".metadata")
    return path


class Trials:
    def __init__(self, launcher: str, nproc: int, work: str, timeout: float):
        self.launcher, self.nproc, self.work, self.timeout = launcher, nproc, work, timeout
        self.jobs: list[Job] = []
        self.results: list[dict] = []

    # -- helpers -----------------------------------------------------------------
    def run(self, flags, preexec=None) -> tuple[int | None, str, float]:
        job = Job(self, flags, preexec)
        code = job.wait(self.timeout)
        if code is None:
            job.kill()
        else:
            job.out.close()
        return code, job.text(), job.seconds

    def record(self, name, expected, observed, ok, seconds):
        observed = observed.replace(self.work, "$WORK")  # the temporary directory
        self.results.append({"trial": name, "expected": expected, "observed": observed,
                             "passed": bool(ok), "seconds": round(seconds, 1)})
        print(f"  {'pass' if ok else 'FAIL'}  {name}: {observed} ({seconds:.1f} s)", flush=True)

    def checkpoint(self, name: str, iters: int = 2) -> str:
        root = os.path.join(self.work, name)
        code, text, _ = self.run(TINY + MOCK + ["--train-iters", str(iters), "--save", root,
                                                "--save-interval", str(iters)])
        if code != 0 or _tracker(root) != iters:
            raise RuntimeError(f"could not make a checkpoint ({code}):\n{text[-3000:]}")
        return root

    def dataset(self) -> str:
        import numpy as np
        from megaq.data.indexed import IndexedDatasetWriter
        prefix = os.path.join(self.work, "tokens")
        if not os.path.exists(prefix + ".idx"):
            rng = np.random.default_rng(0)
            w = IndexedDatasetWriter(prefix, np.uint16)
            for _ in range(200):
                w.add_document(rng.integers(0, 400, rng.integers(20, 100)))
            w.finish()
            w.commit()
        return prefix

    # -- trials ------------------------------------------------------------------
    def rank3_only_error(self, repeats: int):
        root = self.checkpoint("ck_rank3")
        rng = os.path.join(root, "iter_0000002", "rng", f"rank_{self.nproc - 1:05d}.pt")
        good = open(rng, "rb").read()
        shown, t0 = 0, time.monotonic()
        for i in range(repeats):
            _flip(rng, 97 * i + 11)
            code, text, _ = self.run(TINY + MOCK + ["--train-iters", "3", "--load", root])
            open(rng, "wb").write(good)
            lines = _error_lines(text)
            shown += code not in (0, None) and any(rng in x for x in lines)
        self.record(f"error only on rank {self.nproc - 1} (damaged RNG file it alone reads)",
                    f"its error line in {repeats} of {repeats} runs",
                    f"{shown} of {repeats}", shown == repeats, time.monotonic() - t0)

    def damaged_files(self):
        root = self.checkpoint("ck_damaged")
        it = os.path.join(root, "iter_0000002")
        model = os.path.join(it, "__0_0.distcp")  # rank 0's shard (--ckpt-format torch_dist)
        rng1 = os.path.join(it, "rng", "rank_00001.pt")
        cases = [
            ("byte flip in rank 0's shard file", model, lambda: _flip(model), [],
             "is damaged: sha256"),
            ("truncated shard file", model,
             lambda: open(model, "r+b").truncate(os.path.getsize(model) // 2), [], "is damaged"),
            ("empty RNG file, --no-verify-checkpoint", rng1, lambda: open(rng1, "wb").close(),
             ["--no-verify-checkpoint"], "cannot be read"),
            ("manifest deleted", it, lambda: os.remove(os.path.join(it, "MANIFEST.sha256.json")),
             [], "has no integrity manifest"),
        ]
        for name, path, damage, extra, expect in cases:
            backup = os.path.join(self.work, "backup")
            shutil.rmtree(backup, ignore_errors=True)
            shutil.copytree(it, backup)
            damage()
            code, text, secs = self.run(TINY + MOCK + ["--train-iters", "3", "--load", root] + extra)
            lines = _error_lines(text)
            ok = code not in (0, None) and len(lines) == 1 and path in lines[0] and expect in lines[0]
            self.record(name, f"refused: one line naming the file ({expect})",
                        (lines[0][:110] + "...") if lines else f"exit {code}, no error line", ok, secs)
            shutil.rmtree(it)
            shutil.copytree(backup, it)

    def crafted_checkpoint(self):
        """A downloaded checkpoint whose DCP index would run a command when unpickled
        (its manifest re-hashed, as an attacker would): --load must refuse it unread."""
        root = self.checkpoint("ck_crafted")
        marker = os.path.join(self.work, "crafted_ran")
        path = plant_in_dcp_index(os.path.join(root, "iter_0000002"), marker)
        code, text, secs = self.run(TINY + MOCK + ["--train-iters", "3", "--load", root])
        lines = _error_lines(text)
        ran = os.path.exists(marker)
        ok = (code not in (0, None) and not ran and len(lines) == 1 and path in lines[0]
              and "posix.system" in lines[0] and not _rank_traceback(text))
        self.record("--load of a checkpoint whose .metadata pickle runs a command",
                    "refused unread: one line naming the file and the class, command not run",
                    f"exit {code}, command ran: {ran}, "
                    + ((lines[0][:80] + "...") if lines else "no error line"), ok, secs)

    def disk_full(self):
        root = self.checkpoint("ck_full")
        it = os.path.join(root, "iter_0000002")
        model = os.path.getsize(os.path.join(it, "__0_0.distcp"))
        others = max(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(it) for n in ns
                     if not n.endswith(".distcp"))
        limit = (others + model) // 2

        def fsize_limit():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        code, text, secs = self.run(TINY + MOCK + ["--train-iters", "4", "--load", root, "--save",
                                                   root, "--save-interval", "2"], preexec=fsize_limit)
        lines = _error_lines(text)
        tmp = [n for n in os.listdir(root) if n.endswith(".tmp")]
        ok = (code not in (0, None) and len(lines) == 1 and "cannot write the checkpoint" in lines[0]
              and not tmp and _tracker(root) == 2 and not _rank_traceback(text))
        self.record("disk full during a save (RLIMIT_FSIZE)",
                    "one line with bytes needed, no .tmp left, latest stays 2",
                    f"{len(lines)} line(s), .tmp left: {tmp or 'none'}, latest {_tracker(root)}",
                    ok, secs)

    def save_sigkill(self, tries: int = 10):
        """Every rank SIGKILLed at a random moment of a save (--async-save: the background
        writer, while training goes on), `tries` times: `latest` must name a checkpoint
        whose manifest verifies and which a new run loads."""
        import random

        from megaq.checkpoint import integrity
        rng, good, mid, t0 = random.Random(16), 0, 0, time.monotonic()
        root = os.path.join(self.work, "ck_kill")
        for _ in range(tries):
            shutil.rmtree(root, ignore_errors=True)
            job = Job(self, TINY + MOCK + ["--train-iters", "100000", "--save", root,
                                           "--save-interval", "1", "--async-save"])
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline and job.proc.poll() is None and not (
                    os.path.isdir(root) and ".iter_0000003.tmp" in os.listdir(root)):
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.2))
            mid += any(n.endswith(".tmp") for n in os.listdir(root))
            job.kill()
            latest = _tracker(root)
            try:
                integrity.verify_all(os.path.join(root, f"iter_{latest:07d}"))
                verified = True
            except (integrity.IntegrityError, TypeError):
                verified = False
            code, text, _ = self.run(TINY + MOCK + ["--train-iters", str((latest or 0) + 1),
                                                    "--load", root])
            good += verified and code == 0 and "loaded checkpoint" in text
        self.record(f"SIGKILL of every rank during --async-save ({tries} random moments)",
                    "latest verifies and loads every time",
                    f"{good} of {tries} ({mid} kills inside a save)", good == tries,
                    time.monotonic() - t0)

    def nan_streak(self):
        root = os.path.join(self.work, "ck_nan")
        flags = [f if f != "1e-3" else "1e30" for f in TINY] + MOCK + [
            "--train-iters", "10", "--save", root, "--save-interval", "1",
            "--max-consecutive-skipped-iters", "3"]
        code, text, secs = self.run(flags)
        saved = sorted(n for n in os.listdir(root) if n.startswith("iter_")) if os.path.isdir(root) else []
        ok = code not in (0, None) and _tracker(root) == 1 and saved == ["iter_0000001"]
        self.record("NaN streak (--lr 1e30)", "stops; latest = 1, the last save before the streak",
                    f"exit {code}, latest {_tracker(root)}, saved {saved}", ok, secs)

    def sigint(self):
        root = os.path.join(self.work, "ck_sigint")
        job = Job(self, TINY + MOCK + ["--train-iters", "100000", "--save", root,
                                       "--exit-signal-handler"])
        started = job.wait_for("iteration        2/", self.timeout)
        for p in job.ranks():
            os.kill(p, signal.SIGINT)
        code = job.wait(60)
        text = job.text()
        if code is None:
            job.kill()
        saved = _tracker(root)
        ok = (started and code == 0 and saved is not None and not _rank_traceback(text)
              and f"exiting program at iteration {saved}" in text)
        self.record("SIGINT with --exit-signal-handler", "saves at the next iteration, exit 0",
                    f"exit {code}, latest {saved}, traceback: {_rank_traceback(text)}", ok,
                    job.seconds)

    def sigstop(self, minutes: float = 0.1):
        job = Job(self, TINY + MOCK + ["--train-iters", "100000", "--hang-timeout-minutes",
                                       str(minutes)])
        job.wait_for("iteration        3/", self.timeout)
        victim = job.rank_pid(1)
        t0 = time.monotonic()
        if victim:
            os.kill(victim, signal.SIGSTOP)
        diag = job.wait_for("error: hang watchdog", 60 * minutes + 30)
        t_diag = time.monotonic() - t0
        code = job.wait(120)
        t_end = time.monotonic() - t0
        if code is None:
            job.kill()
        text = job.text()
        stacks = "Thread" in text and "last collective entered" in text
        ok = bool(victim) and diag and stacks and code not in (0, None)
        self.record(f"SIGSTOP of rank 1 (--hang-timeout-minutes {minutes})",
                    f"diagnosis after ~{60 * minutes:.0f} s, job ends",
                    f"diagnosis after {t_diag:.1f} s, job ended after {t_end:.1f} s (exit {code})",
                    ok, t_end)

    def launcher_sigkill(self):
        job = Job(self, TINY + MOCK + ["--train-iters", "100000"])
        job.wait_for("iteration        2/", self.timeout)
        ranks = job.ranks()
        os.killpg(job.proc.pid, signal.SIGKILL)  # the launcher's process group (not the ranks')
        time.sleep(5)
        alive = [p for p in ranks if _alive(p)]
        for p in alive:
            os.kill(p, signal.SIGKILL)
        job.wait(10)
        self.record("SIGKILL of the launcher", "no rank alive after 5 s",
                    f"{len(alive)} of {len(ranks)} ranks alive", bool(ranks) and not alive, 5.0)

    def lock(self):
        root = os.path.join(self.work, "ck_lock")
        first = Job(self, TINY + MOCK + ["--train-iters", "100000", "--save", root])
        first.wait_for("iteration        2/", self.timeout)
        code, text, secs = self.run(TINY + MOCK + ["--train-iters", "2", "--save", root,
                                                   "--save-interval", "1"])
        lines = _error_lines(text)
        refused = code not in (0, None) and len(lines) == 1 and "in use by another running job" in lines[0]
        first.kill()
        self.record("second job on the same --save", "refused with one line",
                    (lines[0][:110] + "...") if lines else f"exit {code}", refused, secs)
        code, text, secs = self.run(TINY + MOCK + ["--train-iters", "1", "--save", root,
                                                   "--save-interval", "1"])
        ok = code == 0 and "took over the stale checkpoint lock" in text
        self.record("job after the lock holder was killed", "takes the stale lock over with a note",
                    f"exit {code}, note: {'took over' in text}", ok, secs)

    def empty_data(self):
        prefix = self.dataset()
        data = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "400",
                "--data-cache-path", os.path.join(self.work, "cache")]
        code, text, secs = self.run(TINY + data + ["--train-iters", "2", "--data-path", prefix,
                                                   "--split", "0,100,0"])
        lines = _error_lines(text)
        ok = code not in (0, None) and lines and all("leaves the train split no documents" in x
                                                     for x in lines) and not _rank_traceback(text)
        self.record("--split 0,100,0", "one clear line per rank, no traceback",
                    (lines[0][:110] + "...") if lines else f"exit {code}", ok, secs)

    def links(self):
        """Symbolic links planted in --save, pointing outside it: the lock and the tracker
        are refused in one line; a stale .tmp link is removed itself. No target changes."""
        outside = os.path.join(self.work, "outside.txt")
        outside_dir = os.path.join(self.work, "outside_dir")
        os.makedirs(outside_dir, exist_ok=True)
        for name, what in ((".megaq_job.lock", "job lock"),
                           ("latest_checkpointed_iteration.txt", "tracker")):
            root = os.path.join(self.work, f"ck_link_{what.split()[-1]}")
            os.makedirs(root, exist_ok=True)
            with open(outside, "w") as f:
                f.write("7\n")
            os.symlink(outside, os.path.join(root, name))
            code, text, secs = self.run(TINY + MOCK + ["--train-iters", "2", "--save", root,
                                                       "--save-interval", "1"])
            lines = _error_lines(text)
            untouched = open(outside).read() == "7\n"
            ok = (code not in (0, None) and len(lines) == 1 and "is a symbolic link" in lines[0]
                  and name in lines[0] and untouched and not _rank_traceback(text))
            self.record(f"--save holds a symlinked {what}", "refused in one line; target untouched",
                        (lines[0][:110] + "...") if lines else f"exit {code}, no error line", ok, secs)
        root = os.path.join(self.work, "ck_link_tmp")
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(outside_dir, "keep.bin"), "w") as f:
            f.write("keep")
        os.symlink(outside_dir, os.path.join(root, ".iter_0000009.tmp"))
        code, text, secs = self.run(TINY + MOCK + ["--train-iters", "1", "--save", root,
                                                   "--save-interval", "1"])
        gone = not os.path.lexists(os.path.join(root, ".iter_0000009.tmp"))
        kept = os.path.exists(os.path.join(outside_dir, "keep.bin"))
        ok = code == 0 and gone and kept and "removed 1 unfinished save(s)" in text
        self.record("--save holds a symlinked stale .iter_*.tmp", "the link removed, its target kept",
                    f"exit {code}, link gone: {gone}, target kept: {kept}", ok, secs)

    def non_finite(self):
        """inf / nan settings: one line each before any step. Then weights that overflow
        (a resume with SGD at --lr 1e38): the save is refused and latest stays."""
        t0, good, cases = time.monotonic(), 0, [("--lr", "inf"), ("--lr", "nan"),
                                                ("--weight-decay", "nan"), ("--clip-grad", "inf")]
        for flag, value in cases:
            code, text, _ = self.run(TINY + MOCK + ["--train-iters", "2", f"{flag}={value}"])
            lines = _error_lines(text)
            good += (code not in (0, None) and len(lines) >= 1 and all(flag in x for x in lines)
                     and "not a finite number" in lines[0] and "iteration " not in text)
        self.record("--lr inf, --lr nan, --weight-decay nan, --clip-grad inf",
                    "one line each, before any step", f"{good} of {len(cases)}",
                    good == len(cases), time.monotonic() - t0)
        root = os.path.join(self.work, "ck_overflow")
        sgd = ["--optimizer", "sgd", "--save", root, "--save-interval", "1"]
        self.run(TINY + MOCK + ["--train-iters", "1"] + sgd)
        flags = [f if f != "1e-3" else "1e38" for f in TINY] + MOCK + sgd + [
            "--train-iters", "3", "--load", root, "--weight-decay", "100",
            "--override-opt_param-scheduler"]
        code, text, secs = self.run(flags)
        lines = _error_lines(text)
        ok = (code not in (0, None) and len(lines) == 1 and "the weights hold inf or nan" in lines[0]
              and _tracker(root) == 1)
        self.record("weights overflow to inf (SGD, --lr 1e38)", "save refused, latest stays 1",
                    f"exit {code}, {len(lines)} line(s), latest {_tracker(root)}", ok, secs)

    def dead_rank(self):
        """SIGKILL of one rank while training, the ranks posing as 2 nodes: every survivor
        prints one line naming it, no Python traceback reaches the terminal, the job ends."""
        victim = min(2, self.nproc - 1)
        job = Job(self, TINY + MOCK + ["--train-iters", "100000", "--gpus-per-node",
                                       str(max(1, self.nproc // 2))])
        job.wait_for("iteration        3/", self.timeout)
        pid = job.rank_pid(victim)
        ranks = job.ranks()
        t0 = time.monotonic()
        if pid:
            os.kill(pid, signal.SIGKILL)
        code = job.wait(60)
        ended = time.monotonic() - t0
        if code is None:
            job.kill()
        text = job.text()
        lines = _error_lines(text)
        named = [x for x in lines if f"lost rank {victim} (node " in x]
        alive = [p for p in ranks if _alive(p)]
        ok = (bool(pid) and code not in (0, None) and len(named) == self.nproc - 1
              and len(lines) == len(named) and not _rank_traceback(text) and not alive)
        self.record(f"SIGKILL of rank {victim} (of {self.nproc}, 2 nodes)",
                    "each survivor names it in one line, no traceback",
                    f"{len(named)} of {self.nproc - 1} survivors named it, ended after "
                    f"{ended:.1f} s, traceback: {_rank_traceback(text)}, alive: {len(alive)}",
                    ok, ended)


def table(rows: list[dict], width: int = 90) -> str:
    """The results as a Markdown table (observed cut to `width` characters)."""
    w = [max(len("trial"), *(len(r["trial"]) for r in rows)),
         max(len("expected"), *(len(r["expected"]) for r in rows)),
         min(width, max(len("observed"), *(len(r["observed"]) for r in rows)))]
    out = [f"| {'trial':<{w[0]}} | {'expected':<{w[1]}} | {'observed':<{w[2]}} | result | s |",
           f"|{'-' * (w[0] + 2)}|{'-' * (w[1] + 2)}|{'-' * (w[2] + 2)}|--------|---|"]
    for r in rows:
        out.append(f"| {r['trial']:<{w[0]}} | {r['expected']:<{w[1]}} | "
                   f"{r['observed'][:w[2]]:<{w[2]}} | {'pass' if r['passed'] else 'FAIL':<6} | "
                   f"{r['seconds']:.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", default=None,
                   help="command that starts the ranks and is given the flags ({script} = "
                        "pretrain_gpt.py); default: torchrun --standalone on this machine")
    p.add_argument("--nproc", type=int, default=4, help="ranks (the last one holds the "
                   "file that only it reads)")
    p.add_argument("--repeats", type=int, default=5, help="runs of the rank-only error trial")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launcher run")
    p.add_argument("--only", default=None, help="comma-separated trial names (methods)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    a = p.parse_args(argv)
    launcher = a.launcher or (f"{shlex.quote(sys.executable)} -m torch.distributed.run --standalone "
                              f"--nproc_per_node {a.nproc} {{script}}")
    if "{script}" not in launcher and "launch_local.sh" not in launcher:
        launcher += " {script}"
    work = tempfile.mkdtemp(prefix="megaq_fault_trials_")
    t = Trials(launcher, a.nproc, work, a.timeout)
    names = ["rank3_only_error", "damaged_files", "crafted_checkpoint", "disk_full",
             "save_sigkill", "nan_streak", "sigint", "sigstop", "launcher_sigkill", "lock",
             "empty_data", "links", "non_finite", "dead_rank"]
    if a.only:
        names = [n for n in a.only.split(",") if n]
    print(f"fault trials: launcher `{launcher}`, {a.nproc} ranks, work dir {work}", flush=True)
    t0 = time.monotonic()
    for n in names:
        try:
            getattr(t, n)(a.repeats) if n == "rank3_only_error" else getattr(t, n)()
        except Exception as e:  # noqa: BLE001 - a trial that could not run is a failure
            t.record(n, "runs", f"could not run: {type(e).__name__}: {str(e)[:200]}", False, 0.0)
        finally:
            for job in t.jobs:
                if job.proc.poll() is None:
                    job.kill()
    rows = t.results
    print()
    print(table(rows))
    passed = sum(r["passed"] for r in rows)
    print(f"\n{passed} of {len(rows)} trials passed in {time.monotonic() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"launcher": launcher, "nproc": a.nproc, "repeats": a.repeats,
                       "trials": rows}, f, indent=1)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
