"""megaq: GPT pretraining with Megatron-style TP/PP and a ZeRO-3 engine speaking ZeRO++."""

__version__ = "0.1.0"
