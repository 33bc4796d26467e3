"""The tokenizer files of a Hugging Face export, for every megaq tokenizer type.

`write_tokenizer` writes what `transformers.AutoTokenizer.from_pretrained` loads, so that
`AutoTokenizer(text).input_ids` are megaq's `tokenize(text)`:

- SentencePiece types: tokenizer.model and tokenizer.json. transformers converts the
  model; the pipeline is then set to SentencePiece's own (a "\u2581" prefix, spaces as
  "\u2581", byte fallback); Megatron's appended specials become added tokens; the
  Llama2Tokenizer's BOS comes from the post-processor.
- GPT2BPETokenizer: tokenizer.json, vocab.json and merges.txt. tokenizer.json is
  `tokenizers`' byte-level BPE on the run's vocab and merges (GPT-2's pre-tokenizer,
  byte map and merge order, no prefix space), "<|endoftext|>" an added special token.
- HuggingFaceTokenizer: the run's tokenizer files, copied as they are (the run tokenized
  with AutoTokenizer on them).

plus tokenizer_config.json and special_tokens_map.json naming the bos / eos / pad / unk
tokens (a HuggingFaceTokenizer's own are kept). The ids are returned for config.json and
generation_config.json: eos is megaq's end-of-document id, pad megaq's pad id (eod when
the tokenizer has none), bos the tokenizer's (GPT-2 BPE: `<|endoftext|>`, as GPT-2's).

Before anything is shipped, `AutoTokenizer` (or, without transformers, `tokenizers`)
loads the files and must give megaq's ids on PROBE_TEXTS: code, whitespace runs, tabs,
newlines, unicode (accents, CJK, emoji, combining marks), each text also followed by the
end-of-document token (a document's end in the training stream), and megaq's decoding
of them. Otherwise no tokenizer is shipped and a note says why (or, for a tokenizer
named by flag, an error).

One difference is by design: transformers splits a special token's text out of the
input ("a<|endoftext|>b" -> its id), as every Hugging Face tokenizer does, while
megaq's GPT-2 BPE encodes such text as text, as Megatron-LM's preprocessing does.
"""

from __future__ import annotations

import json
import os
import shutil

from megaq import export_files
from megaq.data.errors import DataError
from megaq.data.tokenizer_files import BPE_MERGES, BPE_VOCAB, HF_FILES, files_kind
from megaq.interop.common import InteropError, write_json

PROBE_TEXTS = (
    "def main(argv=None):\n    return  {'a': 1, \"b\": [2, 3.5]}\n\n",
    "  leading spaces\tand tabs\n",
    "trailing spaces   ",
    "line one\nline two\r\n\n\n    indented   line\n",
    "It's John's 'quoted' they're we've",
    "\u00fcnic\u00f6de \u2192 \u4e2d\u6587 12345 na\u00efve caf\u00e9 "
    "\u03a9\u03bc\u03ad\u03b3\u03b1",
    "\u041f\u0440\u0438\u0432\u0435\u0442 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4 "
    "\U0001f642\U0001f680 e\u0301 x\u00b2",
    "nbsp\u00a0here ideographic\u3000space",
    "", " ", "\n",
)


def write_tokenizer(out_dir: str, spec, max_length: int, model_vocab: int, *,
                    strict: bool = False, log=print) -> dict:
    """Write the tokenizer files of `spec` (a checkpoint_tokenizer.TokenizerSpec) into
    `out_dir`; returns the special ids {bos, eos, pad, unk} (only those the tokenizer
    has), or {} when nothing was shipped (a note says why). `strict` (the tokenizer was
    named by flag): an InteropError instead of the note."""
    def give_up(why: str) -> dict:
        if strict:
            raise InteropError(f"the tokenizer cannot be shipped: {why}")
        log(f" note: no tokenizer files: {why}")
        return {}

    kind = files_kind(spec.type)
    if kind is None:
        return give_up("the run used the NullTokenizer (ids, no text)")
    try:
        tok = spec.build()
    except DataError as e:
        return give_up(f"{spec.describe()}: {e}")
    if tok.vocab_size != model_vocab:
        return give_up(f"{spec.describe()} has {tok.vocab_size} ids, the model {model_vocab}; "
                       f"pass the tokenizer the model was trained with")
    scratch = os.path.join(out_dir, ".tokenizer_scratch")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    try:
        # check: False when the writer checked the files itself, or when a library is
        # missing and they go out unchecked (noted)
        special, check = _WRITERS[kind](scratch, spec, tok, max_length, log)
        why = mismatch(scratch, tok) if check else None
        if why is not None:
            return give_up(f"{spec.describe()}: the exported tokenizer {why}")
        for name in os.listdir(scratch):
            os.replace(os.path.join(scratch, name), os.path.join(out_dir, name))
        return special
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------- checking
def mismatch(folder: str, tok) -> str | None:
    """None when the tokenizer in `folder` gives megaq's ids on PROBE_TEXTS (alone and
    followed by the end-of-document token) and decodes them as megaq does; otherwise
    what differs, in words."""
    try:
        encode, decode, size, token_of, eos = _loaded(folder)
    except Exception as e:  # noqa: BLE001 - whatever the library raises for files it rejects
        first = str(e).splitlines()[0] if str(e) else ""
        return f"does not load ({type(e).__name__}: {first})"
    if size != tok.vocab_size:
        return f"has {size} ids, megaq's {tok.vocab_size}"
    if eos != tok.eod:
        return f"has eos id {eos}, megaq's end of document is {tok.eod}"
    eod_text = token_of(tok.eod)
    specials = {tok.eod, tok.pad, getattr(tok, "bos", None)}
    for text in PROBE_TEXTS:
        ours = tok.tokenize(text)
        for probe, want in ((text, ours), (text + eod_text, ours + [tok.eod])):
            theirs = encode(probe)
            if theirs != want:
                at = next((i for i, (a, b) in enumerate(zip(theirs, want)) if a != b),
                          min(len(theirs), len(want)))
                return (f"encodes {probe!r} as {theirs[at:at + 8]}, megaq as {want[at:at + 8]} "
                        f"(ids from position {at})")
        plain = [i for i in ours if i not in specials]
        if decode(plain) != tok.detokenize(plain):
            return (f"decodes the ids of {text!r} as {decode(plain)!r}, megaq as "
                    f"{tok.detokenize(plain)!r}")
    return None


def _loaded(folder: str):
    """(encode, decode, vocab size, token text of an id, eos id) of the tokenizer in
    `folder`: through transformers.AutoTokenizer, what users load, or without it
    through `tokenizers` (tokenizer.json and tokenizer_config.json's eos_token)."""
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        t = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        t.model_max_length = int(1e30)  # the probe texts may pass the model's seq length
        return (lambda s: list(t(s).input_ids), t.decode, len(t),
                lambda i: t.convert_ids_to_tokens(i), t.eos_token_id)
    from tokenizers import Tokenizer
    fast = Tokenizer.from_file(os.path.join(folder, export_files.TOKENIZER_JSON))
    with open(os.path.join(folder, export_files.TOKENIZER_CONFIG), encoding="utf-8") as f:
        eos = json.load(f).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return (lambda s: fast.encode(s).ids, lambda ids: fast.decode(ids, skip_special_tokens=False),
            fast.get_vocab_size(with_added_tokens=True), fast.id_to_token,
            fast.token_to_id(eos) if isinstance(eos, str) else None)


def _write_configs(folder: str, tokens: dict, max_length: int, **extra) -> None:
    """tokenizer_config.json and special_tokens_map.json (read by transformers 4.x); the
    class is the fast tokenizer's (tokenizer.json as it is), unless `extra` names one."""
    write_json(os.path.join(folder, export_files.TOKENIZER_CONFIG),
               {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                "add_eos_token": False, "clean_up_tokenization_spaces": False,
                "model_max_length": max_length, **{f"{k}_token": v for k, v in tokens.items()},
                **extra})
    write_json(os.path.join(folder, export_files.SPECIAL_TOKENS_MAP),
               {f"{k}_token": v for k, v in tokens.items()})


# ------------------------------------------------------------------- SentencePiece
def _sentencepiece(folder: str, spec, tok, max_length: int, log):
    """tokenizer.model, and tokenizer.json where transformers converts it to one that
    encodes as megaq does (else only tokenizer.model, with LlamaTokenizer's config:
    transformers then converts it when loading)."""
    sp = tok.sp
    n = sp.get_piece_size()
    shutil.copyfile(spec.tokenizer_model, os.path.join(folder, export_files.TOKENIZER_MODEL))
    special = {"eos": int(tok.eod), "pad": int(tok.pad)}
    if sp.bos_id() >= 0:
        special["bos"] = int(sp.bos_id())
    if sp.unk_id() >= 0:
        special["unk"] = int(sp.unk_id())
    appended = {i: tok.detokenize([i]) for i in range(n, tok.vocab_size)}
    tokens = {k: appended[v] if v in appended else sp.id_to_piece(v) for k, v in special.items()}
    adds_bos = spec.type == "Llama2Tokenizer"
    fast = _sentencepiece_json(folder, tok, appended, adds_bos, log)
    if fast is not None:
        json_path = os.path.join(folder, export_files.TOKENIZER_JSON)
        with open(json_path, "w") as f:
            f.write(fast)
        _write_configs(folder, tokens, max_length, add_bos_token=adds_bos)
        why = mismatch(folder, tok)
        if why is None:
            return special, False  # checked
        os.remove(json_path)
        log(f" note: no tokenizer.json: the fast tokenizer converted from tokenizer.model {why} "
            f"(a unigram model?); only tokenizer.model is written")
    # transformers converts tokenizer.model itself when loading (needs sentencepiece and
    # protobuf there); its Llama tokenizer treats leading spaces differently
    _write_configs(folder, tokens, max_length, tokenizer_class="LlamaTokenizer", legacy=True,
                   add_bos_token=adds_bos)
    return special, False


def _sentencepiece_json(folder: str, tok, appended: dict, adds_bos: bool, log) -> str | None:
    try:
        from tokenizers import Tokenizer
        from transformers import LlamaTokenizer
    except ImportError:
        log(" note: transformers / tokenizers not installed: no tokenizer.json written "
            "(transformers builds one from tokenizer.model when loading)")
        return None
    scratch = os.path.join(folder, ".convert")
    os.makedirs(scratch)
    try:
        shutil.copyfile(os.path.join(folder, export_files.TOKENIZER_MODEL),
                        os.path.join(scratch, export_files.TOKENIZER_MODEL))
        write_json(os.path.join(scratch, export_files.TOKENIZER_CONFIG),
                   {"add_bos_token": False, "add_eos_token": False})
        converted = LlamaTokenizer.from_pretrained(scratch)
        spec = json.loads(converted.backend_tokenizer.to_str())
        # SentencePiece (add_dummy_prefix, identity normalisation): "\u2581" before the text,
        # every space -> "\u2581", no pre-tokenizer. transformers' own Llama pipeline
        # (Metaspace) drops the prefix when the text starts with a space; this does not.
        # Specials are split off before normalising, so text after a special written
        # literally inside the input ("a<EOD> b") gets its own "\u2581" prefix, where
        # SentencePiece would not add one (docs/INTEROP.md).
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        spec["pre_tokenizer"] = None
        spec["post_processor"] = _bos_template(tok) if adds_bos else None
        for i, text in appended.items():
            spec.setdefault("added_tokens", []).append(
                {"id": i, "content": text, "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": True})
        text = json.dumps(spec, ensure_ascii=False)
        Tokenizer.from_str(text)  # parses
        return text
    except Exception as e:  # noqa: BLE001 - conversion is best effort; tokenizer.model stays
        log(f" note: no tokenizer.json: transformers could not convert tokenizer.model "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _bos_template(tok) -> dict:
    """A post-processor putting the BOS id before every text (Llama2Tokenizer's)."""
    bos = tok.sp.id_to_piece(tok.bos)
    one = [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    return {"type": "TemplateProcessing", "single": one,
            "pair": one + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tok.bos], "tokens": [bos]}}}


# ---------------------------------------------------------------------- GPT-2 BPE
def _gpt2_bpe(folder: str, spec, tok, max_length: int, log):
    """GPT-2's files (vocab.json, merges.txt) and the fast tokenizer built from them."""
    shutil.copyfile(spec.vocab_file, os.path.join(folder, BPE_VOCAB))
    shutil.copyfile(spec.merge_file, os.path.join(folder, BPE_MERGES))
    eod_text = tok.decoder[tok.eod]
    special = {"bos": tok.eod, "eos": tok.eod, "pad": tok.pad, "unk": tok.eod}
    tokens = {k: tok.decoder[v] for k, v in special.items()}
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError:
        log(" note: `tokenizers` is not installed: no tokenizer.json; shipping vocab.json and "
            "merges.txt for transformers' GPT2Tokenizer (unchecked)")
        _write_configs(folder, tokens, max_length, tokenizer_class="GPT2Tokenizer",
                       add_prefix_space=False)
        return special, False
    fast = Tokenizer(models.BPE.from_file(spec.vocab_file, spec.merge_file))
    # GPT-2's pipeline: its regex and byte map, no prefix space (megaq.data.gpt2_bpe)
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    fast.decoder = decoders.ByteLevel()
    fast.post_processor = processors.ByteLevel(trim_offsets=False)
    fast.add_special_tokens([AddedToken(eod_text, special=True, normalized=False)])
    fast.save(os.path.join(folder, export_files.TOKENIZER_JSON))
    _write_configs(folder, tokens, max_length, add_prefix_space=False)
    return special, True


# ----------------------------------------------------------- Hugging Face tokenizer
def _huggingface(folder: str, spec, tok, max_length: int, log):
    """The run's tokenizer files as they are (its config.json, another model's, stays
    behind: where tokenizer_config.json names no class, the fast tokenizer's is set)."""
    src = spec.tokenizer_model
    names = [n for n in HF_FILES if n != export_files.CONFIG
             and os.path.isfile(os.path.join(src, n))]
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(folder, name))
    cfg_path = os.path.join(folder, export_files.TOKENIZER_CONFIG)
    cfg = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    if "tokenizer_class" not in cfg and export_files.TOKENIZER_JSON in names:
        write_json(cfg_path, {**cfg, "tokenizer_class": "PreTrainedTokenizerFast"})
    special = {"eos": tok.eod, "pad": tok.pad}
    special.update({k: v for k, v in (("bos", tok.bos), ("unk", tok.unk)) if v is not None})
    return special, True


_WRITERS = {"sentencepiece": _sentencepiece, "bpe": _gpt2_bpe, "hf": _huggingface}
