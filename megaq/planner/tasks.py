"""tools/plan.py's subcommands that fit and check the model: calibrate, validate, published, scale.

Each prints a table and writes its JSON (temp name, then rename: nothing half-written);
bad input is one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SUBCOMMANDS = ("calibrate", "validate", "published", "scale")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise TaskError(f"{self.prog}: {message}")


class TaskError(ValueError):
    """A subcommand's bad input: one `error:` line."""


def _parser(name: str) -> _Parser:
    from megaq.planner import calibrate, published, scale, validate
    prog = f"tools/plan.py {name}"
    if name == "calibrate":
        p = _Parser(prog=prog, description="Fit the step model's efficiency tables from "
                    "bench_train.py / bench_kernels.py JSON and write the calibration file.")
        train, kernels, emulated = calibrate.default_files()
        p.add_argument("--bench-train", nargs="+", default=train, metavar="F.json",
                       help="bench_train.py results (default: the committed H200 files the "
                            "calibration is fitted on)")
        p.add_argument("--bench-kernels", nargs="+", default=kernels, metavar="F.json",
                       help="bench_kernels.py results (default: kernels_h200.json)")
        p.add_argument("--emulated", default=emulated, metavar="F.json",
                       help="the emulated-cluster benchmark whose ZeRO-3 rows fit the emulated "
                            "link (default: emulated_cluster_gpu.json), with the host time per "
                            "step of the GPU-rank step profile beside it "
                            "(emulated_step_profile_gpu.json) when there is one; 'none' to skip")
        p.add_argument("-o", "--out", required=True, metavar="F.json",
                       help="calibration file to write (the committed one: "
                            "megaq/planner/calibration_h200.json)")
    elif name == "validate":
        p = _Parser(prog=prog, description="Replay the project's measured runs against the "
                    "model: predicted / measured per row, with each row's bound.")
        p.add_argument("--calibration", metavar="F.json", help="default: the committed H200 one")
        p.add_argument("--out", default=validate.OUT, metavar="F.json",
                       help="JSON to write (default: %(default)s)")
    elif name == "published":
        p = _Parser(prog=prog, description="Predict the ZeRO++ blog's ZeRO++ / ZeRO-3 speedups "
                    "on 384 V100s from the hardware description alone; compare cell by cell.")
        p.add_argument("--calibration", metavar="F.json", help="default: the committed H200 one")
        p.add_argument("--out", default=published.OUT, metavar="F.json",
                       help="JSON to write (default: %(default)s)")
    else:
        p = _Parser(prog=prog, description="Internet scale on paper: 1,024-16,384 GPUs, "
                    "10-100 Gbit/s per node between sites; where each configuration stops "
                    "scaling and what limits it next.")
        p.add_argument("--calibration", metavar="F.json", help="default: the committed H200 one")
        p.add_argument("--out", default=scale.OUT, metavar="F.json",
                       help="JSON to write; the plot goes beside it as .png (default: %(default)s)")
    return p


def _write_json(path: str, doc: dict) -> None:
    from megaq.planner.calibrate import write_atomic
    write_atomic(path, json.dumps(doc, indent=1) + "\n")


def run(name: str, argv: list[str]) -> int:
    from megaq.planner import calibrate, published, scale, validate
    from megaq.planner.calibration import load_calibration
    a = _parser(name).parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir):  # before the work, not after it
        flag = "-o" if name == "calibrate" else "--out"
        raise TaskError(f"{flag} {a.out}: directory {out_dir} does not exist; create it "
                        "or name a file in an existing one")
    if name == "calibrate":
        emulated = None if a.emulated == "none" else a.emulated
        cal, extra = calibrate.fit(a.bench_train, a.bench_kernels, emulated)
        calibrate.write_atomic(a.out, calibrate.calibration_json(cal, extra))
        print(json.dumps({k: v for k, v in cal.to_json().items() if k != "source"}, indent=1))
        print(f"wrote {a.out}")
        return 0
    cal = load_calibration(a.calibration)
    if name == "validate":
        link = None
        if a.calibration:
            with open(a.calibration) as f:
                link = json.load(f).get("emulated_link")
        doc = validate.validate(cal, link)
        print(validate.table(doc))
    elif name == "published":
        doc = published.published_check(cal)
        print(published.table(doc))
    else:
        doc = scale.study(cal)
        print(scale.table(doc))
        scale.plot(doc, os.path.splitext(a.out)[0] + ".png")
    _write_json(a.out, doc)
    print(f"wrote {a.out}")
    return 0


def main(name: str, argv: list[str]) -> int:
    """Run subcommand `name` with its flags. Errors: one line on stderr, status 2."""
    from megaq.planner.bench_rows import BenchFileError
    from megaq.planner.calibrate import CalibrateError, RunFlagsError
    from megaq.planner.calibration import CalibrationError
    from megaq.planner.hardware import HardwareError
    from megaq.planner.published import PublishedError
    try:
        return run(name, argv)
    except (TaskError, BenchFileError, CalibrateError, CalibrationError, HardwareError,
            PublishedError, RunFlagsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
