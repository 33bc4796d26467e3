"""GPT-2 byte-level BPE (`--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file`).

The scheme of OpenAI's GPT-2 and of Megatron-LM's GPT2BPETokenizer, written for megaq:

1. Pre-tokenize the text with GPT-2's pattern: contractions ('s 't 're 've 'm 'll 'd),
   then runs of letters, runs of numbers and runs of other non-space characters, each
   optionally with one leading space, then whitespace (a whitespace run gives its last
   space to the word after it).
2. Map every UTF-8 byte of a piece to one printable character (the byte-to-unicode
   table below), so the vocabulary never needs raw bytes or control characters.
3. Merge adjacent symbols by the rank of the merge in vocab.bpe (lowest rank first,
   every occurrence left to right), until no ranked pair remains; look the symbols
   up in encoder.json.

Megatron's pattern uses the third-party `regex` module for \\p{L} and \\p{N}; megaq
builds the same character classes from `unicodedata` once and uses the standard `re`.
`\\s` is Unicode's White_Space set (as in `regex` and in the Rust `tokenizers`), which
is narrower than `str.isspace` (that one also counts U+001C..U+001F).

Special strings such as "<|endoftext|>" inside text are encoded as text, as Megatron
does; `eod` is the id of "<|endoftext|>" in the vocabulary.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import unicodedata

from megaq.data.errors import DataError

EOD_TOKEN = "<|endoftext|>"
CONTRACTIONS = ("s", "t", "re", "ve", "m", "ll", "d")
# Unicode's White_Space property (what \s means to `regex` and to `tokenizers`).
WHITE_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B)))
               + "\u2028\u2029\u202f\u205f\u3000")


def bytes_to_unicode() -> dict[int, str]:
    """Byte value -> printable character. Printable Latin-1 bytes map to themselves; the
    other 68 (controls, space, DEL, NBSP, soft hyphen...) to U+0100 onwards, in byte
    order, so no symbol is whitespace or a control character."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _class_ranges(pred) -> str:
    """A regex character-class body listing every code point where pred(char) holds."""
    out, start = [], None
    for cp in range(sys.maxunicode + 2):
        hit = cp <= sys.maxunicode and pred(chr(cp))
        if hit and start is None:
            start = cp
        elif not hit and start is not None:
            a, b = start, cp - 1
            out.append(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}")
            start = None
    return "".join(out)


@functools.lru_cache(maxsize=1)
def pretokenize_pattern() -> re.Pattern:
    """GPT-2's pre-tokenizer as a compiled `re` pattern (built once, ~1 s)."""
    letters = _class_ranges(lambda c: unicodedata.category(c)[0] == "L")
    numbers = _class_ranges(lambda c: unicodedata.category(c)[0] == "N")
    space = "".join(f"\\U{ord(c):08x}" for c in WHITE_SPACE)
    contractions = "|".join("'" + c for c in CONTRACTIONS)
    return re.compile(
        f"{contractions}"
        f"| ?[{letters}]+"
        f"| ?[{numbers}]+"
        f"| ?[^{space}{letters}{numbers}]+"
        f"|[{space}]+(?![^{space}])"
        f"|[{space}]+")


class GPT2BPETokenizer:
    """`tokenize(text) -> list[int]`, `detokenize(ids) -> str`, vocab_size, eod, pad."""

    type = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.encoder = _read_vocab(vocab_file)
        self.decoder = {i: s for s, i in self.encoder.items()}
        self.ranks = _read_merges(merge_file)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        missing = [c for c in self.byte_encoder.values() if c not in self.encoder]
        if missing:
            raise DataError(f"{vocab_file}: not a byte-level BPE vocabulary: {len(missing)} of "
                            f"the 256 byte symbols are missing (e.g. {missing[0]!r}); pass "
                            "GPT-2's encoder.json (or one made by the same scheme)")
        if EOD_TOKEN not in self.encoder:
            raise DataError(f"{vocab_file}: vocabulary has no {EOD_TOKEN!r}, which "
                            "GPT2BPETokenizer uses as end of document; add it to the vocabulary")
        self.vocab_size = len(self.encoder)
        self.eod = self.pad = self.encoder[EOD_TOKEN]
        self.pattern = pretokenize_pattern()
        self._cache: dict[str, list[int]] = {}

    def bpe(self, symbols: str) -> list[str]:
        """Merge one pre-token's byte symbols by rank until no ranked pair is left."""
        word = list(symbols)
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def _encode_piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            try:
                raw = piece.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (e.g. "\\ud800" in JSON)
                raise DataError(f"text holds an unpaired surrogate ({piece!r}), which has no "
                                "UTF-8 bytes; fix the text") from None
            symbols = "".join(self.byte_encoder[b] for b in raw)
            try:
                ids = [self.encoder[s] for s in self.bpe(symbols)]
            except KeyError as e:
                raise DataError(f"{self.merge_file}: merge result {e.args[0]!r} is not in "
                                f"{self.vocab_file}; the vocab and merge files do not belong "
                                "together") from None
            if len(self._cache) < 1 << 18:  # bounded: a corpus has a long tail of pieces
                self._cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self.pattern.findall(text):
            out.extend(self._encode_piece(piece))
        return out

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def cut_at(self, text: str, pos: int) -> tuple[int, int] | None:
        """The first place at or after `pos` where the encoding separates (for
        megaq.data.tokenizer.tokenize_in_pieces): before a single space between two ASCII
        letters, which stays with the next piece (no pre-token reaches from a letter across
        a space; " word" starts one). -> (index, index); None if there is none."""
        i = text.find(" ", max(pos, 1))
        while 0 < i < len(text) - 1:
            before, after = text[i - 1], text[i + 1]
            if before.isascii() and before.isalpha() and after.isascii() and after.isalpha():
                return i, i
            i = text.find(" ", i + 1)
        return None

    def detokenize(self, ids) -> str:
        data = bytearray()
        for i in ids:
            data.extend(self.byte_decoder[c] for c in self.decoder[int(i)])
        return data.decode("utf-8", errors="replace")

    def __repr__(self):
        return (f"GPT2BPETokenizer({self.vocab_file!r}, {self.merge_file!r}, "
                f"vocab_size={self.vocab_size}, eod={self.eod})")


def _check_file(path: str, flag: str) -> None:
    if not path:
        raise DataError(f"GPT2BPETokenizer needs {flag} PATH (GPT-2's "
                        f"{'encoder.json' if flag == '--vocab-file' else 'vocab.bpe'})")
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found; check {flag}")


def _read_vocab(path: str) -> dict[str, int]:
    _check_file(path, "--vocab-file")
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a JSON vocabulary ({e}); --vocab-file takes GPT-2's "
                        "encoder.json (token -> id)") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise DataError(f"{path}: expected a JSON object of token -> integer id; --vocab-file "
                        "takes GPT-2's encoder.json")
    if len(set(vocab.values())) != len(vocab):
        raise DataError(f"{path}: two tokens share an id; the vocabulary is corrupt")
    return vocab


def _read_merges(path: str) -> dict[tuple[str, str], int]:
    """vocab.bpe: an optional '#version' line, then one 'left right' merge per line."""
    _check_file(path, "--merge-file")
    ranks, rank = {}, 0
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the merge file ({e}); --merge-file takes "
                        "GPT-2's vocab.bpe") from None
    for lineno, line in enumerate(lines, 1):
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise DataError(f"{path}:{lineno}: expected two symbols per merge line, got "
                            f"{line!r}; --merge-file takes GPT-2's vocab.bpe")
        ranks[(parts[0], parts[1])] = rank  # a repeated merge keeps its last rank, as Megatron's
        rank += 1
    return ranks
