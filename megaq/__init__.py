"""megaq: GPT pretraining with Megatron-style TP/PP and a ZeRO-3 engine speaking ZeRO++.

`megaq.kernels` is the repository's top-level `kernels/` folder: `megaq/kernels` is a
symbolic link to it, so a checkout (installed or not), an editable install and a wheel
all import the kernels under this one name, and static tools follow the link.
"""

__version__ = "0.1.0"
