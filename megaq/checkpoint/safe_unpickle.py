"""The one place megaq unpickles anything: files from others are hostile.

A pickle is a program: unpickling calls whatever functions and classes it names, so a
downloaded checkpoint could run a command the moment it is read, and the SHA-256
manifest does not help (it is unsigned: whoever crafts a file re-hashes it). Every
pickle megaq reads goes through :func:`load`, which lets a file name only the classes
its format needs (a :class:`Format`) and refuses anything else before it runs, with one
line naming the file and the class (:class:`UnpicklingRefused`):

- torch.save files (megaq's checkpoint files, Megatron-LM's ``model_optim_rng.pt``, a
  transformers ``pytorch_model.bin``): torch's ``weights_only`` unpickler, which allows
  tensors, storages, dtypes, ``torch.Size``, devices and plain containers. A format's
  extra classes are allowed only for the call (``torch.serialization.safe_globals``),
  so torch's own allow-list stays as it was for the rest of the process (megaq never
  adds to it; a library that does, as megatron-core does for its own data classes when
  imported, widens it for every weights_only load of the process). The tensor
  pieces DCP reads from its ``.distcp`` files are torch.save files too, which DCP's own
  reader loads with ``weights_only=True`` (torch's allow-list: tensors only);
- DCP's ``.metadata`` index, a plain pickle stream: a ``pickle.Unpickler`` whose
  ``find_class`` gives exactly the names of :data:`DCP_INDEX` (the metadata dataclasses
  torch 2.11 to 2.13 write, the save-plan dataclasses megatron-core's torch_dist index
  keeps, ``torch.Size``, dtypes, layouts, paths). The chunks of a DCP data file are
  torch.save streams: :func:`load_bytes` reads one from memory like a file.

Megatron-LM's files pickle an ``argparse.Namespace`` of its flags, which holds some of
Megatron's enums (``--attention-backend``, the model type, CUDA graph scopes), a
``signal.Signals`` and paths, and, in the RNG state, numpy arrays (the list follows
megatron-core's own ``megatron/core/safe_globals.py``). Megatron's classes are read as
:class:`MegatronObject` stand-ins that keep the class name and the value (or fields):
no Megatron module is imported, so a Megatron-LM checkpoint imports without Megatron
installed and a file cannot make megaq import anything. A class Megatron adds later is
refused by name until it is listed here.

DeepSpeed's files (its model-state and ZeRO optimizer-state files, and the universal
checkpoint's) pickle a few of DeepSpeed's classes in the optimizer state: the ZeRO stage
(an enum), the loss scaler (an object of a few fields) and, from ZeRO-1/2, fragment
addresses (two integers). They are read as the same
stand-ins (:data:`DEEPSPEED`), so a DeepSpeed checkpoint imports without DeepSpeed.

Names are matched exactly (``module.qualname``): a pickle cannot reach an attribute of
an allowed class (``torch.Size.__init__.__globals__`` is not ``torch.Size``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import io
import os
import pathlib
import pickle
import re
import signal
import types
from dataclasses import dataclass, field

import numpy as np
import torch


class UnpicklingRefused(pickle.UnpicklingError):
    """A file naming a class or function its format never holds; unpickling it could run
    code. The message names the file and the class."""

    def __init__(self, path: str, name: str, fmt: "Format"):
        self.path, self.name = str(path), name
        super().__init__(f"{path} refers to {name}, which {fmt.what} never holds (it holds "
                         f"{fmt.holds}); refused unread, as unpickling it could run code: the "
                         f"file was altered or is not what it claims to be, so do not use it "
                         f"and get the checkpoint again from a source you trust")


class MegatronObject:
    """An object of one of Megatron's (or DeepSpeed's) classes, read without them: an enum member
    (`value`: the member's value) or a dataclass (its fields, set as attributes); the
    class's `qualified_name` names Megatron's class. Nothing of it runs any code."""

    qualified_name = "megatron class"
    value = None  # a dataclass is made without __init__ (its fields come as attributes)

    def __init__(self, *args):
        self.value = args[0] if len(args) == 1 else args

    def __eq__(self, other):
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __hash__(self):
        return hash((self.qualified_name, repr(self.value)))

    def __repr__(self):
        fields = {k: v for k, v in self.__dict__.items() if k != "value"}
        return f"<{self.qualified_name}: {fields or self.value!r}>"


def _stand_in(qualified_name: str) -> type:
    return type(qualified_name.rsplit(".", 1)[1], (MegatronObject,),
                {"qualified_name": qualified_name, "__module__": __name__})


# Megatron's classes that its saved flags (argparse.Namespace) and optimizer state can
# hold, in every module Megatron has kept them in (megatron.core and the legacy
# megatron.model packages): enums, and the optimizer's configuration dataclass.
_MEGATRON_CLASSES = [f"{module}.{name}" for module, names in {
    "megatron.core.enums": ("ModelType", "Fp8Recipe", "Fp4Recipe"),
    "megatron.core.transformer.enums": ("ModelType", "LayerType", "AttnType", "AttnMaskType",
                                        "AttnBackend", "CudaGraphModule", "CudaGraphScope",
                                        "InferenceCudaGraphScope"),
    "megatron.core.rerun_state_machine": ("RerunMode", "RerunState", "RerunDiagnostic"),
    "megatron.model.enums": ("ModelType", "LayerType", "AttnType", "AttnMaskType"),
    "megatron.legacy.model.enums": ("ModelType", "LayerType", "AttnType", "AttnMaskType"),
    "megatron.core.optimizer.optimizer_config": ("OptimizerConfig", "AdamOptimizerConfig",
                                                 "SGDOptimizerConfig"),
}.items() for name in names]

# numpy arrays and scalars (Megatron's RNG state: np.random.get_state()), under numpy 1's
# and numpy 2's module names; each builds an array or a scalar from its bytes
_multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
_NUMPY = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype,
          **{f"{module}.{name}": getattr(_multiarray, name)
             for module in ("numpy.core.multiarray", "numpy._core.multiarray")
             for name in ("_reconstruct", "scalar")},
          # an unpickled dtype's state is set on its class (numpy.dtypes.UInt32DType, ...)
          **{f"{t.__module__}.{t.__qualname__}": t
             for t in {type(np.dtype(code)) for code in "?bhilqBHILQefdFD"}}}

# a path-valued flag or DCP's checkpoint_id (pathlib moved its classes in Python 3.13)
_PATHS = {f"{module}.{name}": getattr(pathlib, name) for module in ("pathlib", "pathlib._local")
          for name in ("PosixPath", "PurePosixPath")}


@dataclass(frozen=True)
class Format:
    """What one kind of file may hold. `torch_file`: a torch.save file (read by torch's
    weights_only unpickler, which allows tensors and containers itself; `names` are
    added for the call), else a plain pickle stream (only `names` are allowed)."""
    what: str                       # "a DCP index (.metadata)", for the refusal
    holds: str                      # what it may hold, for the refusal
    torch_file: bool = True
    names: dict = field(default_factory=dict)  # "module.qualname" -> the object it gives


# megaq's own checkpoint files and a transformers pytorch_model.bin
TENSORS = Format("a checkpoint file", "tensors, numbers, strings and plain containers")

MEGATRON = Format(
    "a Megatron-LM checkpoint file",
    "tensors, plain containers, its flags as an argparse.Namespace, Megatron's enums and "
    "optimizer configuration, signals, paths and numpy arrays",
    names={"argparse.Namespace": argparse.Namespace, "types.SimpleNamespace": types.SimpleNamespace,
           "signal.Signals": signal.Signals,  # --exit-signal
           # Transformer Engine's `_extra_state` before it became a tensor
           "_io.BytesIO": io.BytesIO,
           **{name: _stand_in(name) for name in _MEGATRON_CLASSES}, **_NUMPY, **_PATHS})


@functools.lru_cache(maxsize=None)
def _dcp_index_names() -> dict:
    from torch.distributed.checkpoint import filesystem, metadata
    names = {f"torch.distributed.checkpoint.metadata.{n}": getattr(metadata, n)
             for n in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                       "BytesStorageMetadata", "TensorProperties", "MetadataIndex",
                       "StorageMeta", "_MEM_FORMAT_ENCODING") if hasattr(metadata, n)}
    names["torch.distributed.checkpoint.filesystem._StorageInfo"] = filesystem._StorageInfo
    # megatron-core's torch_dist index also keeps every rank's save plan (all_local_plans)
    from torch.distributed.checkpoint import planner
    names.update({f"torch.distributed.checkpoint.planner.{n}": getattr(planner, n)
                  for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")})
    names.update({f"torch.{n}": v for n, v in vars(torch).items()
                  if isinstance(v, (torch.dtype, torch.layout, torch.memory_format))})
    names.update({"torch.Size": torch.Size, "torch.device": torch.device,
                  # how a torch.layout pickles: a lookup of its name among torch's layouts
                  "torch.serialization._get_layout": torch.serialization._get_layout,
                  "collections.OrderedDict": collections.OrderedDict,
                  "builtins.set": set, "builtins.frozenset": frozenset, **_PATHS})
    return names


# DeepSpeed's classes in a ZeRO optimizer-state file (and the universal checkpoint's
# optimizer_state.pt): the stage enum, the static (bf16, fp32) or dynamic (fp16) loss
# scaler, and ZeRO-1/2's (numel, start) address of a parameter's fragment
_DEEPSPEED_CLASSES = ["deepspeed.runtime.zero.config.ZeroStageEnum",
                      "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                      "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                      "deepspeed.utils.tensor_fragment.fragment_address"]

DEEPSPEED = Format(
    "a DeepSpeed checkpoint file",
    "tensors, plain containers, DeepSpeed's ZeRO stage, loss scaler and fragment addresses",
    names={name: _stand_in(name) for name in _DEEPSPEED_CLASSES})


DCP_INDEX = Format("a DCP index (.metadata)",
                   "torch.distributed.checkpoint's metadata classes, sizes, dtypes and paths",
                   torch_file=False)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str, fmt: Format, names: dict):
        super().__init__(file)
        self.path, self.fmt, self.names = path, fmt, names

    def find_class(self, module: str, name: str):
        obj = self.names.get(f"{module}.{name}")
        if obj is None:
            raise UnpicklingRefused(self.path, f"{module}.{name}", self.fmt)
        return obj

    def persistent_load(self, pid):
        raise UnpicklingRefused(self.path, f"persistent id {str(pid)[:40]!r}", self.fmt)


_UNSUPPORTED = re.compile(r"GLOBAL (\S+) was not an allowed global")


def load(path: str, fmt: Format = TENSORS, *, mmap: bool = False):
    """The object pickled in file `path`, unpickled allowing only what `fmt` holds (on
    the CPU). Raises UnpicklingRefused naming the first class the format does not hold;
    other reading errors (a damaged or truncated file) propagate as they are."""
    if not fmt.torch_file:
        names = _dcp_index_names() if fmt is DCP_INDEX else fmt.names
        with open(path, "rb") as f:
            return _RestrictedUnpickler(f, str(path), fmt, names).load()
    return _torch_load(path, str(path), fmt, mmap)


def load_bytes(data: bytes, where: str, fmt: Format = TENSORS):
    """load() for a torch.save stream held in memory (a chunk of a DCP data file, read
    at the offset its index gives); `where` names its file in a refusal."""
    return _torch_load(io.BytesIO(data), where, fmt, False)


def _torch_load(source, where: str, fmt: Format, mmap: bool):
    """torch's weights_only unpickler over `source` (a path or a file object), `fmt`'s
    extra names allowed for the call only."""
    extra = [(obj, name) for name, obj in fmt.names.items()]
    with torch.serialization.safe_globals(extra):
        try:
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            if not isinstance(source, str | bytes | os.PathLike):
                source.seek(0)
            name = _forbidden_name(source, e)
            if name is None:
                raise
            raise UnpicklingRefused(where, name, fmt) from None


def _forbidden_name(path, error: Exception) -> str | None:
    """The first name in file `path` outside torch's allow-list and the one in effect
    (read from the pickle's opcodes without running them), or failing that the one
    torch's error names."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - not a zip file (legacy format), or unreadable
        unsafe = []
    if unsafe:
        return sorted(unsafe)[0]
    m = _UNSUPPORTED.search(str(error))
    return m.group(1) if m else None
