"""Configuration fields that are also command-line flags.

megaq's configuration is a set of frozen dataclasses (megaq.config.run.RunConfig holds
them). A setting is declared once, as a field; a field made with :func:`flag` or
:func:`switch` is also a command-line flag. The flag's name (Megatron's spelling),
help text and argparse details sit on the field, and the flag's default *is* the
field's default, so the parser (megaq.config.arguments.build_parser) is generated from the
dataclasses and cannot disagree with them::

    @dataclass(frozen=True)
    class TrainingConfig:
        FLAG_GROUP = "training"          # the --help section the flags appear under
        train_iters: int = flag("--train-iters", "optimizer steps to train for", 0,
                                type=int, required=True)
        bf16: bool = switch("--bf16", "bf16 weights/activations (fp32 master)")

Adding a flag is adding such a field (and using it). A field without flag metadata is
derived (filled in by the builder or ``__post_init__``), never read from the command line.
A ``type=float`` flag is parsed as a finite number by megaq's parser
(megaq.data.errors.finite_float): inf and nan are refused for every float flag at once,
before the field's own range check in ``__post_init__``.

This module imports nothing of megaq, so config classes at every layer can use it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import field, fields


def flag(name: str, help: str, default=None, *, value=None, **argparse_kw):
    """A dataclass field settable by the command-line flag `name`.

    `value(namespace)`, when given, computes the field from the parsed flags (for a
    field spelled the other way round, e.g. --disable-bias-linear -> add_bias_linear,
    or one that depends on another flag); the flag's own default is then None (False
    for a switch) and the field keeps its own default for library callers.
    `argparse_kw` go to ``add_argument`` (type, choices, nargs, required, metavar, ...).
    """
    return field(default=default, metadata={"flag": name, "help": help, "value": value,
                                            "argparse": argparse_kw})


def switch(name: str, help: str, *, value=None):
    """A boolean flag, off unless given (``action="store_true"``)."""
    return flag(name, help, False, value=value, action="store_true")


def flag_fields(cls) -> list:
    """The fields of a config class that are command-line flags, in declaration order."""
    return [f for f in fields(cls) if "flag" in f.metadata]


def flag_name(cls, field_name: str) -> str:
    """'--norm-epsilon' for GPTConfig's 'layernorm_epsilon'; the field name if it has no flag."""
    for f in fields(cls):
        if f.name == field_name:
            return f.metadata.get("flag", field_name)
    raise KeyError(field_name)


def dest(f) -> str:
    """The argparse destination of a flag field: the flag without dashes, '_' for '-'."""
    return f.metadata["flag"].lstrip("-").replace("-", "_")


def _add_field(parser, f) -> None:
    kw = dict(f.metadata["argparse"])
    if kw.get("action") == "store_true":
        kw.setdefault("default", False)
    elif f.metadata["value"] is None and not kw.get("required"):
        kw.setdefault("default", f.default)
    parser.add_argument(f.metadata["flag"], dest=dest(f), help=f.metadata["help"], **kw)


def add_flags(parser: argparse.ArgumentParser, cls, title: str | None = None):
    """Add every flag field of `cls` to `parser`, as one --help group."""
    group = parser.add_argument_group(title or cls.FLAG_GROUP)
    for f in flag_fields(cls):
        _add_field(group, f)
    return group


def add_flag(parser: argparse.ArgumentParser, cls, field_name: str) -> None:
    """Add one flag field of `cls` to `parser` (a tool that shares one of pretrain_gpt.py's
    flags: same name, help and default)."""
    _add_field(parser, next(f for f in flag_fields(cls) if f.name == field_name))


def from_flags(cls, namespace, **derived):
    """An instance of `cls` from parsed flags; `derived` fills (or overrides) the rest."""
    kwargs = {}
    for f in flag_fields(cls):
        compute = f.metadata["value"]
        kwargs[f.name] = compute(namespace) if compute else getattr(namespace, dest(f))
    kwargs.update(derived)
    return cls(**kwargs)


def set_derived(obj, **values) -> None:
    """Fill derived fields of a frozen dataclass from its ``__post_init__``."""
    for k, v in values.items():
        object.__setattr__(obj, k, v)


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if dataclasses.is_dataclass(v):
        return to_dict(v)
    return str(v)  # e.g. torch.float32 -> "torch.float32"


def to_dict(obj) -> dict:
    """Every field of a config dataclass as plain values (checkpoint-safe: loadable
    with ``torch.load(weights_only=True)``); dtypes become their names."""
    return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}
