#!/usr/bin/env python
"""Train a SentencePiece tokenizer (BPE or unigram) from jsonl or text files.

The `megaq-train-tokenizer` command (megaq.cli.train_tokenizer), kept here for Megatron-LM's habit:
`python tools/train_tokenizer.py --help`, from a checkout with or without megaq installed.
"""

import _checkout

if __name__ == "__main__":
    _checkout.run("train_tokenizer")
