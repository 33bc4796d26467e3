"""Pretrain a GPT / Llama-style model: Megatron-LM's flags, megaq's TP x PP x ZeRO(++).

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 12 --hidden-size 768 ...

The entry script only; the code is megaq.pretrain (main, build_trainer, cli), which
tests and tools import instead of this file. --help lists every flag.
"""

from megaq.pretrain import cli, exit_now

if __name__ == "__main__":
    exit_now(cli())
