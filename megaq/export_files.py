"""The files of a Hugging Face model directory as megaq's export writes it
(megaq.interop.hf), and the test whether a directory is an earlier export.

The export (`tools/convert_checkpoint.py --to hf`, `pretrain_gpt.py --save-hf`) replaces
its output directory as a whole, so it replaces only an earlier export: a directory
holding config.json, the weights (model.safetensors, or the index and its shards) and
nothing but files an export writes. A directory holding anything else (someone's
models, notes, a checkpoint) is refused by both (config._check_save_hf,
interop.common.check_output).
"""

from __future__ import annotations

import os
import re
import stat

from megaq.data.tokenizer_files import HF_FILES

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"                      # one file
WEIGHTS_INDEX = "model.safetensors.index.json"     # sharded: the index and its shards
TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def shard_name(index: int, count: int) -> str:
    """transformers' name of weights shard `index` (from 1) of `count`."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def is_export(path: str) -> bool:
    """True when `path` is a directory holding an earlier export and nothing else: its
    config.json and weights, every entry a plain file (no symlink, no directory) of a
    name the export writes."""
    try:
        entries = {e.name: e for e in os.scandir(path)}
    except OSError:
        return False
    # the tokenizer files of every type (megaq.interop.hf_tokenizer)
    known = {CONFIG, GENERATION_CONFIG, WEIGHTS, WEIGHTS_INDEX, TOKENIZER_MODEL,
             TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, *HF_FILES}
    for name, entry in entries.items():
        if not (name in known or _SHARD.fullmatch(name)):
            return False
        if not stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
            return False
    has_weights = WEIGHTS in entries or (WEIGHTS_INDEX in entries
                                         and any(_SHARD.fullmatch(n) for n in entries))
    return CONFIG in entries and has_weights
