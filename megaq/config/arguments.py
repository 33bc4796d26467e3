"""Megatron-LM compatible command-line flags -> one validated megaq.config.run.RunConfig.

Flag names follow Megatron-LM's pretrain_gpt.py (users bring their scripts), plus
megaq's own: ZeRO / ZeRO++ switches (DeepSpeed's names), --gpus-per-node (the node
map, so one machine can pose as several nodes), --metrics-file, --demo-corpus.

The parser is generated from the configuration classes (megaq.config.run.FLAG_CLASSES):
each flag is a field of the class it configures, with its help and default (see
megaq.config.flags), so adding a flag is adding a field there; nothing here changes. After
them come the rest of Megatron-LM's dense-GPT flags (megaq.config.megatron_flags), so a
Megatron-LM launch script parses unchanged: a flag that means nothing for megaq is
accepted with a note (printed once, by rank 0), a flag for a feature megaq lacks is
refused with one line naming it.

Every refusal is an :class:`ArgumentsError` whose message is one line naming the flag
and the fix; the command-line entry prints it as ``error: ...`` and exits with 2.
Validation that needs the world size (batch divisibility, layouts) takes it as an
argument, so the same function serves torchrun, slurm and in-process test ranks.
"""

from __future__ import annotations

import argparse
import os

from megaq.config.flags import add_flags
from megaq.config.megatron_flags import (add_megatron_flags, check_megatron_flags,
                                         print_megatron_notes)
from megaq.config.run import FLAG_CLASSES, ConfigError, RunConfig
from megaq.data.errors import ArgumentParser, DataError
from megaq.model import ModelConfigError
from megaq.parallel.pipeline import PipelineConfigError
from megaq.parallel.topology import LayoutError
from megaq.planner.run import add_planning_flags
from megaq.zero import ZeroConfigError

# What building a RunConfig may raise for a bad flag (each class checks its own values).
CONFIG_ERRORS = (ConfigError, DataError, LayoutError, ModelConfigError, PipelineConfigError,
                 ZeroConfigError)


class ArgumentsError(ValueError):
    """A bad flag or flag combination; the message says which flag and the fix."""


class _Parser(ArgumentParser):
    error_class = ArgumentsError  # one line the CLI prints, an exception a test can catch


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default when it has a meaningful one (not None / False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default is not None
                and action.default is not False and action.default is not argparse.SUPPRESS
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


def build_parser(prog: str = "pretrain_gpt.py", description: str | None = None, *,
                 dry_run: bool = True) -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser (tools/plan.py's with its own prog and description and
    no --dry-run)."""
    p = _Parser(prog=prog, formatter_class=_HelpFormatter,
                description=description or "Pretrain a GPT / Llama-style model with TP, PP and "
                                           "ZeRO-3 / ZeRO++ data parallelism (Megatron-LM "
                                           "compatible flags).")
    for cls in FLAG_CLASSES:
        add_flags(p, cls)
    add_megatron_flags(p)  # the Megatron-LM flags megaq accepts with a note, or refuses
    add_planning_flags(p, dry_run)  # the machine of --dry-run's plan (megaq.planner)
    return p


def default_world_size() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_config(argv: list[str] | None = None, world_size: int | None = None,
                 ranks_per_node: int | None = None, *, print_notes: bool = False) -> RunConfig:
    """Parse and validate. `world_size` defaults to torch.distributed's / $WORLD_SIZE.
    A refused Megatron-LM flag raises ArgumentsError; `print_notes` (rank 0) prints the
    notes of the accepted-and-ignored ones, each once per process."""
    flags = build_parser().parse_args(argv)
    try:
        config = RunConfig.from_flags(flags, world_size or default_world_size(), ranks_per_node)
    except CONFIG_ERRORS as e:
        raise ArgumentsError(str(e)) from None
    # after the configuration's own checks, which word a refusal of a flag it defines
    # (--fp16) themselves
    check_megatron_flags(flags, ArgumentsError)
    if print_notes:
        print_megatron_notes(flags, ArgumentsError, print_fn=lambda line: print(line, flush=True))
    return config
