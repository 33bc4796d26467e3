#!/usr/bin/env python
"""Convert checkpoints between megaq and other formats, on one process.

The `megaq-convert` command (megaq.cli.convert_checkpoint), kept here for Megatron-LM's habit:
`python tools/convert_checkpoint.py --help`, from a checkout with or without megaq installed.
"""

import _checkout

if __name__ == "__main__":
    _checkout.run("convert_checkpoint")
