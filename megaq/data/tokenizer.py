"""Megatron-LM's tokenizer types; this module holds the SentencePiece ones, the
NullTokenizer and `build_tokenizer`, which also builds `GPT2BPETokenizer`
(megaq/data/gpt2_bpe.py: `--vocab-file`/`--merge-file`) and `HuggingFaceTokenizer`
(megaq/data/hf_tokenizer.py: `--tokenizer-model DIR`). Every tokenizer has tokenize /
tokenize_batch / detokenize and vocab_size / eod / pad.

Megatron-LM has three SentencePiece tokenizer types, and megaq reproduces them, so that
files and checkpoints made with Megatron agree on every id and on the vocab size:

- `SentencePieceTokenizer`: the model's pieces, then Megatron's special tokens
  `<CLS>`, `<SEP>`, `<EOD>`, `<MASK>` and the pad / bos / eos pieces, each taking
  the model's own id when the model has that piece and otherwise the next id after
  the model's vocabulary. `eod` is `<EOD>`; `vocab_size` counts the appended tokens.
  A model from tools/train_tokenizer.py has `<EOD>`, `<pad>`, `<s>`, `</s>`, so only
  `<CLS>`, `<SEP>`, `<MASK>` are appended (vocab_size = pieces + 3) and eod is a real
  piece. For a model without them (e.g. Llama's), eod lies past the model's pieces,
  exactly where Megatron's preprocess_data.py puts it.
- `GPTSentencePieceTokenizer`: the model's pieces only; `eod` is the model's `</s>`;
  `pad` is the model's pad id, or eod when it has none.
- `Llama2Tokenizer`: as GPTSentencePieceTokenizer, and every text starts with the
  model's BOS id (Megatron-LM's `_Llama2Tokenizer.tokenize(s, bos=True, eos=False)`), so
  a preprocessed document is `<s> ... </s>` with `--append-eod`. Decoding drops the
  control pieces (`<s>`, `</s>`), as SentencePiece's decode does.

`NullTokenizer` (Megatron's, for data that is already ids): the text is token ids
separated by spaces; `eod` is `--vocab-size`, one past the ids (megaq.data.setup).

`--tokenizer-type` may be left out when `--vocab-file` and `--merge-file` are given:
megaq infers `GPT2BPETokenizer` and notes it (`infer_tokenizer_type`); Megatron-LM
requires the flag.

`tokenize` is SentencePiece's own encoding. (Megatron's SentencePieceTokenizer also
turns literal special-token strings such as "</s>" inside the text into their ids;
megaq encodes such text as text, like SentencePiece. User-defined symbols such as
`<EOD>` are matched by SentencePiece itself, so both agree on them.)

Long documents (:func:`tokenize_in_pieces`, used by preprocessing above a million
characters) are encoded in pieces of about `PIECE_CHARS` characters, so that the
encoder's working memory (about a hundred bytes per character in SentencePiece) stays
bounded. A tokenizer cuts only where its encoding provably separates (its ``cut_at``):

- SentencePiece: at a single ASCII space between two ASCII letters or digits, the space
  dropped. The normalizer turns that space into the ``▁`` the next piece's dummy prefix
  gives back (checked on the model: ``normalize("a b") == "▁a▁b"``; and at each cut, on
  a window around it: normalization does not reach across it), and no piece of the
  model holds a ``▁`` other than first or in a run of only ``▁`` (checked on the
  vocabulary), so every segmentation has a boundary before that lone ``▁`` and the two
  sides are segmented independently. For BPE models (megaq's default) the ids are
  exactly the whole document's. Unigram models: SentencePiece's search keeps its
  running path score in float32, so between segmentations of equal score (a run of
  spaces as ``▁`` + ``▁▁`` or ``▁▁`` + ``▁``) it picks by rounding, which depends on where
  in the input the run lies: the whole document's own ids there are an accident of
  position, and the pieces' ids may pick the other equal-score segmentation (99 of
  11.3 M ids of a 20 MB document, same text and total score; tests/test_data_tokenizer.py
  checks that). Documents of normal length (below preprocessing's million characters)
  are never cut, so their ids are unchanged for every model.
- GPT2BPETokenizer: before a single space between two ASCII letters: no pre-token of
  GPT-2's pattern reaches from a letter across a space, and " word" starts one.
- HuggingFaceTokenizer: never cut (its pipeline is configurable beyond what can be
  checked): such a document is encoded whole, in the tokenizer's own memory.

A model that fails a check, or a stretch of text with no such space (base64, a huge
table of symbols), is encoded whole there.
"""

from __future__ import annotations

import os

from megaq.data.errors import DataError

# the types read from files (the NullTokenizer reads none: megaq.data.config adds it)
SUPPORTED_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "GPT2BPETokenizer", "HuggingFaceTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
DEFAULT_TYPE = "SentencePieceTokenizer"
EOD_PIECE = "<EOD>"
PIECE_CHARS = 1 << 16  # characters per piece of a long document (tokenize_in_pieces)
SPACE_MARK = "\u2581"  # SentencePiece's ▁: an escaped space
_WINDOW = 64  # characters each side of a cut whose normalization is checked


def _word_char(c: str) -> bool:
    return c.isascii() and c.isalnum()


def tokenize_in_pieces(tokenizer, text: str, piece_chars: int = PIECE_CHARS):
    """Yield the ids of `text` in consecutive runs whose concatenation is
    ``tokenizer.tokenize(text)``: pieces of about `piece_chars` characters, cut where the
    tokenizer's ``cut_at(text, pos)`` finds a place at or after `pos` where its encoding
    separates (-> (end of this piece, start of the next)), or whole when it has none."""
    cut_at = getattr(tokenizer, "cut_at", None)
    start = 0
    while cut_at is not None and len(text) - start > 2 * piece_chars:
        cut = cut_at(text, start + piece_chars)
        if cut is None:
            break
        end, start_next = cut
        yield tokenizer.tokenize(text[start:end])
        start = start_next
    yield tokenizer.tokenize(text[start:] if start else text)


class SentencePieceTokenizer:
    """`tokenize(text) -> list[int]`, `detokenize(ids) -> str`, plus vocab_size/eod/pad."""

    def __init__(self, model_path: str, megatron_specials: bool = True):
        import sentencepiece as spm

        self.model_path = model_path
        if not model_path:
            raise DataError("no tokenizer model given; pass --tokenizer-model PATH "
                            "(train one with tools/train_tokenizer.py)")
        if not os.path.isfile(model_path):
            raise DataError(f"{model_path}: tokenizer model not found; check --tokenizer-model "
                            "or train one with tools/train_tokenizer.py")
        if not os.access(model_path, os.R_OK):
            raise DataError(f"{model_path}: tokenizer model is not readable; fix its permissions")
        try:
            with open(model_path, "rb") as f:
                proto = f.read()
            self.sp = spm.SentencePieceProcessor(model_proto=proto)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{model_path}: not a valid SentencePiece model ({e}); "
                            "pass the .model file written by tools/train_tokenizer.py") from None
        n = int(self.sp.get_piece_size())
        if n == 0:
            raise DataError(f"{model_path}: SentencePiece model has an empty vocabulary; retrain it")
        self._appended: dict[str, int] = {}  # Megatron specials the model lacks -> id >= n
        if megatron_specials:
            self._init_megatron_specials()
        else:
            eos = self.sp.eos_id()
            if eos < 0:
                raise DataError(f"{model_path}: model has no eos id, which "
                                "GPTSentencePieceTokenizer uses as eod; use --tokenizer-type "
                                "SentencePieceTokenizer")
            self.eod = int(eos)
            self.pad = int(self.sp.pad_id()) if self.sp.pad_id() >= 0 else self.eod
        self.vocab_size = n + len(self._appended)
        self._appended_by_id = {i: t for t, i in self._appended.items()}
        self.type = "SentencePieceTokenizer" if megatron_specials else "GPTSentencePieceTokenizer"

    def _piece_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return i if self.sp.id_to_piece(i) == piece else None

    def _special(self, piece: str) -> int:
        """Megatron's _add_special_token: the model's id, else the next id after it."""
        i = self._piece_id(piece)
        if i is None:
            i = self._appended.setdefault(piece, self.sp.get_piece_size() + len(self._appended))
        return i

    def _model_piece_or(self, model_id: int, fallback: str) -> int:
        return self._special(self.sp.id_to_piece(model_id) if model_id >= 0 else fallback)

    def _init_megatron_specials(self) -> None:
        # Same order as Megatron-LM's _SentencePieceTokenizer._initalize: ids must match.
        self.cls = self._special("<CLS>")
        self.sep = self._special("<SEP>")
        self.eod = self._special(EOD_PIECE)
        self.mask = self._special("<MASK>")
        self.pad = self._model_piece_or(self.sp.pad_id(), "<PAD>")
        self.bos = self._model_piece_or(self.sp.bos_id(), "<BOS>")
        self.eos = self._model_piece_or(self.sp.eos_id(), "<EOS>")

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def _separable(self) -> bool:
        """Can this model's encoding be cut at a lone space (see the module's docstring)?"""
        if not hasattr(self, "_separable_cached"):
            ok = hasattr(self.sp, "normalize") and self.sp.normalize("a b") == f"{SPACE_MARK}a{SPACE_MARK}b"
            for i in range(self.sp.get_piece_size()):
                if not ok:
                    break
                piece = self.sp.id_to_piece(i)
                ok = SPACE_MARK not in piece[1:] or set(piece) == {SPACE_MARK}
            self._separable_cached = ok
        return self._separable_cached

    def cut_at(self, text: str, pos: int) -> tuple[int, int] | None:
        """The first place at or after `pos` where the encoding separates: a single space
        between ASCII letters / digits, dropped (-> (its index, index + 1)); None if none."""
        if not self._separable():
            return None
        i = text.find(" ", max(pos, 1))
        while 0 < i < len(text) - 1:
            if _word_char(text[i - 1]) and _word_char(text[i + 1]) and self._normalizes_apart(text, i):
                return i, i + 1
            i = text.find(" ", i + 1)
        return None

    def _normalizes_apart(self, text: str, i: int) -> bool:
        """normalize(L + " " + R) == normalize(L) + normalize(R) on a window around the
        space at i, with a lone ▁ there (its neighbours are no spaces after normalizing)."""
        left, right = text[max(0, i - _WINDOW):i], text[i + 1:i + 1 + _WINDOW]
        norm_left, norm_right = self.sp.normalize(left), self.sp.normalize(right)
        return (self.sp.normalize(f"{left} {right}") == norm_left + norm_right
                and not norm_left.endswith(SPACE_MARK) and norm_right.startswith(SPACE_MARK)
                and not norm_right.startswith(SPACE_MARK * 2))

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # One thread: parallelism comes from worker processes, and SentencePiece's own
        # default would grab every core in every worker.
        return self.sp.encode(texts, num_threads=1)

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        if not self._appended_by_id or not any(i in self._appended_by_id for i in ids):
            return self.sp.decode(ids)
        out, run = [], []
        for i in ids:  # appended specials are not model pieces: splice in their text
            if i in self._appended_by_id:
                out.append(self.sp.decode(run))
                out.append(self._appended_by_id[i])
                run = []
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    def __repr__(self):
        return (f"{self.type}({self.model_path!r}, vocab_size={self.vocab_size}, "
                f"eod={self.eod}, pad={self.pad})")


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's `Llama2Tokenizer`: GPTSentencePieceTokenizer's ids with the model's
    BOS id before every text."""

    def __init__(self, model_path: str):
        super().__init__(model_path, megatron_specials=False)
        self.type = "Llama2Tokenizer"
        if self.sp.bos_id() < 0:
            raise DataError(f"{model_path}: model has no bos id, which Llama2Tokenizer puts "
                            "before every text; use --tokenizer-type GPTSentencePieceTokenizer")
        self.bos = int(self.sp.bos_id())

    def tokenize(self, text: str) -> list[int]:
        return [self.bos] + self.sp.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [[self.bos] + ids for ids in self.sp.encode(texts, num_threads=1)]


class NullTokenizer:
    """Megatron's NullTokenizer: text is token ids separated by spaces, and back."""

    type = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if not vocab_size or vocab_size < 1:
            raise DataError("--tokenizer-type NullTokenizer needs --vocab-size N (the ids are "
                            "below N)")
        self.vocab_size = int(vocab_size)
        self.eod = self.pad = self.vocab_size  # one past the ids (Megatron's), never in them

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if not (word.isdigit() and int(word) < self.vocab_size):
                raise DataError(f"NullTokenizer: {word!r} is not a token id below "
                                f"{self.vocab_size}; the text must be ids separated by spaces")
            ids.append(int(word))
        return ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __repr__(self):
        return f"NullTokenizer(vocab_size={self.vocab_size})"


def infer_tokenizer_type(tokenizer_type: str | None, tokenizer_model: str | None,
                         vocab_file: str | None, merge_file: str | None) -> str:
    """--tokenizer-type as given, else what the other tokenizer flags imply: the GPT-2
    BPE when --vocab-file and --merge-file are given (and no --tokenizer-model), else
    the default SentencePieceTokenizer."""
    if tokenizer_type:
        return tokenizer_type
    if vocab_file and merge_file and not tokenizer_model:
        return "GPT2BPETokenizer"
    return DEFAULT_TYPE


def inferred_type_note(tokenizer_type: str | None, tokenizer_model: str | None,
                       vocab_file: str | None, merge_file: str | None) -> str | None:
    """The note to print when --tokenizer-type was inferred from the other flags."""
    if tokenizer_type or infer_tokenizer_type(None, tokenizer_model, vocab_file,
                                              merge_file) == DEFAULT_TYPE:
        return None
    return ("note: --tokenizer-type GPT2BPETokenizer inferred from --vocab-file and "
            "--merge-file (Megatron-LM requires the flag; pass it to silence this note)")


def check_tokenizer_flags(tokenizer_type: str, tokenizer_model: str | None,
                          vocab_file: str | None, merge_file: str | None,
                          purpose: str = "") -> None:
    """Refuse a tokenizer type without the files it is read from (one DataError line,
    before any worker or rank starts); `purpose` ends the line, e.g. "used to
    preprocess --data-path". Used by DataConfig and tools/preprocess_data.py."""
    tail = f" {purpose}" if purpose else ""
    if tokenizer_type == "GPT2BPETokenizer":
        if not (vocab_file and merge_file):
            raise DataError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and "
                            f"--merge-file (GPT-2's encoder.json and vocab.bpe{tail})")
    elif tokenizer_type in SUPPORTED_TYPES and not tokenizer_model and (vocab_file or merge_file):
        given = "--vocab-file" if vocab_file else "--merge-file"
        raise DataError(f"{given} is the GPT-2 BPE's: pass --vocab-file and --merge-file together "
                        f"(GPT2BPETokenizer is then inferred), or --tokenizer-model PATH for "
                        f"--tokenizer-type {tokenizer_type}")
    elif tokenizer_type in SUPPORTED_TYPES and not tokenizer_model:
        what = ("a local tokenizer directory" if tokenizer_type == "HuggingFaceTokenizer"
                else "the SentencePiece .model file")
        raise DataError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model PATH "
                        f"({what}{tail})")


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None,
                    vocab_file: str | None = None, merge_file: str | None = None,
                    vocab_size: int | None = None):
    """Megatron's `--tokenizer-type` / `--tokenizer-model` / `--vocab-file` /
    `--merge-file` (/ `--vocab-size` for the NullTokenizer) -> tokenizer object."""
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type not in SUPPORTED_TYPES:
        raise DataError(f"--tokenizer-type {tokenizer_type!r} is not supported; "
                        f"use one of {', '.join(SUPPORTED_TYPES + ('NullTokenizer',))}")
    if tokenizer_type == "GPT2BPETokenizer":
        from megaq.data.gpt2_bpe import GPT2BPETokenizer
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        from megaq.data.hf_tokenizer import HuggingFaceTokenizer
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    return SentencePieceTokenizer(tokenizer_model,
                                  megatron_specials=tokenizer_type == "SentencePieceTokenizer")
