"""The files a run's tokenizer is read from, and their copy inside every checkpoint.

A checkpoint records the tokenizer flags in its configuration (RunConfig.to_dict()'s
`data` section: the type and the paths as they were given). A path alone does not
travel: it may be relative to the launch directory, lie on a node-local disk, or name
a file that is edited or deleted after the run, and an export or a sample on another
machine then has no tokenizer. So every save also copies the files into the
iteration directory, where the integrity manifest covers them:

    iter_0000100/tokenizer/tokenizer.model     SentencePiece types (--tokenizer-model)
    iter_0000100/tokenizer/vocab.json          GPT2BPETokenizer (--vocab-file)
    iter_0000100/tokenizer/merges.txt          GPT2BPETokenizer (--merge-file)
    iter_0000100/tokenizer/<HF_FILES>          HuggingFaceTokenizer: the directory's
                                               tokenizer files (never its weights)

A few MB per save at most (Llama 3's tokenizer.json is 9 MB). The readers
(megaq.interop.checkpoint_tokenizer: the Hugging Face export and tools/generate.py)
take the copy first and the recorded paths only for checkpoints saved without one.
"""

from __future__ import annotations

import os
import shutil

from megaq.data.tokenizer import SENTENCEPIECE_TYPES

TOKENIZER_DIR = "tokenizer"  # inside an iteration directory
SP_MODEL = "tokenizer.model"
BPE_VOCAB, BPE_MERGES = "vocab.json", "merges.txt"  # transformers' names for GPT-2's files
# What transformers' AutoTokenizer may read from a tokenizer directory (config.json
# only to pick the tokenizer class when tokenizer_config.json does not name it).
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
            "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
            "chat_template.json", "config.json")


def files_kind(tokenizer_type: str | None) -> str | None:
    """'sentencepiece', 'bpe', 'hf' or None (no files: the NullTokenizer)."""
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return "sentencepiece"
    return {"GPT2BPETokenizer": "bpe", "HuggingFaceTokenizer": "hf"}.get(tokenizer_type)


def source_files(data: dict) -> dict[str, str]:
    """{name in tokenizer/: the path the run read it from} for the `data` section of a
    checkpoint's configuration; only the files that exist now (see `missing_sources`)."""
    return {name: path for name, path in _sources(data).items() if os.path.isfile(path)}


def missing_sources(data: dict) -> list[str]:
    """The recorded tokenizer paths that are not (readable) files now."""
    return [path for path in _sources(data).values() if not os.path.isfile(path)]


def _sources(data: dict) -> dict[str, str]:
    kind = files_kind(data.get("tokenizer_type"))
    model = data.get("tokenizer_model")
    if kind == "sentencepiece" and model:
        return {SP_MODEL: model}
    if kind == "bpe" and data.get("vocab_file") and data.get("merge_file"):
        return {BPE_VOCAB: data["vocab_file"], BPE_MERGES: data["merge_file"]}
    if kind == "hf" and model:
        if not os.path.isdir(model):
            return {"tokenizer.json": os.path.join(model, "tokenizer.json")}  # reported missing
        return {name: os.path.join(model, name) for name in HF_FILES
                if os.path.isfile(os.path.join(model, name))}
    return {}


def copy_into(ckpt_dir: str, data: dict, log=print) -> list[str]:
    """Copy the run's tokenizer files into `ckpt_dir`/tokenizer/ (a save's temporary
    directory, before its manifest is written); returns the names copied. A recorded
    file that is gone is noted, not fatal: the weights matter more, and the readers
    then name the flag that supplies the tokenizer."""
    missing = missing_sources(data)
    if missing:
        log(f" note: the tokenizer file {missing[0]} is gone, so this checkpoint holds no copy "
            f"of it; an export or tools/generate.py will ask for it by flag")
    files = source_files(data)
    if not files:
        return []
    dest = os.path.join(ckpt_dir, TOKENIZER_DIR)
    os.makedirs(dest, exist_ok=True)
    for name, path in files.items():
        shutil.copyfile(path, os.path.join(dest, name))  # a plain file, whatever `path` is
    return sorted(files)


def copied_paths(ckpt_dir: str, data: dict) -> dict[str, str]:
    """{build_tokenizer keyword: path} of the copy in `ckpt_dir` for the run's tokenizer
    type ({} when the checkpoint holds none): tokenizer_model, or vocab_file and
    merge_file."""
    dest = os.path.join(ckpt_dir, TOKENIZER_DIR)
    kind = files_kind(data.get("tokenizer_type"))
    if kind == "sentencepiece" and os.path.lexists(os.path.join(dest, SP_MODEL)):
        return {"tokenizer_model": os.path.join(dest, SP_MODEL)}
    if kind == "bpe" and os.path.lexists(os.path.join(dest, BPE_VOCAB)):
        return {"vocab_file": os.path.join(dest, BPE_VOCAB),
                "merge_file": os.path.join(dest, BPE_MERGES)}
    if kind == "hf" and os.path.isdir(dest):
        return {"tokenizer_model": dest}
    return {}
