#!/usr/bin/env python
"""Sample text from a pretrain_gpt.py checkpoint, on one process (TP = PP = 1).

    python tools/generate.py --load CKPT_DIR --prompt "def main(" --max-new-tokens 80

Any TP x PP x DP layout loads: the checkpoint holds full (DP-consolidated) weights per
TP x PP rank; pipeline stages are stitched back by global layer index and TP shards
concatenated along each parameter's partition dimension (checked by re-slicing:
if any shard does not round-trip, the tool refuses rather than sample from a
scrambled model).
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaq import checkpoint as ckpt  # noqa: E402
from megaq.parallel.comm import Group  # noqa: E402
from megaq.parallel.tensor_parallel import shard_of  # noqa: E402


class GenerateError(RuntimeError):
    """A checkpoint or tokenizer problem; the message names it and the fix."""


def _fake_tp_group(rank: int, size: int) -> Group:
    # Only shapes and slicing are needed (no collective runs while building a model).
    return Group(ranks=list(range(size)), nodes=[0] * size, pg=None, rank_index=rank)


def load_consolidated(ckpt_dir: str):
    """-> (args namespace, {global name: [per TP rank full-state entry]}, TP size)."""
    tp, pp = ckpt.checkpoint_layout(ckpt_dir)
    args, saved = ckpt.read_all_stages(ckpt_dir, tp, pp)
    return SimpleNamespace(**args), saved["params"], tp


def build_model(args, tp_ckpt: int):
    import pretrain_gpt
    from megaq.model import GPTModel

    # Same padded vocab as the checkpoint: pad to (divisible_by x old TP) at TP = 1.
    args.make_vocab_size_divisible_by = args.make_vocab_size_divisible_by * tp_ckpt
    args.sequence_parallel, args.recompute_activations, args.bf16 = False, False, False
    config = pretrain_gpt.model_config(args)
    model = GPTModel(config)
    tp_views = [GPTModel(config, _fake_tp_group(r, tp_ckpt)) for r in range(tp_ckpt)] \
        if tp_ckpt > 1 else None
    return model, tp_views


def consolidate_into(model, tp_views, shards: dict, tp: int) -> None:
    own = dict(model.named_parameters())
    missing = [n for n in own if n not in shards]
    if missing:
        raise GenerateError(f"checkpoint lacks {len(missing)} parameters (e.g. {missing[:3]})")
    views = [dict(v.named_parameters()) for v in tp_views] if tp_views else None
    with torch.no_grad():
        for name, param in own.items():
            parts = [x["param"] for x in shards[name]]
            if tp == 1 or not getattr(views[0][name], "tensor_model_parallel", False):
                full = parts[0]
            else:
                dim, stride = views[0][name].partition_dim, views[0][name].partition_stride
                full = ckpt.concat_tp_shards(parts, dim, stride)
                for r in range(tp):
                    if not torch.equal(shard_of(full, dim, r, tp, stride), parts[r]):
                        raise GenerateError(f"cannot consolidate {name} from TP={tp} shards "
                                            f"(layout not invertible); sample with the "
                                            f"training layout instead")
            if full.shape != param.shape:
                raise GenerateError(f"{name}: consolidated shape {tuple(full.shape)} != model "
                                    f"{tuple(param.shape)}")
            param.copy_(full)


@torch.no_grad()
def sample(model, ids: list[int], n: int, vocab_size: int, seq_length: int, temperature: float,
           top_k: int, generator: torch.Generator) -> list[int]:
    model.eval()
    out = list(ids)
    for _ in range(n):
        ctx = torch.tensor([out[-seq_length:]], dtype=torch.long)
        logits = model(input_ids=ctx)[0, -1, :vocab_size].float()
        if temperature <= 0:
            out.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, vocab_size)).values[-1]
            logits[logits < kth] = -float("inf")
        out.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True,
                   help="checkpoint root (uses latest_checkpointed_iteration.txt) or an iter_* dir")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-model", default=None, help="default: the checkpoint's")
    a = p.parse_args(argv)
    try:
        ckpt_dir = a.load
        if not os.path.basename(os.path.normpath(ckpt_dir)).startswith("iter_"):
            it = ckpt.read_tracker(ckpt_dir)
            if it is None:
                raise GenerateError(f"{ckpt_dir} holds no {ckpt.TRACKER_FILE}; pass a checkpoint "
                                    f"directory written by pretrain_gpt.py --save")
            ckpt_dir = ckpt.iteration_dir(ckpt_dir, it)
        args, shards, tp = load_consolidated(ckpt_dir)
        model, views = build_model(args, tp)
        consolidate_into(model, views, shards, tp)
        tok_path = a.tokenizer_model or args.tokenizer_model
        if not tok_path or not os.path.isfile(tok_path):
            raise GenerateError(f"tokenizer model {tok_path!r} not found (the run used mock data, "
                                f"or the file moved); pass --tokenizer-model")
        from megaq.data.tokenizer import build_tokenizer
        # the run's own tokenizer type: its eod/vocab rules differ between types
        tok = build_tokenizer(getattr(args, "tokenizer_type", None) or "SentencePieceTokenizer",
                              tok_path)
    except (GenerateError, ckpt.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(a.seed)
    ids = tok.tokenize(a.prompt)
    out = sample(model, ids, a.max_new_tokens, args.vocab_size, args.seq_length,
                 a.temperature, a.top_k, g)
    print(f"[generate] {ckpt_dir} (trained with TP={tp}; consolidated to one process)")
    print(tok.detokenize(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
