"""Convert checkpoints between megaq and other formats, on one process.

    # megaq checkpoint (any TP x PP layout) -> transformers directory
    python tools/convert_checkpoint.py --from megaq --to hf --input CKPT --output HF_DIR [--dtype bf16]

    # megaq checkpoint in one --ckpt-format -> the other (torch <-> torch_dist), same layout
    python tools/convert_checkpoint.py --from megaq --to megaq --ckpt-format torch --input CKPT --output OUT

    # transformers Llama-family / GPT-2 directory -> megaq checkpoint for a layout
    python tools/convert_checkpoint.py --from hf --to megaq --input HF_DIR --output CKPT \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

    # megaq checkpoint -> Megatron-LM torch_dist checkpoint with the distributed optimizer's state
    python tools/convert_checkpoint.py --from megaq --to megatron --input CKPT --output MEGATRON_DIR \\
        [--megatron-transformer-impl local]

    # Megatron-LM (megatron-core) checkpoint, torch_dist or torch format -> megaq checkpoint
    # for a layout (torch_dist: with the optimizer state, LR schedule and position)
    python tools/convert_checkpoint.py --from megatron --to megaq --input MEGATRON_CKPT --output CKPT \\
        --tensor-model-parallel-size 2

    # DeepSpeed checkpoint (a ZeRO-3 tag, or the universal form ds_to_universal.py makes) of a
    # megaq GPTModel or a transformers model -> megaq checkpoint for a layout, with the Adam state
    python tools/convert_checkpoint.py --from deepspeed --to megaq --input DS_SAVE_DIR --output CKPT \\
        (--num-attention-heads 16 | --hf-config HF_CONFIG_JSON) [--tensor-model-parallel-size 2]

The import writes CKPT/megaq_args.txt: the architecture and layout flags to give
pretrain_gpt.py together with `--load CKPT --no-load-rng`. docs/INTEROP.md has the
name mapping and what is refused. Each route is one function in ROUTES below; a new
source or target adds one entry.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SOURCES = ("megaq", "hf", "megatron", "deepspeed")
TARGETS = ("megaq", "hf", "megatron")


def _parse_size(text: str) -> int:
    """'5GB', '40KB', '1048576' -> bytes (binary units, as transformers' max_shard_size)."""
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40, "B": 1}
    t = text.strip().upper()
    unit = next((u for u in units if t.endswith(u)), "")  # KB before B
    try:
        size = int(float(t[:len(t) - len(unit)]) * units.get(unit, 1))
    except (ValueError, OverflowError):  # not a number; inf
        size = 0
    # argparse turns this into the flag's one error line
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give a positive number of "
                                         f"bytes or one with KB, MB, GB or TB (e.g. 5GB)")
    return size


def megaq_to_hf(a) -> str:
    from megaq.interop.hf import DTYPES, export_to_hf
    t0 = time.perf_counter()
    out = export_to_hf(a.input, a.output, dtype=DTYPES[a.dtype],
                       max_shard_bytes=a.max_shard_size, tokenizer_type=a.tokenizer_type,
                       tokenizer_model=a.tokenizer_model, vocab_file=a.vocab_file,
                       merge_file=a.merge_file, overwrite=a.overwrite)
    pad = (f"; vocab {out['vocab']} padded to {out['padded_vocab']} (padded ids suppressed in "
           f"generation_config.json)" if out["padded_vocab"] > out["vocab"] else "")
    tok = (f"; tokenizer {out['tokenizer_spec'].describe()}" if out["tokenizer"] else
           "; no tokenizer")
    return (f"[convert] {out['source']} -> {out['dir']}: {out['family']}, {a.dtype}, "
            f"{len(out['files'])} safetensors file(s), {out['bytes'] / 2**20:.1f} MiB"
            f"{pad}{tok}; {time.perf_counter() - t0:.1f} s\n"
            f"[convert] load it with: python -c \"from transformers import AutoModelForCausalLM, "
            f"AutoTokenizer; m = AutoModelForCausalLM.from_pretrained('{out['dir']}')"
            + (f"; t = AutoTokenizer.from_pretrained('{out['dir']}')" if out["tokenizer"] else "")
            + "\"")


def hf_to_megaq(a) -> str:
    from megaq.interop.hf import import_from_hf
    t0 = time.perf_counter()
    out = import_from_hf(a.input, a.output, tp=a.tensor_model_parallel_size,
                         pp=a.pipeline_model_parallel_size, vp=a.virtual_pipeline_size,
                         seq_length=a.seq_length,
                         make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                         overwrite=a.overwrite)
    return (f"[convert] {a.input} -> {out['dir']}: {out['family']} at TP="
            f"{a.tensor_model_parallel_size} x PP={a.pipeline_model_parallel_size}, iteration 0, "
            f"{time.perf_counter() - t0:.1f} s\n"
            f"[convert] train from it with: python pretrain_gpt.py {' '.join(out['flags'])} "
            f"{' '.join(out['load_flags'])} <data and training flags>\n"
            f"[convert] (the flags are in {os.path.join(out['dir'], 'megaq_args.txt')})")


def megaq_format(a) -> str:
    from megaq.interop.ckpt_format import convert_format
    t0 = time.perf_counter()
    out = convert_format(a.input, a.output, a.ckpt_format, overwrite=a.overwrite)
    return (f"[convert] {a.input} ({out['from']}) -> {out['dir']} ({out['to']}); "
            f"{time.perf_counter() - t0:.1f} s\n"
            f"[convert] resume from it with: python pretrain_gpt.py --load {a.output} "
            f"<the run's flags>")


def megatron_to_megaq(a) -> str:
    """megaq.interop.megatron.convert_to_megaq(a) -> the message to print; `a` holds input,
    output, overwrite and the --to megaq layout flags; refusals raise InteropError.
    megaq.interop.common has the writing side (megaq_layout, megaq_run_config,
    write_megaq_checkpoint, write_megaq_args, temp_dir_for / replace_dir)."""
    try:
        from megaq.interop import megatron
    except ImportError:
        raise _RouteMissing("--from megatron is not available in this checkout "
                            "(megaq/interop/megatron.py is missing)") from None
    return megatron.convert_to_megaq(a)


def megaq_to_megatron(a) -> str:
    from megaq.interop.megatron_export import export_to_megatron
    t0 = time.perf_counter()
    out = export_to_megatron(a.input, a.output, impl=a.megatron_transformer_impl)
    return (f"[convert] {a.input} -> {out['dir']}: Megatron-LM torch_dist, iteration "
            f"{out['iteration']}, {out['params']} parameters with the distributed optimizer's "
            f"state (dp_reshardable, TP 1 x PP 1, any DP), {a.megatron_transformer_impl} layer "
            f"order; {time.perf_counter() - t0:.1f} s\n"
            f"[convert] load it in Megatron-LM with: --load {out['dir']} --ckpt-format torch_dist "
            f"--use-distributed-optimizer --transformer-impl {a.megatron_transformer_impl} "
            f"--no-load-rng and the run's architecture flags")


def deepspeed_to_megaq(a) -> str:
    """megaq.interop.deepspeed.convert_to_megaq(a): `a` as for --from megatron, plus
    num_attention_heads and model_flags."""
    from megaq.interop import deepspeed
    return deepspeed.convert_to_megaq(a)


ROUTES = {("megaq", "hf"): megaq_to_hf, ("hf", "megaq"): hf_to_megaq,
          ("megaq", "megaq"): megaq_format, ("deepspeed", "megaq"): deepspeed_to_megaq,
          ("megatron", "megaq"): megatron_to_megaq, ("megaq", "megatron"): megaq_to_megatron}


class _RouteMissing(RuntimeError):
    """A --from/--to pair whose converter module is not part of this install."""


def build_parser() -> argparse.ArgumentParser:
    from megaq.data.config import TOKENIZER_TYPES
    from megaq.data.errors import ArgumentParser
    # a bad flag is one `error: ... (see --help)` line (a DataError, main prints it)
    p = ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--from", dest="source", choices=SOURCES, default="megaq",
                   help="format of --input")
    p.add_argument("--to", dest="target", choices=TARGETS, required=True,
                   help="format of --output")
    p.add_argument("--input", required=True,
                   help="megaq: checkpoint root or iter_* dir; hf: transformers model directory; "
                        "megatron: Megatron-LM checkpoint root (latest_checkpointed_iteration.txt) "
                        "or its iter_*/release dir; deepspeed: save_checkpoint's directory "
                        "(latest_universal / latest), a ZeRO-3 global_step* tag or its "
                        "ds_to_universal.py output")
    p.add_argument("--output", required=True, help="directory to write (must not exist)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output that holds only an earlier output of the "
                        "same kind written by megaq (an export for --to hf, a checkpoint for --to "
                        "megaq); any other directory is refused")
    g = p.add_argument_group("--to hf")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the written weights (the checkpoint holds fp32 masters)")
    g.add_argument("--max-shard-size", default="5GB", type=_parse_size,
                   help="split the safetensors above this size (with model.safetensors.index.json)")
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="tokenizer to ship; None: the run's (inferred from the files below "
                        "when they are given)")
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece model or Hugging Face tokenizer directory to ship; None: "
                        "the checkpoint's copy of the run's (or the path the run recorded)")
    g.add_argument("--vocab-file", default=None,
                   help="GPT2BPETokenizer: vocab.json to ship; None: the checkpoint's copy")
    g.add_argument("--merge-file", default=None,
                   help="GPT2BPETokenizer: merges.txt to ship; None: the checkpoint's copy")
    g = p.add_argument_group("--from megaq --to megaq")
    g.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="format to write (the input is in the other one; layout unchanged)")
    g = p.add_argument_group("--to megatron")
    g.add_argument("--megatron-transformer-impl", choices=["transformer_engine", "local"],
                   default="transformer_engine",
                   help="the layer spec of the Megatron-LM run that loads the output (its "
                        "--transformer-impl): it fixes the order of the optimizer's buckets")
    g = p.add_argument_group("--from megatron / --from deepspeed")
    g.add_argument("--no-optimizer", action="store_true",
                   help="Megatron torch_dist or DeepSpeed input: import the weights only (fresh "
                        "AdamW moments, iteration 0); by default the optimizer's state (Adam "
                        "moments, step), the iteration and the consumed samples are imported "
                        "(from Megatron also the LR schedule)")
    g = p.add_argument_group("--from deepspeed")
    g.add_argument("--num-attention-heads", type=int, default=None,
                   help="a run of megaq's GPTModel: its attention heads (required: the "
                        "checkpoint records shapes only; the rest of the architecture is read "
                        "off them)")
    g.add_argument("--hf-config", default=None,
                   help="a run of a transformers model (Llama family, Qwen3, GPT-2): its "
                        "config.json, or a directory holding it; the names and architecture "
                        "are mapped as --from hf maps them")
    g.add_argument("--model-flags", default=None,
                   help="other pretrain_gpt.py architecture flags of the run that shapes do not "
                        "show, as one string given with '=' (e.g. --model-flags=\"--rotary-base "
                        "500000 --norm-epsilon 1e-6\"); recorded in megaq_args.txt")
    g = p.add_argument_group("--to megaq")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-size", type=int, default=1,
                   help="model chunks per pipeline stage (interleaved 1F1B)")
    g.add_argument("--seq-length", type=int, default=None,
                   help="--seq-length to write in the flags (default: the model's positions, at "
                        "most 4096 for RoPE models; --from deepspeed with RoPE: required)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=1,
                   help="vocab padding multiple (x TP); 1 keeps the model's vocab where TP divides it")
    return p


def main(argv=None) -> int:
    from megaq.checkpoint.errors import CheckpointError
    from megaq.data.errors import DataError
    from megaq.interop.errors import InteropError
    try:
        a = build_parser().parse_args(argv)
        route = ROUTES.get((a.source, a.target))
        if route is None:
            raise DataError(f"no conversion from {a.source} to {a.target}; available: "
                            + ", ".join(f"--from {s} --to {t}" for s, t in ROUTES))
        print(route(a), flush=True)
    except (InteropError, CheckpointError, DataError, _RouteMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cli() -> int:
    """The `megaq-convert_checkpoint` command and tools/convert_checkpoint.py."""
    return main()
