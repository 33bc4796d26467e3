"""`--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`: a local tokenizer directory.

Megatron-LM's HuggingFaceTokenizer is `transformers.AutoTokenizer` on the directory:
ids are `tokenizer(text).input_ids` (special tokens such as a BOS included, as the
tokenizer's own post-processor adds them), `eod` is the EOS id and `vocab_size` is
`len(tokenizer)` (the base vocabulary plus added tokens). megaq does the same through
`transformers` when it is importable; otherwise it reads the directory's
`tokenizer.json` with the `tokenizers` library directly (the same Rust tokenizer that
a fast `transformers` tokenizer wraps) and takes the EOS token from
`tokenizer_config.json`. Nothing is downloaded: the directory must exist locally.
"""

from __future__ import annotations

import json
import os

from megaq.data.errors import DataError

INSTALL_HINT = "pip install 'tokenizers==0.23.3' (or transformers)"


class HuggingFaceTokenizer:
    """`tokenize(text) -> list[int]`, `detokenize(ids) -> str`, vocab_size, eod, pad;
    `bos` / `unk`: the tokenizer's BOS / unknown-token ids, or None (for an export's
    configs: whether a BOS starts each text is the tokenizer's own post-processor's say)."""

    type = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        self.path = path
        if not path:
            raise DataError("HuggingFaceTokenizer needs --tokenizer-model DIR (a local "
                            "directory holding tokenizer.json / tokenizer_config.json)")
        if not os.path.isdir(path):
            raise DataError(f"{path}: not a local tokenizer directory; --tokenizer-model takes "
                            "a directory with tokenizer.json (megaq downloads nothing: save the "
                            "tokenizer with save_pretrained first)")
        self._auto = _load_transformers(path)  # None when transformers is not importable
        if self._auto is not None:
            self.backend = "transformers"
            eos, pad = self._auto.eos_token_id, self._auto.pad_token_id
            self.bos, self.unk = self._auto.bos_token_id, self._auto.unk_token_id
            self.vocab_size = len(self._auto)
        else:
            self.backend = "tokenizers"
            self._fast, config = _load_tokenizers(path)
            eos = _config_token_id(self._fast, config, "eos_token")
            pad = _config_token_id(self._fast, config, "pad_token")
            self.bos = _config_token_id(self._fast, config, "bos_token")
            self.unk = _config_token_id(self._fast, config, "unk_token")
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
        if eos is None:
            raise DataError(f"{path}: tokenizer has no EOS token, which HuggingFaceTokenizer "
                            "uses as end of document; set eos_token in tokenizer_config.json")
        self.eod = int(eos)
        self.pad = self.eod if pad is None else int(pad)

    def tokenize(self, text: str) -> list[int]:
        if self._auto is not None:
            return list(self._auto(text).input_ids)
        return self._fast.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._auto is not None:
            return [list(x) for x in self._auto(texts).input_ids]
        return [e.ids for e in self._fast.encode_batch(texts)]

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._auto is not None:
            return self._auto.decode(ids)
        return self._fast.decode(ids, skip_special_tokens=False)  # transformers' default

    def __repr__(self):
        return (f"HuggingFaceTokenizer({self.path!r}, backend={self.backend}, "
                f"vocab_size={self.vocab_size}, eod={self.eod})")


def _load_transformers(path: str):
    try:
        import transformers
    except ImportError:
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{path}: transformers cannot load a tokenizer from this directory "
                        f"({first}); check --tokenizer-model") from None


def _load_tokenizers(path: str):
    """-> (tokenizers.Tokenizer from tokenizer.json, tokenizer_config.json as a dict)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("HuggingFaceTokenizer needs the `tokenizers` or `transformers` "
                        f"package, and neither is importable; {INSTALL_HINT}") from None
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise DataError(f"{path}: no tokenizer.json (without `transformers` megaq reads only "
                        f"fast tokenizers); {INSTALL_HINT}, or re-save the tokenizer with "
                        "save_pretrained, which writes tokenizer.json")
    try:
        fast = Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a plain Exception for a malformed file
        raise DataError(f"{file}: not a valid tokenizer.json ({e}); re-save the tokenizer") from None
    config = {}
    cfg = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg):
        try:
            with open(cfg, encoding="utf-8") as f:
                config = json.load(f)
        except ValueError as e:
            raise DataError(f"{cfg}: malformed JSON ({e}); fix or re-save it") from None
    return fast, config


def _config_token_id(fast, config: dict, key: str):
    """Id of tokenizer_config.json's `key` token (a string or {"content": ...}), or None."""
    tok = config.get(key)
    if isinstance(tok, dict):
        tok = tok.get("content")
    return fast.token_to_id(tok) if isinstance(tok, str) else None
