#!/usr/bin/env python
"""Tokenize jsonl into Megatron-LM's indexed dataset (.bin/.idx), Megatron's CLI.

The `megaq-preprocess` command (megaq.cli.preprocess_data), kept here for Megatron-LM's habit:
`python tools/preprocess_data.py --help`, from a checkout with or without megaq installed.
"""

import _checkout

if __name__ == "__main__":
    _checkout.run("preprocess_data")
