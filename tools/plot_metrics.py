#!/usr/bin/env python
"""Plot one or more metrics files (pretrain_gpt.py --metrics-file) as PNG curves.

The `megaq-plot` command (megaq.cli.plot_metrics), kept here for Megatron-LM's habit:
`python tools/plot_metrics.py --help`, from a checkout with or without megaq installed.
"""

import _checkout

if __name__ == "__main__":
    _checkout.run("plot_metrics")
