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
import contextlib
import os
import sys

from megaq.config.flags import add_flags, dest, flag_fields, from_flags
from megaq.config import deepspeed_config, megatron_flags
from megaq.config.megatron_flags import add_megatron_flags, megatron_flag_problems
from megaq.config.run import CONFIG_ERRORS, FLAG_CLASSES, RunConfig
from megaq.parallel.config import ParallelConfig
from megaq.data.errors import ArgumentParser
from megaq.planner.run import add_planning_flags

__all__ = ["CONFIG_ERRORS", "ArgumentsError", "build_parser", "parse_config", "run_problems"]


class ArgumentsError(ValueError):
    """A bad flag or flag combination; the message says which flag and the fix."""


_UNSET = object()  # a destination no flag wrote


class _Parser(ArgumentParser):
    """Raises ArgumentsError (one line the CLI prints, an exception a test can catch);
    reads --deepspeed-config FILE as flags placed before the command line's
    (megaq.config.deepspeed_config): every parse of the command line, by whichever
    caller, sees the file's values. The parsed flags then carry ``deepspeed`` (the file's
    path, its mapping and the flags given both ways with different values) for
    run_problems."""

    error_class = ArgumentsError

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        path = deepspeed_config.config_path(args)
        if path is None or deepspeed_config.FILE_FLAGS[0] not in self._option_string_actions:
            flags, extras = super().parse_known_args(args, namespace)
            if getattr(flags, "deepspeed_config", None) is not None:  # an abbreviation
                raise ArgumentsError("--deepspeed-config: spell the flag out in full "
                                     "(--deepspeed-config or --deepspeed_config FILE.json)")
            return flags, extras
        try:
            mapping = deepspeed_config.map_config(deepspeed_config.read_config(path))
        except deepspeed_config.DeepSpeedConfigError as e:
            raise ArgumentsError(str(e)) from None
        file_values = self._file_values(mapping)  # dest -> (value, key), the flags that parse
        given = self._given(args)
        conflicts = [f"{key} {_shown(value)} vs {self._flag_of(dest)} {_shown(given[dest])}"
                     for dest, (value, key) in file_values.items()
                     if dest in given and given[dest] != value]
        derives_micro = "train_batch_size" in mapping.batch  # filled in by run_problems
        with self._not_required({"micro_batch_size"} if derives_micro else set()):
            flags, extras = super().parse_known_args(mapping.tokens() + args, namespace)
        flags.deepspeed = DeepSpeedIntake(path, mapping, conflicts, set(given))
        return flags, extras

    def _file_values(self, mapping) -> dict:
        """Each of the file's flags parsed alone: dest -> (value, key). A value megaq's
        flag refuses (a choice it lacks) becomes a refusal of its key, so that every
        problem of the file is in its one refusal line."""
        values, kept = {}, []
        for name, value, key in mapping.flags:
            words = [name] if value is None else [name, deepspeed_config.flag_word(value)]
            try:
                parsed = self._given(words)
            except ArgumentsError as e:
                why = str(e).removesuffix(" (see --help)")
                mapping.refused.append(f"{key} {_shown(value)} ({why})")
                continue
            kept.append((name, value, key))
            values.update({dest: (v, key) for dest, v in parsed.items()})
        mapping.flags = kept
        return values

    def _given(self, words: list[str]) -> dict:
        """The destinations `words` write (required flags not required here)."""
        ns = argparse.Namespace(**{a.dest: _UNSET for a in self._actions
                                   if a.dest != argparse.SUPPRESS})
        with self._not_required({a.dest for a in self._actions}):
            ns, _ = super().parse_known_args(words, ns)
        return {k: v for k, v in vars(ns).items() if v is not _UNSET}

    @contextlib.contextmanager
    def _not_required(self, dests: set):
        """The flags of `dests` are optional inside (a file's words alone, or a micro-batch
        size the file derives later)."""
        actions = [a for a in self._actions if a.required and a.dest in dests]
        for a in actions:
            a.required = False
        try:
            yield
        finally:
            for a in actions:
                a.required = True

    def _flag_of(self, dest: str) -> str:
        return next((a.option_strings[0] for a in self._actions
                     if a.dest == dest and a.option_strings), dest)

    _bad_values: list[str] | None = None  # set by parse_all while it parses
    _given_dests: set[str] | None = None

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
                self._bad_values, self._given_dests = [], set()
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
                missing = [a for a in required if a.dest not in self._given_dests]
                if missing:
                    problems.append("the following arguments are required: " + ", ".join(
                        "/".join(a.option_strings) for a in missing) + " (see --help)")
                return flags, list(dict.fromkeys(problems))
            return None, list(dict.fromkeys(problems))
        finally:
            self.exit_on_error = exit_on_error
            for a in required:
                a.required = True
            self._bad_values = self._given_dests = None

    def _get_values(self, action, arg_strings):
        """argparse's conversion of one flag's values; in parse_all a bad value is a
        problem line and the flag keeps its default."""
        if self._bad_values is None:
            return super()._get_values(action, arg_strings)
        self._given_dests.add(action.dest)
        try:
            return super()._get_values(action, arg_strings)
        except argparse.ArgumentError as e:
            self._bad_values.append(f"{e} (see --help)")
            return action.default

def _shown(value) -> str:
    return "(on)" if value is True or value is None else str(value)


class DeepSpeedIntake:
    """A --deepspeed-config file as read: its path, its mapping, the conflicts with the
    command line (lines); run_problems reports and completes it."""

    def __init__(self, path, mapping, conflicts, given):
        self.path, self.mapping, self.conflicts = path, mapping, conflicts
        self.given = given  # the destinations the command line set

    def __repr__(self):  # the arguments block shows the path
        return self.path

    def problems(self) -> list[str]:
        lines = [self.mapping.refusal(self.path)]
        if self.conflicts:
            lines.append(f"--deepspeed-config {self.path} and the command line disagree: "
                         f"{'; '.join(self.conflicts)}; drop the flag or change the file "
                         f"(the same value in both is fine)")
        return [line for line in lines if line]

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
    deepspeed_config.add_deepspeed_flags(p)  # a ds_config read as the flags above
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
    else:
        flags = build_parser().parse_args(argv)
    world_size = world_size or default_world_size()
    ds_problems, ds_notes = deepspeed_problems(flags, world_size, ranks_per_node)
    problems += ds_problems
    if parse_all:
        for name, value in _REQUIRED_STAND_INS.items():  # missing or bad: reported above
            if getattr(flags, name) is None:
                setattr(flags, name, value)
    if flags.micro_batch_size is None:  # a ds_config's train_batch_size it could not split
        return None, flags, problems, ds_notes
    refusals, notes = megatron_flag_problems(flags)  # first: its aliases set megaq's flags
    notes = ds_notes + notes
    config = RunConfig.from_flags(flags, world_size, ranks_per_node, problems=problems)
    # a flag megaq defines and refuses itself (--fp16) is reported once, in its own words
    problems += [r for r in refusals if not any(p.startswith(r.split(":")[0].split()[0])
                                                for p in problems)]
    return config, flags, problems, notes


def deepspeed_problems(flags, world_size: int, ranks_per_node: int | None):
    """(problem lines, note lines) of --deepspeed-config: the file's refusal line and its
    conflicts with the command line, and the batch sizes completed and checked against
    the data-parallel size (DeepSpeed's rule; a micro-batch size still unset is a
    problem); the note of --deepspeed without a file. Call it before building the
    configuration from `flags` (run_problems, tools/plan.py)."""
    intake = flags.deepspeed if isinstance(flags.deepspeed, DeepSpeedIntake) else None
    if intake is None:
        return [], (["note: --deepspeed: megaq's ZeRO engine is always on; pass "
                     "--deepspeed_config FILE.json to read a ds_config"]
                    if flags.deepspeed else [])
    problems = intake.problems()
    try:
        dp = from_flags(ParallelConfig, flags, world_size=world_size,
                        ranks_per_node=ranks_per_node).dp
    except CONFIG_ERRORS:
        dp = None  # the configuration reports the layout's problem
    if dp is not None:
        line = deepspeed_config.batch_flags(intake.mapping, flags, dp, intake.given)
        problems += [line] if line else []
    if flags.micro_batch_size is None and not problems:
        problems.append("--deepspeed-config: the micro-batch size is not set; give "
                        "train_micro_batch_size_per_gpu in the file or --micro-batch-size")
    return problems, []


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
    """Print the --deepspeed-config mapping block (always) and the notes (unless
    --quiet-notes), each not printed before in this process."""
    print_fn = print_fn or (lambda line: print(line, flush=True))
    return (print_deepspeed_mapping(flags, print_fn)
            + megatron_flags.print_notes(notes, quiet=flags.quiet_notes, print_fn=print_fn))


def print_deepspeed_mapping(flags, print_fn=None) -> list[str]:
    """Print the --deepspeed-config mapping block, if a file was read and the block was
    not printed before in this process (--dry-run prints it even when it refuses)."""
    intake = getattr(flags, "deepspeed", None)
    block = ([intake.mapping.block(intake.path)] if isinstance(intake, DeepSpeedIntake)
             else [])
    return megatron_flags.print_notes(block, print_fn=print_fn or (
        lambda line: print(line, flush=True)))
