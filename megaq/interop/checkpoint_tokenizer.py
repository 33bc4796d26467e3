"""The tokenizer of a checkpoint's run, for the tools that turn ids into text and back:
the Hugging Face export (megaq.interop.hf) and tools/generate.py.

Each file the tokenizer needs comes from the first of:
1. the tool's own flags (--tokenizer-type, --tokenizer-model, --vocab-file, --merge-file);
2. the copy inside the checkpoint (iter_*/tokenizer/, megaq.data.tokenizer_files),
   checked against the integrity manifest like every other file of the checkpoint;
3. the path the run recorded (a checkpoint saved before the copy existed).
When none has it, one line names the flag that supplies it. The type is the run's,
unless the flags say otherwise (given, or implied: --vocab-file with --merge-file is
the GPT-2 BPE, a --tokenizer-model directory a HuggingFaceTokenizer).
"""

from __future__ import annotations

import dataclasses
import os

from megaq.checkpoint.integrity import IntegrityError, Verifier
from megaq.data import tokenizer_files
from megaq.data.errors import DataError
from megaq.data.tokenizer import DEFAULT_TYPE, SENTENCEPIECE_TYPES, build_tokenizer
from megaq.data.tokenizer_files import files_kind

# what to pass for each kind of tokenizer files
_FLAGS = {"sentencepiece": "--tokenizer-model PATH (the SentencePiece .model file)",
          "bpe": "--vocab-file and --merge-file (GPT-2's vocab.json and merges.txt)",
          "hf": "--tokenizer-model DIR (a local Hugging Face tokenizer directory)"}
_ANY = ("--tokenizer-model PATH (or --vocab-file and --merge-file; or --tokenizer-type "
        "NullTokenizer to give and get token ids)")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer, read from which files; `origin` says where they came from."""

    type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # the NullTokenizer's
    origin: str = ""

    def build(self):
        return build_tokenizer(self.type, self.tokenizer_model, self.vocab_file, self.merge_file,
                               vocab_size=self.vocab_size)

    def describe(self) -> str:
        files = self.tokenizer_model or (f"{self.vocab_file}, {self.merge_file}"
                                         if self.vocab_file else "")
        return f"{self.type}" + (f" ({files}; {self.origin})" if files else "")


def run_tokenizer(ckpt_dir: str, data: dict, model_vocab: int, *,
                  tokenizer_type: str | None = None, tokenizer_model: str | None = None,
                  vocab_file: str | None = None, merge_file: str | None = None,
                  verify: bool = True) -> TokenizerSpec:
    """The tokenizer to use for checkpoint directory `ckpt_dir` (an iter_* directory)
    whose configuration's data section is `data`; the keyword arguments are the tool's
    flags (None: not given); verify=False (--no-verify-checkpoint) reads the checkpoint's
    copy without checking it against the manifest. A DataError (one line) when no file can be found."""
    recorded = data.get("tokenizer_type") or DEFAULT_TYPE
    given = {k: v for k, v in (("tokenizer_model", tokenizer_model), ("vocab_file", vocab_file),
                               ("merge_file", merge_file)) if v}
    ttype = tokenizer_type or _implied_type(given, recorded)
    kind = files_kind(ttype)
    if kind is None:  # NullTokenizer: ids are the text
        return TokenizerSpec(ttype, vocab_size=data.get("vocab_size") or model_vocab,
                             origin="ids as text")
    if kind == "bpe" and given.get("tokenizer_model"):
        raise DataError("GPT2BPETokenizer reads --vocab-file and --merge-file, not "
                        "--tokenizer-model; pass those two instead")
    if kind != "bpe" and (vocab_file or merge_file):
        raise DataError(f"--vocab-file / --merge-file are the GPT-2 BPE's, and the tokenizer here "
                        f"is {ttype}; drop them, or pass --tokenizer-type GPT2BPETokenizer")
    needs = ("vocab_file", "merge_file") if kind == "bpe" else ("tokenizer_model",)
    if all(k in given for k in needs):
        return TokenizerSpec(ttype, **{k: given[k] for k in needs}, origin="given by flag")
    if files_kind(recorded) == kind:  # the run's own files fit this type
        copied = _verified_copy(Verifier(ckpt_dir, enabled=verify), data, kind)
        if copied:
            return TokenizerSpec(ttype, **{**copied, **given}, origin="the checkpoint's copy")
        paths = {k: data.get(k) for k in needs}
        if all(paths.values()) and all(_exists(p, kind) for p in paths.values()):
            return TokenizerSpec(ttype, **{**paths, **given}, origin="the run's recorded path")
        if any(paths.values()):
            lost = next(p for p in paths.values() if not (p and _exists(p, kind)))
            raise DataError(f"{ckpt_dir} holds no copy of its run's tokenizer ({recorded}), and "
                            f"the path the run recorded, {lost}, is gone (or relative to another "
                            f"directory); pass {_FLAGS[kind]}")
    if data.get("mock_data") and not tokenizer_type:
        raise DataError(f"{ckpt_dir} records no tokenizer (a --mock-data run, or a model "
                        f"imported without one); pass {_ANY}")
    raise DataError(f"no tokenizer files for {ttype}: the run of {ckpt_dir} recorded none; "
                    f"pass {_FLAGS[kind]}")


def _implied_type(given: dict, recorded: str) -> str:
    if "vocab_file" in given and "merge_file" in given and "tokenizer_model" not in given:
        return "GPT2BPETokenizer"
    model = given.get("tokenizer_model")
    if model is None:
        return recorded
    if os.path.isdir(model):
        return "HuggingFaceTokenizer"
    return recorded if recorded in SENTENCEPIECE_TYPES else DEFAULT_TYPE


def _exists(path: str, kind: str) -> bool:
    return os.path.isdir(path) if kind == "hf" else os.path.isfile(path)


def _verified_copy(verifier: Verifier, data: dict, kind: str) -> dict:
    """The copy's paths (tokenizer_files.copied_paths) once every file of it is a plain
    file that matches the manifest ({} when there is no copy)."""
    ckpt_dir = verifier.root
    copied = tokenizer_files.copied_paths(ckpt_dir, data)
    if not copied:
        return {}
    folder = os.path.join(ckpt_dir, tokenizer_files.TOKENIZER_DIR)
    paths = [os.path.join(folder, n) for n in sorted(os.listdir(folder))]
    for path in [folder] + paths + list(copied.values()):
        if os.path.islink(path):  # a checkpoint is megaq's: nothing in it points elsewhere
            raise DataError(f"{path} is a symbolic link; a checkpoint's tokenizer copy holds "
                            f"plain files only: restore it, or pass {_FLAGS[kind]}")
    try:
        for path in paths:
            verifier.verify(path)
        for path in copied.values():
            if not os.path.exists(path):  # e.g. merges.txt lost beside vocab.json
                verifier.verify(path)  # names it as missing (when verifying)
                raise DataError(f"{path} is missing; the checkpoint's tokenizer copy is "
                                f"incomplete: pass {_FLAGS[kind]}")
    except IntegrityError as e:
        raise DataError(f"{e}; or pass {_FLAGS[kind]}") from None
    return copied
