"""Megatron-LM compatible command-line flags -> one validated megaq.config.RunConfig.

Flag names follow Megatron-LM's pretrain_gpt.py (users bring their scripts), plus
megaq's own: ZeRO / ZeRO++ switches (DeepSpeed's names), --gpus-per-node (the node
map, so one machine can pose as several nodes), --metrics-file, --demo-corpus.

The parser is generated from the configuration classes (megaq.config.FLAG_CLASSES):
each flag is a field of the class it configures, with its help and default (see
megaq.flags), so adding a flag is adding a field there; nothing here changes.

Every refusal is an :class:`ArgumentsError` whose message is one line naming the flag
and the fix; the command-line entry prints it as ``error: ...`` and exits with 2.
Validation that needs the world size (batch divisibility, layouts) takes it as an
argument, so the same function serves torchrun, slurm and in-process test ranks.
"""

from __future__ import annotations

import argparse
import os

from megaq.config import FLAG_CLASSES, ConfigError, RunConfig
from megaq.data.errors import DataError
from megaq.flags import add_flags
from megaq.model import ModelConfigError
from megaq.parallel.pipeline import PipelineConfigError
from megaq.parallel.topology import LayoutError
from megaq.zero import ZeroConfigError

# What building a RunConfig may raise for a bad flag (each class checks its own values).
CONFIG_ERRORS = (ConfigError, DataError, LayoutError, ModelConfigError, PipelineConfigError,
                 ZeroConfigError)


class ArgumentsError(ValueError):
    """A bad flag or flag combination; the message says which flag and the fix."""


class _Parser(argparse.ArgumentParser):
    # argparse prints usage + error and exits; we want one line and, in-process, an
    # exception the caller (or a test) can catch.
    def error(self, message):
        raise ArgumentsError(f"{message} (see --help)")


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default when it has a meaningful one (not None / False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default is not None
                and action.default is not False and action.default is not argparse.SUPPRESS
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", formatter_class=_HelpFormatter,
                description="Pretrain a GPT / Llama-style model with TP, PP and ZeRO-3 / ZeRO++ "
                            "data parallelism (Megatron-LM compatible flags).")
    for cls in FLAG_CLASSES:
        add_flags(p, cls)
    return p


def default_world_size() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_config(argv: list[str] | None = None, world_size: int | None = None,
                 ranks_per_node: int | None = None) -> RunConfig:
    """Parse and validate. `world_size` defaults to torch.distributed's / $WORLD_SIZE."""
    flags = build_parser().parse_args(argv)
    try:
        return RunConfig.from_flags(flags, world_size or default_world_size(), ranks_per_node)
    except CONFIG_ERRORS as e:
        raise ArgumentsError(str(e)) from None
