"""pretrain_gpt.py with its training steps under cProfile on chosen ranks, timed by the
main thread's CPU clock.

Launched by torchrun in place of pretrain_gpt.py (tools/cluster/netns_step_profile.py
does it). Ranks listed in MEGAQ_PROFILE_RANKS (comma list, default "0") profile every
Trainer.train_step after the first (the warm-up: first gathers, full-precision
reference syncs) and write MEGAQ_PROFILE_OUT.r<rank> (pstats) and .r<rank>.json (each
profiled step's CPU seconds: the main thread's and the whole process's). The clock is time.thread_time: the main thread's CPU
time, so waiting on a collective costs nothing and gloo's own transport threads are not
charged to whatever the main thread runs meanwhile.
"""

import cProfile
import functools
import json
import os
import sys
import time

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
from megaq import training  # noqa: E402
from megaq.pretrain import cli, exit_now  # noqa: E402


def profile_steps(prof: cProfile.Profile, step_cpu_s: list, step_process_cpu_s: list) -> None:
    """Wrap Trainer.train_step: every call after the first runs under `prof`; its
    main-thread CPU seconds are appended to step_cpu_s, and the whole process's (gloo's
    transport threads included: they copy every byte through the TCP stack, the
    loopback's as well as the link's) to step_process_cpu_s."""
    inner = training.Trainer.train_step
    calls = [0]

    @functools.wraps(inner)
    def train_step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            return inner(self, *args, **kwargs)
        t0, p0 = time.thread_time(), time.process_time()
        prof.enable()
        try:
            return inner(self, *args, **kwargs)
        finally:
            prof.disable()
            step_cpu_s.append(time.thread_time() - t0)
            step_process_cpu_s.append(time.process_time() - p0)

    training.Trainer.train_step = train_step


if __name__ == "__main__":
    rank = int(os.environ.get("RANK", "0"))
    ranks = {int(r) for r in os.environ.get("MEGAQ_PROFILE_RANKS", "0").split(",") if r}
    out = os.environ.get("MEGAQ_PROFILE_OUT")
    if rank not in ranks or not out:
        exit_now(cli(sys.argv[1:]))
    prof, steps, process_steps = cProfile.Profile(time.thread_time), [], []
    profile_steps(prof, steps, process_steps)
    rc = cli(sys.argv[1:])
    prof.dump_stats(f"{out}.r{rank}")
    with open(f"{out}.r{rank}.json", "w") as f:
        json.dump({"step_cpu_s": steps, "step_process_cpu_s": process_steps}, f)
    exit_now(rc)
