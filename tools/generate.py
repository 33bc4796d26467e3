#!/usr/bin/env python
"""Sample text from a pretrain_gpt.py checkpoint, on one process (TP = PP = 1).

The `megaq-generate` command (megaq.cli.generate), kept here for Megatron-LM's habit:
`python tools/generate.py --help`, from a checkout with or without megaq installed.
"""

import _checkout

if __name__ == "__main__":
    _checkout.run("generate")
