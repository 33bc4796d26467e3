#!/usr/bin/env python
"""Issue 18's GPU check: a trained megaq model, exported to Hugging Face form, gives megaq's logits in transformers.

    python tools/bench/check_hf_export_gpu.py                     # H200: 1.3B Llama + small GPT-2
    python tools/bench/check_hf_export_gpu.py --tiny --device cpu  # the same steps, tiny models

For each model (tools/bench/bench_train.py's 1.3B Llama on random tokens; a small GPT-2
with the built-in corpus's SentencePiece tokenizer, vocabulary padded for generation):

1. train --steps steps in this process as bench_train.py's megaq-s0 does (bf16 GPTModel,
   fp32 master weights, megaq.zero stage 0, AdamW) on random tokens;
2. save a megaq checkpoint (megaq.checkpoint.save.save_checkpoint, weights + AdamW moments);
3. export it with `tools/convert_checkpoint.py --to hf --dtype bf16` in its own process,
   timed and memory-sampled as tools/bench/bench_convert.py measures (peak RssAnon: what
   the converter allocated; peak VmHWM: also the memory-mapped checkpoint pages read);
4. load the export with AutoModelForCausalLM twice (bf16, and fp32: the same bf16 values
   upcast) and compare its logits on --sequences x --seq-len tokens with megaq's:
     mapping   transformers fp32 vs megaq fp32 (load_consolidated_model, tools/generate.py's
               path) with the checkpoint's weights rounded to bf16 as the export rounds
               them: identical weights, so only summation order differs (~1e-6);
     bf16      transformers bf16 vs the trained megaq model's own bf16 forward (its bf16
               weights are the master rounded, checked): the number issue 18 asks for;
     context   megaq bf16 vs megaq fp32 of the unrounded master: what bf16 alone costs;
5. with a tokenizer: AutoTokenizer on the export encodes and decodes as megaq's does.

Prints a table and writes JSON (--out-json, default $OUT/check_hf_export.json). Exit 1 if
the mapping check or the tokenizer check fails. Needs transformers (pyproject.toml's hf
extra). TF32 is off, so fp32 matmuls are fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import time

import torch

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
REPO = _checkout.ROOT

import bench_convert  # noqa: E402  (measure: a converter process's time and peak memory)
import bench_train  # noqa: E402  (the 1.3B preset, its optimizer settings)

MAPPING_TOLERANCE = 1e-4  # max relative, fp32 both sides, same weights (observed ~1e-6)
LR = 3e-4  # bench_train.py's


# --------------------------------------------------------------------------- models
def model_configs(tiny: bool, with_gpt2: bool, tokenizer_vocab) -> dict:
    """{name: (GPTConfig with params_dtype bf16, micro-batch)}."""
    from megaq.model import GPTConfig
    bf16 = torch.bfloat16
    if tiny:
        models = {"llama-tiny-gqa": (GPTConfig.llama(
            num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
            num_query_groups=2, vocab_size=1000, seq_length=128, params_dtype=bf16), 2)}
    else:
        models = {"llama-1.3B": (bench_train.megaq_config("1.3B"), bench_train.SIZES["1.3B"][3])}
    if with_gpt2:  # GPT-2 family: learned positions, LayerNorm, GELU, biases, tied, padded vocab
        size = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128) if tiny \
            else dict(num_layers=6, hidden_size=512, num_attention_heads=8, seq_length=1024)
        models["gpt2-tied-small"] = (GPTConfig(
            **size, vocab_size=tokenizer_vocab(), attention_dropout=0.0, hidden_dropout=0.0,
            params_dtype=bf16), 4)
    return models


def run_config(model, steps: int, micro_batch: int, data_flags: list[str]):
    """The RunConfig a checkpoint records: pretrain_gpt.py's parse of the run's flags, with
    `model` (the GPTConfig actually trained) as its model section."""
    from megaq.config.arguments import parse_config
    flags = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
             "--num-attention-heads", str(model.num_attention_heads),
             "--seq-length", str(model.seq_length), "--micro-batch-size", str(micro_batch),
             "--train-iters", str(steps), "--lr", str(LR), "--bf16", *data_flags]
    run = parse_config(flags, world_size=1)
    return dataclasses.replace(run.resolved(run.data, model.vocab_size), model=model)


def train_and_save(model_cfg, run, dev, steps: int, micro_batch: int, root: str) -> tuple:
    """bench_train.py's megaq-s0 step (one process, stage 0) for `steps` steps on random
    tokens, then save_checkpoint. Returns (bf16 model, losses, seconds to train, to save)."""
    from megaq.checkpoint.save import save_checkpoint
    from megaq.lr_schedule import LRSchedule
    from megaq.parallel.topology import Layout, build_topology
    from megaq.parallelize import parallelize
    from megaq.zero import OptimizerSettings, ZeroConfig

    t0 = time.perf_counter()
    topo = build_topology(Layout(world_size=1), 0)  # CPU init (deterministic), as bench_train.py
    (model,), engine = parallelize(model_cfg, topo, ZeroConfig(stage=0, gather_dtype=torch.bfloat16),
                                   optimizer=OptimizerSettings(lr=LR, adam_beta2=0.95,
                                                               weight_decay=0.1), device=dev)
    g = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(steps):
        data = torch.randint(0, model_cfg.vocab_size, (micro_batch, model_cfg.seq_length + 1),
                             generator=g).to(dev)
        engine.zero_grad()
        loss = model(data[:, :-1], labels=data[:, 1:]).mean()
        loss.backward()
        engine.finish_grad_sync()
        engine.clip_grad_norm(1.0)
        engine.step(LR)
        losses.append(float(loss.detach()))
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    save_checkpoint(root, steps, config=run, topo=topo, engine=engine,
                    lr_schedule=LRSchedule.from_config(run.optimizer, unit=run.training.schedule_unit),
                    consumed_samples=steps * micro_batch)
    save_s = time.perf_counter() - t0
    del engine
    return model.eval(), losses, train_s, save_s


# ------------------------------------------------------------------------ compare
def differences(theirs: torch.Tensor, ours: torch.Tensor) -> dict:
    """Relative differences of logits (ours is the reference) and top-1 agreement."""
    a, b = theirs.float(), ours.float()
    d = a - b
    return {"max_rel": (d.abs().max() / b.abs().max()).item(),
            "norm_rel": (d.norm() / b.norm()).item(),
            "top1_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def bf16_weights_are_rounded_master(model, master) -> bool:
    """The trained model's bf16 weights equal the fp32 master (the checkpoint) rounded as
    the export rounds (tensor.to(torch.bfloat16)), so both sides of 'bf16' run one model."""
    ref = dict(master.named_parameters())
    return all(torch.equal(p, ref[n].to(device=p.device, dtype=p.dtype))
               for n, p in model.named_parameters())


@torch.no_grad()
def compare_logits(trained, ckpt_dir: str, hf_dir: str, tokens: torch.Tensor, dev, vocab: int):
    """The three comparisons of the docstring, plus transformers' load times."""
    import transformers

    from megaq.checkpoint.consolidate import load_consolidated_model

    real = slice(0, vocab)  # padded ids: zero rows, not part of the model's distribution
    megaq_bf16 = trained(input_ids=tokens)[..., real].float()
    master, _ = load_consolidated_model(ckpt_dir)
    master = master.to(dev).eval()
    same_weights = bf16_weights_are_rounded_master(trained, master)
    megaq_fp32 = master(input_ids=tokens)[..., real]
    for p in master.parameters():  # as the export rounds them
        p.copy_(p.to(torch.bfloat16).float())
    megaq_fp32_rounded = master(input_ids=tokens)[..., real]
    del master

    out, load_s = {}, {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        t0 = time.perf_counter()
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(dev).eval()
        load_s[name] = time.perf_counter() - t0
        out[name] = hf(input_ids=tokens).logits[..., real].float()
        arch = type(hf).__name__
        del hf
    return {"transformers_class": arch, "load_seconds": load_s,
            "megaq_bf16_weights_equal_rounded_master": same_weights,
            "mapping_fp32": differences(out["fp32"], megaq_fp32_rounded),
            "bf16": differences(out["bf16"], megaq_bf16),
            "bf16_vs_megaq_fp32": differences(out["bf16"], megaq_fp32),
            "megaq_bf16_vs_megaq_fp32": differences(megaq_bf16, megaq_fp32)}


def check_tokenizer(hf_dir: str, tokenizer_model: str, texts: list[str]) -> dict:
    """AutoTokenizer of the export against megaq's tokenizer: ids and decoded text."""
    import transformers

    from megaq.data.tokenizer import build_tokenizer
    ours = build_tokenizer("SentencePieceTokenizer", tokenizer_model)
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    same_ids = same_text = 0
    for text in texts:
        ids = ours.tokenize(text)
        same_ids += theirs.encode(text, add_special_tokens=False) == ids
        same_text += theirs.decode(ids) == ours.detokenize(ids)
    return {"class": type(theirs).__name__, "texts": len(texts), "same_ids": same_ids,
            "same_decoded_text": same_text, "ok": same_ids == same_text == len(texts)}


# --------------------------------------------------------------------------- main
def check_model(name, model_cfg, micro_batch, a, dev, data_flags, tokens, tokenizer=None) -> dict:
    work = os.path.join(a.workdir, name)
    ck, hf_dir = os.path.join(work, "ckpt"), os.path.join(work, "hf_bf16")
    run = run_config(model_cfg, a.steps, micro_batch, data_flags)
    print(f"[check_hf] {name}: training {a.steps} steps on {dev}", flush=True)
    model, losses, train_s, save_s = train_and_save(model_cfg, run, dev, a.steps, micro_batch, ck)
    ck_bytes = bench_convert._dir_bytes(ck)
    print(f"[check_hf] {name}: losses {[round(x, 4) for x in losses]}; trained {train_s:.1f} s, "
          f"checkpoint {ck_bytes / 2**30:.2f} GiB saved in {save_s:.1f} s; exporting", flush=True)
    export = bench_convert.measure([sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"),
                                    "--to", "hf", "--input", ck, "--output", hf_dir,
                                    "--dtype", "bf16"])
    export["output_bytes"] = bench_convert._dir_bytes(hf_dir)
    print(f"[check_hf] {export['output']}", flush=True)
    params = sum(p.numel() for p in model.parameters())
    tokens = tokens.to(dev)
    from megaq.checkpoint.paths import iteration_dir
    logits = compare_logits(model, iteration_dir(ck, a.steps), hf_dir, tokens, dev,
                            model_cfg.vocab_size)
    del model
    result = {"model": name, "params": params, "config": {
                  k: getattr(model_cfg, k) for k in ("num_layers", "hidden_size",
                  "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
                  "seq_length", "position_embedding_type", "normalization", "swiglu",
                  "untie_embeddings_and_output_weights")},
              "padded_vocab": model_cfg.padded_vocab_size(1), "micro_batch": micro_batch,
              "steps": a.steps, "losses": losses, "train_seconds": train_s,
              "checkpoint_bytes": ck_bytes, "save_seconds": save_s, "export_bf16": export,
              "compared_tokens": list(tokens.shape), **logits}
    if tokenizer is not None:
        result["tokenizer"] = check_tokenizer(hf_dir, *tokenizer)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def print_table(results: list[dict]) -> None:
    print("\n| model | export bf16 s | peak anon GiB | peak RSS GiB | out GiB | mapping fp32 "
          "max rel | bf16 max rel (norm rel, top-1) | megaq bf16 vs fp32 max rel | tokenizer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        e, b, c = r["export_bf16"], r["bf16"], r["megaq_bf16_vs_megaq_fp32"]
        tok = r.get("tokenizer")
        tok = f"{tok['same_ids']}/{tok['texts']} ids equal" if tok else "-"
        print(f"| {r['model']} ({r['params'] / 1e9:.2f}B) | {e['seconds']:.1f} | "
              f"{e['peak_anon_bytes'] / 2**30:.2f} | {e['peak_rss_bytes'] / 2**30:.2f} | "
              f"{e['output_bytes'] / 2**30:.2f} | {r['mapping_fp32']['max_rel']:.2e} | "
              f"{b['max_rel']:.2e} ({b['norm_rel']:.2e}, {b['top1_agree']:.4f}) | "
              f"{c['max_rel']:.2e} | {tok} |")


def write_report(path: str, results: list[dict], dev, t_start: float) -> dict:
    import transformers
    ok = all(r["mapping_fp32"]["max_rel"] < MAPPING_TOLERANCE
             and r["megaq_bf16_weights_equal_rounded_master"]
             and r.get("tokenizer", {"ok": True})["ok"] for r in results)
    cuda = dev.type == "cuda"
    report = {"device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
              "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "mapping_tolerance": MAPPING_TOLERANCE, "ok": ok,
              "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
              "total_seconds": time.perf_counter() - t_start,
              "command": " ".join(sys.argv), "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(path + ".tmp", path)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny models (a CPU smoke run)")
    p.add_argument("--steps", type=int, default=3, help="training steps before the export")
    p.add_argument("--sequences", type=int, default=4, help="sequences compared")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per compared sequence")
    p.add_argument("--no-gpt2", action="store_true", help="only the Llama model")
    p.add_argument("--workdir", default="/tmp/megaq_check_hf_export",
                   help="scratch space (replaced; the 1.3B checkpoint with moments is ~16 GiB)")
    p.add_argument("--out-json", default=os.path.join(os.environ.get("OUT", "."),
                                                      "check_hf_export.json"))
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and exports")
    a = p.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("error: transformers is not installed; pip install the pins of pyproject.toml's "
              "hf extra", file=sys.stderr)
        return 2
    transformers.utils.logging.disable_progress_bar()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons in fp32
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(a.device)
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    t_start = time.perf_counter()

    tok_model = []  # the built-in corpus's tokenizer, built only if the GPT-2 model runs

    def tokenizer_vocab():
        from megaq.data.builtin import ensure_builtin_corpus
        from megaq.data.tokenizer import build_tokenizer
        tok_model.append(ensure_builtin_corpus(os.path.join(a.workdir, "builtin"))[1])
        return build_tokenizer("SentencePieceTokenizer", tok_model[0]).vocab_size

    models = model_configs(a.tiny, not a.no_gpt2, tokenizer_vocab)
    g = torch.Generator().manual_seed(7)
    results = []
    for name, (cfg, mb) in models.items():
        seq_len = min(a.seq_len, cfg.seq_length)
        if name.startswith("gpt2"):  # real text through megaq's tokenizer
            from megaq.data.builtin import stdlib_files
            from megaq.data.tokenizer import build_tokenizer
            tok = build_tokenizer("SentencePieceTokenizer", tok_model[0])
            texts = [text for _, text in stdlib_files(max_bytes=200_000)]
            ids = [i for text in texts for i in tok.tokenize(text)][:a.sequences * seq_len]
            tokens = torch.tensor(ids).view(a.sequences, seq_len)
            data_flags = ["--mock-data", "--tokenizer-model", tok_model[0]]
            # (a special token written literally inside a text is a documented difference:
            # docs/INTEROP.md, Tokenizer)
            probe = texts[:20] + ["  leading spaces\tand tabs\n\u00fcnic\u00f6de \u2192 \u4e2d\u6587 12345 "]
            results.append(check_model(name, cfg, mb, a, dev, data_flags, tokens,
                                       (tok_model[0], probe)))
        else:
            tokens = torch.randint(0, cfg.vocab_size, (a.sequences, seq_len), generator=g)
            results.append(check_model(name, cfg, mb, a, dev, ["--mock-data"], tokens))
        report = write_report(a.out_json, results, dev, t_start)  # after each model: a run
        # cut short by a time limit keeps what it finished

    print_table(results)
    print(f"[check_hf] {'ok' if report['ok'] else 'FAILED'}: {report['total_seconds']:.0f} s; "
          f"wrote {a.out_json}")
    if not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
