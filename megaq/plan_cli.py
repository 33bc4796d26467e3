"""tools/plan.py and pretrain_gpt.py --dry-run: the planner on the command line.

Both read pretrain_gpt.py's own flags (the parser of megaq.config.arguments, so a flag means
the same thing in both) plus the hardware flags (megaq.planner.run.HardwareFlags), and
print the plan of megaq.planner.step.predict as a table or, with --json, one object.
tools/plan.py --search ranks layouts and switches instead (megaq.planner.search).
Bad input is one ``error:`` line and exit 2; a plan that does not fit exits 2 as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys

from megaq.config.arguments import (CONFIG_ERRORS, ArgumentsError, build_parser,
                                    deepspeed_problems)
from megaq.config.run import RunConfig
from megaq.config.flags import from_flags
from megaq.config.megatron_flags import megatron_flag_problems
from megaq.planner.calibration import CalibrationError, load_calibration
from megaq.planner.hardware import HardwareError, gpu_preset
from megaq.planner.report import render_prediction, render_search
from megaq.planner.run import HardwareFlags, cluster_of_run
from megaq.planner.search import search, why_best
from megaq.planner.step import DEFAULT_VOCAB, PlanError, PlanInput, predict

PLAN_ERRORS = CONFIG_ERRORS + (ArgumentsError, HardwareError, PlanError, CalibrationError)

# `tools/plan.py NAME ...` runs main(argv) of the module named here (the calibration
# fitter and the validation against measured runs live in their own modules).
# the commands that fit and check the model (megaq.planner.tasks), by module
SUBCOMMANDS: dict[str, str] = {name: "megaq.planner.tasks"
                               for name in ("calibrate", "validate", "published", "scale")}

DESCRIPTION = ("Predict megaq's step time, throughput and memory per GPU for a run on a "
               "cluster, from pretrain_gpt.py's own flags and a hardware description; "
               "--search ranks layouts and ZeRO++ switches instead.")


def plan_parser() -> argparse.ArgumentParser:
    subs = f" Subcommands: {', '.join(sorted(SUBCOMMANDS))} (tools/plan.py NAME --help)." \
        if SUBCOMMANDS else ""
    p = build_parser(prog="tools/plan.py", description=DESCRIPTION + subs, dry_run=False)
    for action in p._actions:  # a plan needs no learning rate; --search picks the micro-batch
        if action.dest in ("lr", "micro_batch_size"):
            action.required = False
            action.default = 1e-4 if action.dest == "lr" else 1
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of "
                   "the table (keys step_time_s, tokens_per_s, tflops_per_gpu, mfu, "
                   "memory_gib, fits and the breakdowns)")
    g.add_argument("--search", action="store_true", help="rank TP, PP, virtual stages, "
                   "micro-batch, recompute, ZeRO stage and the ZeRO++ switches by predicted "
                   "throughput among the plans that fit (the layout, batch-split, recompute "
                   "and --zero-* flags given are ignored; --global-batch-size is kept)")
    g.add_argument("--top", type=int, default=10, help="plans listed by --search")
    g.add_argument("--calibration", metavar="JSON", help="efficiency tables to use (default: "
                   "the committed H200 calibration)")
    return p


def _run_config(flags, world: int, ranks_per_node: int) -> RunConfig:
    """The run's configuration; data flags are irrelevant to a plan (synthetic data)."""
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path",
                 "demo_corpus"):
        setattr(flags, name, None)
    flags.user_mock_data, flags.mock_data = flags.mock_data, True
    if flags.train_iters is None and flags.train_samples is None:
        flags.train_iters = 1
    ds_problems, _ = deepspeed_problems(flags, world, ranks_per_node)  # a ds_config's flags
    if ds_problems:
        raise ArgumentsError(ds_problems[0])
    refusals, _ = megatron_flag_problems(flags)  # first: its aliases set megaq's flags
    try:
        run = RunConfig.from_flags(flags, world, ranks_per_node)
    except CONFIG_ERRORS as e:
        raise ArgumentsError(str(e)) from None
    if refusals:
        raise ArgumentsError(refusals[0])
    return run


def _plan_input(run: RunConfig, flags) -> PlanInput:
    """The plan's input; the vocabulary from --vocab-size (or --mock-data's), else assumed."""
    if flags.vocab_size or flags.user_mock_data:
        return PlanInput.from_config(run, vocab_size=flags.vocab_size)
    return dataclasses.replace(PlanInput.from_config(run, vocab_size=DEFAULT_VOCAB),
                               vocab_assumed=True)


def plan_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[0], argv[1:])
    try:
        flags = plan_parser().parse_args(argv)
        hw = from_flags(HardwareFlags, flags)
        gpu = gpu_preset(hw.preset)
        per_node = flags.gpus_per_node or gpu.gpus_per_node
        nodes = hw.num_nodes or 1
        if flags.top < 1:
            raise ArgumentsError(f"--top must be >= 1 (got {flags.top})")
        cal = load_calibration(flags.calibration)
        if flags.search:
            return _search(flags, hw, nodes, per_node, cal)
        run = _run_config(flags, nodes * per_node, per_node)
        cluster = cluster_of_run(run, hw)
        pi = _plan_input(run, flags)
        pred = predict(pi, cluster, cal)
    except PLAN_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(pred.dumps() if flags.json else render_prediction(pred, pi, cluster))
    if not pred.fits:
        print(f"error: the plan needs {pred.memory_gib:.1f} GiB per GPU and "
              f"{cluster.gpu.name} has {pred.hbm_gib:.1f} GiB; recompute activations, use "
              f"ZeRO-3, a larger TP / PP, a smaller micro-batch or more nodes "
              f"(tools/plan.py --search finds one)", file=sys.stderr)
        return 2
    return 0


def _search(flags, hw: HardwareFlags, nodes: int, per_node: int, cal) -> int:
    # the model, batch and precision as given; the layout searched (TP 1 parses anywhere)
    for name, value in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
                        ("num_layers_per_virtual_pipeline_stage", None), ("zero_stage", 3),
                        ("zero_hpz_partition_size", 1), ("zero_quantized_weights", None),
                        ("zero_quantized_gradients", False), ("zero_weight_deltas", False),
                        ("recompute_granularity", None), ("recompute_method", None),
                        ("recompute_num_layers", None), ("recompute_activations", False),
                        ("micro_batch_size", 1), ("global_batch_size", flags.global_batch_size
                                                  or nodes * per_node)):
        setattr(flags, name, value)
    run = _run_config(flags, nodes * per_node, per_node)
    cluster = hw.cluster(nodes, per_node)
    pi = _plan_input(run, flags)
    model = dataclasses.replace(pi.model, sequence_parallel=False)
    plans = search(model, pi.global_batch_size, pi.seq_length, cluster, cal, bf16=pi.bf16,
                   zero=pi.zero)
    if not plans:
        raise PlanError(f"no layout of this {pi.model.num_layers}-layer model fits on "
                        f"{cluster.describe()} with global batch {pi.global_batch_size}; "
                        f"add nodes, use a GPU with more memory, or shorten --seq-length")
    reason = why_best(plans)
    if flags.json:
        print(json.dumps({"reason": reason, "plans": [
            {"name": p.name, "flags": p.flags, **p.prediction.to_json()}
            for p in plans[:flags.top]]}, indent=1))
    else:
        print(render_search(plans, reason, cluster, flags.top))
    return 0


def dry_run(run: RunConfig, flags) -> int:
    """pretrain_gpt.py --dry-run: the plan of this run's own flags; 0 when it fits."""
    try:
        hw = from_flags(HardwareFlags, flags)
        cluster = cluster_of_run(run, hw)
        pi = PlanInput.from_config(run)
        pred = predict(pi, cluster, load_calibration())
    except PLAN_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render_prediction(pred, pi, cluster), flush=True)
    if not pred.fits:
        print(f"error: the run needs {pred.memory_gib:.1f} GiB per GPU and {cluster.gpu.name} "
              f"has {pred.hbm_gib:.1f} GiB (tools/plan.py --search finds a layout that fits)",
              file=sys.stderr)
        return 2
    return 0
