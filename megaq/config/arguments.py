"""Megatron-LM compatible command-line flags -> one validated megaq.config.run.RunConfig.

Flag names follow Megatron-LM's pretrain_gpt.py (users bring their scripts), plus
megaq's own: ZeRO / ZeRO++ switches (DeepSpeed's names), --gpus-per-node (the node
map, so one machine can pose as several nodes), --metrics-file, --demo-corpus.

The parser is generated from the configuration classes (megaq.config.run.FLAG_CLASSES):
each flag is a field of the class it configures, with its help and default (see
megaq.config.flags), so adding a flag is adding a field there; nothing here changes. After
them come the rest of Megatron-LM's dense-GPT flags (megaq.config.megatron_flags), so a
Megatron-LM launch script parses unchanged: a flag that means nothing for megaq is
accepted (rank 0 prints one note naming them all; --quiet-notes hides it), a flag for a
feature megaq lacks is refused with one line naming it. run_problems collects every
problem (pretrain_gpt.py --dry-run prints them all, argparse's own among them:
_Parser.parse_all); parse_config raises the first.

Every refusal is an :class:`ArgumentsError` whose message is one line naming the flag
and the fix; the command-line entry prints it as ``error: ...`` and exits with 2.
Validation that needs the world size (batch divisibility, layouts) takes it as an
argument, so the same function serves torchrun, slurm and in-process test ranks.
"""

from __future__ import annotations

import argparse
import os
import sys

from megaq.config.flags import add_flags, dest, flag_fields
from megaq.config import megatron_flags
from megaq.config.megatron_flags import add_megatron_flags, megatron_flag_problems
from megaq.config.run import CONFIG_ERRORS, FLAG_CLASSES, RunConfig
from megaq.data.errors import ArgumentParser
from megaq.planner.run import add_planning_flags

__all__ = ["CONFIG_ERRORS", "ArgumentsError", "build_parser", "parse_config", "run_problems"]


class ArgumentsError(ValueError):
    """A bad flag or flag combination; the message says which flag and the fix."""


class _Parser(ArgumentParser):
    error_class = ArgumentsError  # one line the CLI prints, an exception a test can catch
    _bad_values: list[str] | None = None  # set by parse_all while it parses
    _given: set[str] | None = None

    def parse_all(self, argv: list[str] | None = None):
        """(flags or None, problems): parse for --dry-run, listing every problem argparse
        finds, one line each in its own words, where parse_args stops at the first. A
        bad value (an invalid choice, a wrong type) leaves its flag at the default, an
        unknown flag is skipped, a missing required flag is listed, and a flag that
        cannot be read at all (a missing value, a conflict) is dropped and the rest
        parsed again. The flags are None only when argparse could not go on."""
        args = list(sys.argv[1:] if argv is None else argv)
        required = [a for a in self._actions if a.required]
        problems: list[str] = []
        exit_on_error = self.exit_on_error
        try:
            self.exit_on_error = False  # an ArgumentError names the flag to drop
            for a in required:
                a.required = False  # listed below, after the other flags were read
            for _ in range(len(args) + 1):
                self._bad_values, self._given = [], set()
                try:
                    flags, unknown = self.parse_known_args(args)
                except argparse.ArgumentError as e:
                    problems.append(f"{e} (see --help)")
                    drop = _unreadable_flag(args, (e.argument_name or "").split("/"))
                    if drop is None:
                        break
                    del args[drop]
                    continue
                except ArgumentsError as e:  # argparse stopped without naming a flag
                    problems.append(str(e))
                    break
                problems += self._bad_values
                if unknown:
                    problems.append(f"unrecognized arguments: {' '.join(unknown)} (see --help)")
                missing = [a for a in required if a.dest not in self._given]
                if missing:
                    problems.append("the following arguments are required: " + ", ".join(
                        "/".join(a.option_strings) for a in missing) + " (see --help)")
                return flags, list(dict.fromkeys(problems))
            return None, list(dict.fromkeys(problems))
        finally:
            self.exit_on_error = exit_on_error
            for a in required:
                a.required = True
            self._bad_values = self._given = None

    def _get_values(self, action, arg_strings):
        """argparse's conversion of one flag's values; in parse_all a bad value is a
        problem line and the flag keeps its default."""
        if self._bad_values is None:
            return super()._get_values(action, arg_strings)
        self._given.add(action.dest)
        try:
            return super()._get_values(action, arg_strings)
        except argparse.ArgumentError as e:
            self._bad_values.append(f"{e} (see --help)")
            return action.default


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default when it has a meaningful one (not None / False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default is not None
                and action.default is not False and action.default is not argparse.SUPPRESS
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


# the configuration's own default of each required flag: what --dry-run checks the other
# flags against when that flag is missing or unreadable (its own line says so)
_REQUIRED_STAND_INS = {dest(f): f.default for cls in FLAG_CLASSES for f in flag_fields(cls)
                       if f.metadata["argparse"].get("required")}


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


def _unreadable_flag(args: list[str], names: list[str]) -> int | None:
    """The position of the flag argparse could not read: of its occurrences, the one
    with no value after it, else the last; None if it is not there as spelled."""
    hits = [i for i, a in enumerate(args) if a.split("=", 1)[0] in names]
    bare = [i for i in hits if i + 1 == len(args) or args[i + 1].startswith("--")]
    return (bare or hits or [None])[0 if bare else -1]


def default_world_size() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_problems(argv: list[str] | None = None, world_size: int | None = None,
                 ranks_per_node: int | None = None, *, parse_all: bool = False):
    """(config or None, parsed flags, problems, notes): every problem of the flags that
    can be found without stopping at the first (refused Megatron-LM flags, each
    configuration class's bad values, the checks across classes), one line each; and
    the note lines (megaq.config.megatron_flags). A flag argparse cannot parse (an
    unknown flag, a value of the wrong type, a missing required flag) raises
    ArgumentsError at once, or with `parse_all` (--dry-run) is one more line, the rest
    checked as if that flag were not given (flags None: argparse could not go on)."""
    problems: list[str] = []
    if parse_all:
        flags, problems = build_parser().parse_all(argv)
        if flags is None:
            return None, None, problems, []
        for name, value in _REQUIRED_STAND_INS.items():  # missing or bad: reported above
            if getattr(flags, name) is None:
                setattr(flags, name, value)
    else:
        flags = build_parser().parse_args(argv)
    refusals, notes = megatron_flag_problems(flags)  # first: its aliases set megaq's flags
    config = RunConfig.from_flags(flags, world_size or default_world_size(), ranks_per_node,
                                  problems=problems)
    # a flag megaq defines and refuses itself (--fp16) is reported once, in its own words
    problems += [r for r in refusals if not any(p.startswith(r.split(":")[0].split()[0])
                                                for p in problems)]
    return config, flags, problems, notes


def parse_config(argv: list[str] | None = None, world_size: int | None = None,
                 ranks_per_node: int | None = None, *, print_notes: bool = False) -> RunConfig:
    """Parse and validate. `world_size` defaults to torch.distributed's / $WORLD_SIZE.
    A bad or refused flag raises ArgumentsError (the first problem of run_problems);
    `print_notes` (rank 0) prints the notes (once per process; --quiet-notes: none)."""
    config, flags, problems, notes = run_problems(argv, world_size, ranks_per_node)
    if problems:
        raise ArgumentsError(problems[0])
    if print_notes:
        print_notes_once(flags, notes)
    return config


def print_notes_once(flags, notes: list[str], print_fn=None) -> list[str]:
    """Print the notes not printed before in this process, unless --quiet-notes."""
    return megatron_flags.print_notes(notes, quiet=flags.quiet_notes,
                                      print_fn=print_fn or (lambda line: print(line, flush=True)))
