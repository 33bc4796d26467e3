"""The hang watchdog's bound and its abort (megaq.runtime.watchdog); the end-to-end case, a
SIGSTOPped rank ending the job, is in tests/test_reliability.py."""

import os
import time

import pytest

from megaq.runtime import failure, watchdog
from megaq.testing.ranks import run_cli_on_ranks


def test_default_bound_adapts_to_the_slowest_iteration_with_a_floor():
    w = watchdog.Watchdog(rank=0, floor_minutes=0.01, factor=5.0)
    assert w.bound_seconds() == 0.6  # before any iteration: the floor
    w._last -= 2.0
    w.beat(1)  # a 2 s iteration
    assert 1.99 < w.slowest < 2.5 and w.bound_seconds() == 5.0 * w.slowest
    w.beat(2)  # a fast one does not lower it
    assert w.bound_seconds() == 5.0 * w.slowest and w.iteration == 2
    assert watchdog.Watchdog(rank=0, timeout_minutes=0.5).bound_seconds() == 30.0


def test_abort_prints_rank_iteration_last_collective_and_every_thread():
    def entry(argv):
        import threading
        from megaq.parallel import comm
        comm.barrier()  # not initialised: records the entry and returns
        w = watchdog.start(rank=5, timeout_minutes=0.01)
        w.beat(7)
        threading.Thread(target=time.sleep, args=(60,), name="a-helper", daemon=True).start()
        time.sleep(30)  # "hangs": no more beats
        return 0

    t0 = time.monotonic()
    r = run_cli_on_ranks(entry, [], 1, timeout=60)
    assert r["codes"] == [watchdog.EXIT_CODE], r
    assert time.monotonic() - t0 < 20
    first = r["stderr"].splitlines()[0]
    assert first.startswith("[rank 5] error: hang watchdog: no iteration completed for")
    assert "last completed iteration: 7" in first and "last collective entered: barrier" in first
    assert "Thread" in r["stderr"] and r["stderr"].count("File ") >= 2  # more than one stack


def test_error_lines():
    assert failure.error_line(ValueError("bad\nflag"), 3, 4) == "[rank 3] error: bad flag"
    assert failure.error_line(ValueError("bad"), 0, 1) == "error: bad"
    agreed = failure.AgreedError("x.pt is damaged", origin_rank=3, kind="CheckpointError",
                                 world_size=4)
    assert failure.error_line(agreed, 0, 4) == "error: x.pt is damaged (found on rank 3)"
    from megaq.training import TrainingDiverged
    assert failure.error_line(TrainingDiverged("stopping"), 2, 4) == "error: stopping"


def test_agreed_block_on_one_process_raises_the_error_and_cleans_up(tmp_path):
    marker = tmp_path / "cleaned"
    with pytest.raises(failure.AgreedError) as e:
        with failure.agreed(None, catch=(OSError,), on_failure=lambda: marker.write_text("1")):
            raise OSError("disk on fire")
    assert str(e.value) == "disk on fire" and e.value.origin_rank == 0 and e.value.kind == "OSError"
    assert os.path.exists(marker)
