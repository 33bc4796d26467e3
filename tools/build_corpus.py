#!/usr/bin/env python
"""Build the built-in corpus (Python standard-library text, no download).

The `megaq-build-corpus` command (megaq.cli.build_corpus), kept here for Megatron-LM's habit:
`python tools/build_corpus.py --help`, from a checkout with or without megaq installed.
"""

import _checkout

if __name__ == "__main__":
    _checkout.run("build_corpus")
