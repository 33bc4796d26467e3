"""Import Megatron-LM checkpoints (the `torch` and `torch_dist` formats, megatron-core
GPT names) into megaq. The torch_dist reading is megaq.interop.megatron_dist's.

Megatron-LM's `--ckpt-format torch` layout::

    latest_checkpointed_iteration.txt      "1000" (or "release")
    iter_0001000/                          (or release/)
      mp_rank_{tp:02d}/model_optim_rng.pt            pipeline size 1
      mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   pipeline size > 1
        {"args": argparse.Namespace, "iteration", "checkpoint_version",
         "model" (or "model0", "model1", ... with virtual pipeline stages),
         "optimizer", "opt_param_scheduler", "rng_state"}
      mp_rank_*/distrib_optim.pt                     --use-distributed-optimizer (never read)

megaq's own checkpoints share the tracker and iter_* names but hold
mp_rank_XX_YYY/model_optim.pt, so the two are told apart by the file name.

Weights: megatron-core's GPTModel names are megaq's with a `decoder.` prefix on the
blocks and `final_layernorm` for megaq's `final_norm`; the fused QKV layout (per query
group: its query heads, then K, then V) and the SwiGLU fc1 layout ([gate; up]) are the
same. Transformer-Engine layer specs fold the norms into the next linear
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`): they map back to
megaq's input_layernorm / pre_mlp_layernorm. Pipeline stages number their layers from
0 in the file: the global index adds the layers of the stages (and virtual chunks)
before it. TP shards are concatenated along Megatron's partition dimension (rows for
column-parallel weights and the vocabulary, columns for row-parallel ones; fc1 with
SwiGLU holds [gate_r; up_r] per rank).

Optimizer state: from torch_dist, the distributed optimizer's `dp_reshardable` buckets
are cut into parameters, or its `fully_reshardable` model-space tensors read as they are
(megatron_dist.optimizer_state), and imported with the step, the LR schedule, the
iteration and the consumed samples. The torch format's is not: it keeps
AdamW moments by param-group position (or in distrib_optim.pt buckets without the
sizes that place them), so asking for it is refused.

Public API:
    is_megatron_checkpoint(path) -> str | None         one-line description, or None
    load_megatron_checkpoint(path) -> (config, weights) megaq flags/values + full tensors
    write_megaq_checkpoint(config, weights, out_dir)    megaq checkpoint at a layout (with the
                                                        run's state when config has "training")
    convert_to_megaq(a) -> str                          tools/convert_checkpoint.py --from megatron
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from typing import Iterator

import torch

from megaq.checkpoint import safe_unpickle
from megaq.checkpoint.integrity import MANIFEST_NAME
from megaq.checkpoint.reshard import concat_tp_shards, fit_rows
from megaq.interop import megatron_dist
from megaq.interop.common import InteropError, progress, target_layout
from megaq.interop.megatron_dist import MegatronImportError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"        # Megatron-LM's; megaq writes model_optim.pt
_MP_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
CONVERT_HINT = ("python tools/convert_checkpoint.py --from megatron --to megaq "
                "--input {src} --output MEGAQ_DIR")


# ------------------------------------------------------------------------ discovery
def _iteration_dir(path: str) -> tuple[str, str] | None:
    """(iter dir, iteration text) for a checkpoint root or an iter_*/release dir."""
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):
        with open(tracker, "rb") as f:  # not trusted to be text
            it = f.read().decode("utf-8", "replace").strip()
        name = "release" if it == "release" else (f"iter_{int(it):07d}" if it.isdigit() else None)
        return (os.path.join(path, name), it) if name else None
    base = os.path.basename(os.path.normpath(path))
    if base == "release" or re.fullmatch(r"iter_\d{7}", base):
        return path, ("release" if base == "release" else str(int(base[5:])))
    return None


def _mp_dirs(iter_dir: str) -> dict[tuple[int, int], str]:
    """{(tp, pp): dir} of the mp_rank_* directories that hold Megatron's model file."""
    out = {}
    if not os.path.isdir(iter_dir):
        return out
    for name in os.listdir(iter_dir):
        m = _MP_DIR.match(name)
        if m and os.path.isfile(os.path.join(iter_dir, name, MODEL_FILE)):
            out[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(iter_dir, name)
    return out


def _is_torch_dist(iter_dir: str) -> bool:
    """Megatron's torch_dist directory: its metadata.json (dist_checkpointing's), or DCP
    files with neither megaq's manifest nor megaq's common file (megaq's --ckpt-format
    torch_dist writes DCP files too; a save killed before its manifest is still megaq's)."""
    if not os.path.isdir(iter_dir):
        return False
    names = os.listdir(iter_dir)
    return "metadata.json" in names or (any(n.endswith(".distcp") for n in names)
                                        and MANIFEST_NAME not in names
                                        and "common.pt" not in names)


def is_megatron_checkpoint(path: str) -> str | None:
    """One line saying which Megatron-LM checkpoint `path` is, or None when it is not one
    (a megaq checkpoint, an empty directory, anything else)."""
    if not path or not os.path.isdir(path):
        return None
    found = _iteration_dir(path)
    if found is None:
        return None
    iter_dir, it = found
    if _is_torch_dist(iter_dir):
        return f"Megatron-LM checkpoint in the torch_dist (distributed) format, iteration {it}"
    mp = _mp_dirs(iter_dir)
    if not mp:
        return None
    tp = max(t for t, _ in mp) + 1
    pp = max(p for _, p in mp) + 1
    return f"Megatron-LM checkpoint (torch format), iteration {it}, TP {tp} x PP {pp}"


def load_refusal(path: str) -> str | None:
    """For `--load PATH`: the one-line reason PATH cannot be resumed by megaq and the
    command that converts it, or None when PATH is not a Megatron-LM checkpoint."""
    what = is_megatron_checkpoint(path)
    if what is None:
        return None
    return (f"{path} is a {what}, not a megaq checkpoint; convert it with "
            f"`{CONVERT_HINT.format(src=path)}` and start from it with --finetune "
            f"--pretrained-checkpoint MEGAQ_DIR (or --load MEGAQ_DIR --no-load-rng)")


# ------------------------------------------------------------------------ reading
def _read(path: str) -> dict:
    """One model_optim_rng.pt, through megaq.checkpoint.safe_unpickle: Megatron pickles its flags as
    an argparse.Namespace (holding dtypes and some of Megatron's enums) and numpy RNG
    state beside the tensors; anything else is refused unread, naming the class."""
    sd = megatron_dist.unpickle(path, safe_unpickle.MEGATRON)
    if not isinstance(sd, dict):
        raise MegatronImportError(f"{path} holds a {type(sd).__name__}, not the dict Megatron-LM "
                                  "saves; it is not a Megatron-LM checkpoint file")
    return sd


def _model_chunks(sd: dict, path: str) -> list[dict]:
    if "model" in sd:
        chunks = [sd["model"]]
    else:
        names = sorted((k for k in sd if isinstance(k, str) and re.fullmatch(r"model\d+", k)),
                       key=lambda k: int(k[5:]))
        if not names:
            raise MegatronImportError(f"{path} has no 'model' state dict; it is not a Megatron-LM "
                                      "model checkpoint")
        chunks = [sd[k] for k in names]
    for chunk in chunks:
        if not isinstance(chunk, dict) or not all(isinstance(k, str) for k in chunk):
            raise MegatronImportError(f"{path}: its model state is a {type(chunk).__name__}, not "
                                      "a dict of named tensors; it is not a Megatron-LM checkpoint")
    return chunks


# The type each of Megatron's saved flags that the import reads must have (a flag not
# named here is a switch: a bool); None (unset) is always allowed.
_ARG_TYPES = {**{n: int for n in ("num_layers", "hidden_size", "num_attention_heads",
                                  "ffn_hidden_size", "num_query_groups", "kv_channels",
                                  "seq_length", "max_position_embeddings", "num_experts",
                                  "make_vocab_size_divisible_by", "padded_vocab_size",
                                  "vocab_size")},
              **{n: float for n in ("rotary_percent", "rotary_base", "norm_epsilon",
                                    "layernorm_epsilon", "hidden_dropout", "attention_dropout",
                                    "rope_scaling_factor")},
              "position_embedding_type": str, "normalization": str}


def _arg(a, name, default=None, path=""):
    """Megatron's saved flag `name`, checked to be of the type Megatron saves it as (a
    number given as text, say, is refused in one line rather than failing later)."""
    value = getattr(a, name, default) if a is not None else default
    want = _ARG_TYPES.get(name, bool)
    ok = (value is None or (want is str and isinstance(value, str))
          or (want is bool and isinstance(value, (bool, int)))
          or (want is int and type(value) is int)
          or (want is float and isinstance(value, (int, float)) and not isinstance(value, bool)))
    if not ok:
        raise MegatronImportError(f"{path}: the saved flag {name} is {value!r} (a "
                                  f"{type(value).__name__}), not a {want.__name__}; the file is damaged or not a Megatron-LM "
                                  "checkpoint")
    return value


def architecture_from_args(a, path: str) -> dict:
    """megaq's architecture values from Megatron's saved args; refuses what megaq lacks."""
    if a is None:
        raise MegatronImportError(f"{path} holds no 'args'; the architecture (heads, norm, "
                                  "activation) cannot be inferred from the weights alone")
    if not isinstance(a, argparse.Namespace):
        raise MegatronImportError(f"{path} holds 'args' as a {type(a).__name__}, not the "
                                  "argparse.Namespace Megatron-LM saves; it is not a Megatron-LM "
                                  "checkpoint (or another tool rewrote it)")
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if (_arg(a, name, path=path) or 0) < 1:
            raise MegatronImportError(f"{path} holds no positive args.{name}; the architecture "
                                      "cannot be read from it (the file is damaged or incomplete)")
    arg = lambda name, default=None: _arg(a, name, default, path)  # noqa: E731

    def refuse(what):
        raise MegatronImportError(f"{path}: the model uses {what}, which megaq does not "
                                  "implement; it cannot be imported")
    if (arg("num_experts") or 0) > 1:
        refuse(f"a mixture of experts (--num-experts {a.num_experts})")
    if arg("squared_relu"):
        refuse("squared ReLU (--squared-relu)")
    if (arg("rotary_percent", 1.0) or 1.0) != 1.0:
        refuse(f"partial rotary embeddings (--rotary-percent {a.rotary_percent})")
    if arg("multi_latent_attention"):
        refuse("multi-latent attention")
    pos = arg("position_embedding_type") or (
        "rope" if arg("use_rotary_position_embeddings") else "learned_absolute")
    if pos not in ("rope", "learned_absolute"):
        refuse(f"--position-embedding-type {pos}")
    if arg("add_qkv_bias") and not arg("add_bias_linear", True):
        refuse("a QKV bias without the other linear biases (--add-qkv-bias)")
    heads = a.num_attention_heads
    groups = arg("num_query_groups") if arg("group_query_attention") else None
    padded = arg("padded_vocab_size")
    return {
        "num_layers": a.num_layers, "hidden_size": a.hidden_size,
        "ffn_hidden_size": arg("ffn_hidden_size") or 4 * a.hidden_size,
        "num_attention_heads": heads, "num_query_groups": groups or heads,
        "kv_channels": arg("kv_channels") or a.hidden_size // heads,
        "seq_length": arg("seq_length"),
        "max_position_embeddings": arg("max_position_embeddings") or arg("seq_length"),
        "position_embedding_type": pos,
        "rotary_base": arg("rotary_base", 10000) or 10000,
        "use_rope_scaling": bool(arg("use_rope_scaling")),
        "rope_scaling_factor": arg("rope_scaling_factor", 8.0) or 8.0,
        "qk_layernorm": bool(arg("qk_layernorm")),
        "normalization": arg("normalization", "LayerNorm") or "LayerNorm",
        "norm_epsilon": arg("norm_epsilon", arg("layernorm_epsilon", 1e-5)) or 1e-5,
        "swiglu": bool(arg("swiglu")),
        "add_bias_linear": bool(arg("add_bias_linear", True)),
        "untie_embeddings_and_output_weights": bool(arg("untie_embeddings_and_output_weights")),
        "make_vocab_size_divisible_by": arg("make_vocab_size_divisible_by", 128) or 128,
        "padded_vocab_size": padded,
        "vocab_size": arg("vocab_size"),  # None when Megatron took it from the tokenizer
        # the run's dropout, so that a continued run trains as it did (None: megaq's default)
        "hidden_dropout": arg("hidden_dropout"), "attention_dropout": arg("attention_dropout"),
    }


def architecture_flags(arch: dict) -> list[str]:
    """pretrain_gpt.py flags that build this architecture in megaq."""
    f = ["--num-layers", arch["num_layers"], "--hidden-size", arch["hidden_size"],
         "--ffn-hidden-size", arch["ffn_hidden_size"],
         "--num-attention-heads", arch["num_attention_heads"],
         "--kv-channels", arch["kv_channels"],
         "--max-position-embeddings", arch["max_position_embeddings"],
         "--position-embedding-type", arch["position_embedding_type"],
         "--normalization", arch["normalization"], "--norm-epsilon", arch["norm_epsilon"],
         "--make-vocab-size-divisible-by", arch["make_vocab_size_divisible_by"]]
    if arch["seq_length"]:
        f += ["--seq-length", arch["seq_length"]]
    if arch["num_query_groups"] != arch["num_attention_heads"]:
        f += ["--group-query-attention", "--num-query-groups", arch["num_query_groups"]]
    if arch["position_embedding_type"] == "rope":
        f += ["--rotary-base", arch["rotary_base"]]
        if arch.get("use_rope_scaling"):
            f += ["--use-rope-scaling", "--rope-scaling-factor", arch["rope_scaling_factor"]]
    if arch.get("qk_layernorm"):
        f.append("--qk-layernorm")
    for name in ("hidden_dropout", "attention_dropout"):
        if arch.get(name) is not None:
            f += [f"--{name.replace('_', '-')}", arch[name]]
    if arch["swiglu"]:
        f.append("--swiglu")
    if not arch["add_bias_linear"]:
        f.append("--disable-bias-linear")
    if arch["untie_embeddings_and_output_weights"]:
        f.append("--untie-embeddings-and-output-weights")
    return [str(x) for x in f]


# megatron-core module inside a block -> (megaq module, TP dim of its weight); dim -1:
# replicated over TP. The stride of fc1 becomes 2 with SwiGLU ([gate_r; up_r] per rank).
# A bias is split with its weight's output rows (dim 0, column-parallel) and replicated
# otherwise (a row-parallel layer adds it after the all-reduce; norms are replicated).
# Transformer Engine fuses a norm into the next linear: "<linear>.layer_norm_weight".
_BLOCK_MODULES = (
    ("input_layernorm.", "input_layernorm", -1),
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm", -1),
    ("self_attention.linear_qkv.", "self_attention.linear_qkv", 0),
    ("self_attention.linear_proj.", "self_attention.linear_proj", 1),
    ("self_attention.q_layernorm.", "self_attention.q_layernorm", -1),
    ("self_attention.k_layernorm.", "self_attention.k_layernorm", -1),
    ("pre_mlp_layernorm.", "pre_mlp_layernorm", -1),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm", -1),
    ("mlp.linear_fc1.", "mlp.linear_fc1", 0),
    ("mlp.linear_fc2.", "mlp.linear_fc2", 1),
)
# megatron-core name inside a block -> (megaq name inside a block, TP dim)
_BLOCK = {mcore + kind: (f"{megaq}.{kind}", dim if kind == "weight" or dim == 0 else -1)
          for mcore, megaq, dim in _BLOCK_MODULES for kind in ("weight", "bias")}
_TOP = {
    "embedding.word_embeddings.weight": ("embedding.word_embeddings.weight", 0),
    "embedding.position_embeddings.weight": ("embedding.position_embeddings.weight", -1),
    "decoder.final_layernorm.weight": ("final_norm.weight", -1),
    "decoder.final_layernorm.bias": ("final_norm.bias", -1),
    "output_layer.weight": ("output_layer.weight", 0),
}
_IGNORED = re.compile(r"(\._extra_state$|rotary_pos_emb\.inv_freq$)")


def _megaq_name(name: str, layer_offset: int, path: str) -> tuple[str, int] | None:
    """(megaq global name, TP dim) of one megatron-core name; None for non-weights."""
    if _IGNORED.search(name):
        return None
    m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
    if m and m.group(2) in _BLOCK:
        local, dim = _BLOCK[m.group(2)]
        return f"layers.{layer_offset + int(m.group(1))}.{local}", dim
    if name in _TOP:
        return _TOP[name]
    if name.startswith("language_model."):
        raise MegatronImportError(f"{path} uses Megatron-LM's legacy (pre-mcore) model names "
                                  f"({name}); re-save it from a --use-mcore-models run (or convert "
                                  "it with Megatron-LM's tools/checkpoint) first")
    raise MegatronImportError(f"{path}: tensor {name} has no megaq counterpart; the model has "
                              "parts megaq lacks")


def _layers_in(chunk: dict) -> int:
    idx = {int(m.group(1)) for k in chunk if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
    return max(idx) + 1 if idx else 0


def load_megatron_checkpoint(path: str, *, optimizer: bool = False) -> tuple[dict, Iterator]:
    """Read a Megatron-LM torch-format checkpoint of any TP x PP (x virtual PP).

    Returns (config, weights): config holds the architecture (architecture_from_args's
    keys), "flags" (pretrain_gpt.py flags for it), "iteration", "source" (path),
    "megatron_layout" ({"tp", "pp", "vp"}) and "has_optimizer"; weights yields
    (megaq global name, full fp32/bf16 tensor) pairs, in megaq's layout. `optimizer=True`
    (import the AdamW state too) is refused: Megatron's optimizer state has no by-name
    mapping onto megaq's."""
    found = _iteration_dir(path) if os.path.isdir(path) else None
    if found is None:
        raise MegatronImportError(f"{path} is not a Megatron-LM checkpoint directory (no {TRACKER_FILE}"
                                  " and not an iter_XXXXXXX directory); pass the --save directory "
                                  "of the Megatron-LM run")
    iter_dir, it = found
    if _is_torch_dist(iter_dir):
        return _load_torch_dist(path, iter_dir, it, optimizer)
    mp = _mp_dirs(iter_dir)
    if not mp:
        raise MegatronImportError(f"{iter_dir} holds no mp_rank_*/{MODEL_FILE}; the checkpoint is "
                                  "incomplete (or it is a megaq checkpoint: --load it directly)")
    tp = max(t for t, _ in mp) + 1
    pp = max(p for _, p in mp) + 1
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in mp]
    if missing:
        t, p = missing[0]
        raise MegatronImportError(f"{iter_dir}: the shard of TP rank {t}, PP rank {p} is missing "
                                  f"({len(missing)} of {tp * pp}); the checkpoint is incomplete")
    files = {(t, p): os.path.join(d, MODEL_FILE) for (t, p), d in mp.items()}
    first = _read(files[(0, 0)])
    a = first.get("args")
    arch = architecture_from_args(a, files[(0, 0)])
    opt = first.get("optimizer")
    has_optim = (opt is not None and not (isinstance(opt, (dict, list)) and not opt)) or any(
        os.path.isfile(os.path.join(d, "distrib_optim.pt")) for d in mp.values())
    if optimizer and has_optim:
        raise MegatronImportError(
            f"{path}: Megatron-LM's optimizer state (Adam moments kept by parameter bucket or "
            "param-group position, not by name) cannot be mapped onto megaq's optimizer; import "
            "the weights only and fine-tune with --finetune (fresh AdamW moments)")
    vp = len(_model_chunks(first, files[(0, 0)]))
    config = dict(arch, flags=architecture_flags(arch), iteration=it, source=os.path.abspath(path),
                  megatron_layout={"tp": tp, "pp": pp, "vp": vp}, has_optimizer=has_optim)
    config["vocab_rows"] = None  # filled in by weights() with the embedding's row count

    def weights():
        # Stage files of one TP rank share nothing: read one pipeline stage (all TP ranks)
        # at a time, so memory holds one stage's shards plus the finished full tensors.
        sharded: dict[str, tuple[int, list]] = {}
        offsets, total = {}, 0
        by_stage = {p: [None] * tp for p in range(pp)}
        for t, p in progress([(t, p) for p in range(pp) for t in range(tp)],
                             "reading Megatron-LM shards", unit="file"):
            chunks = (_model_chunks(first, files[(0, 0)]) if (t, p) == (0, 0)
                      else _model_chunks(_read(files[(t, p)]), files[(t, p)]))
            if len(chunks) != vp:
                raise MegatronImportError(f"{files[(t, p)]} holds {len(chunks)} model chunks, "
                                          f"{files[(0, 0)]} {vp}; the checkpoint is inconsistent")
            by_stage[p][t] = chunks
        for v in range(vp):  # Megatron's layer order: chunk-major, then stage
            for p in range(pp):
                offsets[(p, v)] = total
                total += _layers_in(by_stage[p][0][v])
        if total != arch["num_layers"]:
            raise MegatronImportError(f"{path}: the stage files hold {total} layers, args say "
                                      f"--num-layers {arch['num_layers']}; the checkpoint is "
                                      "inconsistent")
        tied = not arch["untie_embeddings_and_output_weights"]
        for p in range(pp):
            for v in range(vp):
                for name in by_stage[p][0][v]:
                    mapped = _megaq_name(name, offsets[(p, v)], files[(0, p)])
                    if mapped is None:
                        continue
                    gname, dim = mapped
                    if tied and gname == "output_layer.weight":
                        continue  # the last stage's copy of the tied embedding
                    parts = [_tensor(by_stage[p][t], v, name, files[(t, p)]) for t in range(tp)]
                    for t, part in enumerate(parts):
                        if part.shape != parts[0].shape:
                            raise MegatronImportError(
                                f"{files[(t, p)]}: {name} has shape {tuple(part.shape)}, TP rank "
                                f"0's {tuple(parts[0].shape)}; the checkpoint is inconsistent")
                    sharded[gname] = (dim, parts)
            del by_stage[p]
            for gname in list(sharded):
                dim, parts = sharded.pop(gname)
                stride = 2 if arch["swiglu"] and gname.endswith(("linear_fc1.weight",
                                                                 "linear_fc1.bias")) else 1
                full = parts[0] if dim < 0 or tp == 1 else concat_tp_shards(parts, dim, stride)
                if gname == "embedding.word_embeddings.weight":
                    config["vocab_rows"] = full.shape[0]
                yield gname, full
    return config, weights()


def _tensor(chunks: list[dict], v: int, name: str, path: str) -> torch.Tensor:
    """Tensor `name` of model chunk `v` of one stage file (TP rank 0's file named it)."""
    t = chunks[v].get(name) if v < len(chunks) else None
    if not isinstance(t, torch.Tensor):
        what = "has no" if t is None else f"holds a {type(t).__name__} as"
        raise MegatronImportError(f"{path} {what} tensor {name} (TP rank 0's shard has it); the "
                                  "checkpoint is incomplete or inconsistent")
    return t


def _load_torch_dist(path: str, iter_dir: str, it: str, optimizer: bool):
    """load_megatron_checkpoint for the torch_dist format (megaq.interop.megatron_dist):
    the same (config, weights), plus config["training"] when `optimizer` is asked and
    the checkpoint holds the distributed optimizer's state: megatron_dist.optimizer_state's
    dict with "iteration", "consumed_samples", "scheduler" and "optimizer_flags"."""
    from megaq.parallel.tensor_parallel import shard_of
    ck = megatron_dist.DistCheckpoint(iter_dir)
    common_path = os.path.join(iter_dir, megatron_dist.COMMON)
    a = ck.common.get("args")
    arch = architecture_from_args(a, common_path)
    tp = _arg(a, "tensor_model_parallel_size", 1, common_path) or 1
    pp = _arg(a, "pipeline_model_parallel_size", 1, common_path) or 1
    if not (isinstance(tp, int) and isinstance(pp, int) and tp >= 1 and pp >= 1):
        raise MegatronImportError(f"{common_path}: args hold TP {tp!r} x PP {pp!r}; the file is "
                                  "damaged")

    def name_of(name):
        return _megaq_name(name, 0, common_path)
    weights = megatron_dist.model_tensors(ck, arch, name_of)
    if not arch["untie_embeddings_and_output_weights"]:
        weights.pop("output_layer.weight", None)
    emb = weights.get("embedding.word_embeddings.weight")
    if emb is None:
        raise MegatronImportError(f"{iter_dir} holds no embedding.word_embeddings.weight; the "
                                  "checkpoint is incomplete")
    optim = ck.common.get("optimizer")
    has_optim = isinstance(optim, dict) and "param_state_sharding_type" in optim
    config = dict(arch, flags=architecture_flags(arch), iteration=it, source=os.path.abspath(path),
                  megatron_layout={"tp": tp, "pp": pp, "vp": 1}, has_optimizer=has_optim,
                  vocab_rows=emb.shape[0], format="torch_dist")
    if optimizer and has_optim:
        stride = lambda g: 2 if arch["swiglu"] and ".linear_fc1." in g else 1  # noqa: E731
        dims = {}
        for mname in megatron_dist.mcore_order(arch, te=False):
            gname, dim = name_of(mname)
            dims[gname] = dim

        def tp_split(gname, full, rank):
            d = dims[gname]
            return full if d < 0 or tp == 1 else shard_of(full, d, rank, tp, stride(gname))
        state = megatron_dist.optimizer_state(ck, arch, tp, pp, weights, name_of, tp_split)
        full = {}
        for gname, parts in state.pop("shards").items():
            d = dims[gname]
            full[gname] = {k: parts[0][k] if d < 0 or len(parts) == 1 else
                           concat_tp_shards([p[k] for p in parts], d, stride(gname), name=gname)
                           for k in parts[0]}
        missing = sorted(set(weights) - set(full))
        if missing:
            raise MegatronImportError(f"{iter_dir}: the optimizer holds no state for {missing[0]} "
                                      f"({len(missing)} parameters); the checkpoint is inconsistent")
        state["params"] = full
        state.update(_run_position(ck.common, a, common_path))
        config["training"] = state
    return config, iter(weights.items())


def _run_position(common: dict, a, path: str) -> dict:
    """Iteration, consumed samples, and the LR schedule (megaq's LRSchedule state) and
    optimizer flags of a Megatron-LM run, from its common.pt."""
    def number(value, what, kind=int):
        if not isinstance(value, kind) or isinstance(value, bool) or value < 0:
            raise MegatronImportError(f"{path}: {what} is {value!r}, not a non-negative "
                                      f"{kind.__name__}; the file is damaged")
        return value
    iteration = number(common.get("iteration"), "the iteration")
    gbs = number(getattr(a, "global_batch_size", None), "args.global_batch_size")
    consumed = number(getattr(a, "consumed_train_samples", iteration * gbs),
                      "args.consumed_train_samples")
    s = common.get("opt_param_scheduler")
    if not isinstance(s, dict):
        raise MegatronImportError(f"{path} holds no opt_param_scheduler; the checkpoint is "
                                  "incomplete (or import it with --no-optimizer)")
    style = s.get("lr_decay_style")
    if style not in ("constant", "linear", "cosine"):
        raise MegatronImportError(f"{path}: the run's LR decay style is {style!r}; megaq "
                                  "implements constant, linear and cosine (import with "
                                  "--no-optimizer and choose a schedule)")
    pos = number(s.get("num_steps"), "opt_param_scheduler.num_steps")
    warm = number(s.get("lr_warmup_steps"), "opt_param_scheduler.lr_warmup_steps")
    decay = number(s.get("lr_decay_steps"), "opt_param_scheduler.lr_decay_steps")
    max_lr = number(s.get("max_lr"), "opt_param_scheduler.max_lr", float)
    min_lr = number(s.get("min_lr"), "opt_param_scheduler.min_lr", float)
    # Megatron counts the schedule in samples; iterations when every count is whole steps
    iters = all(v % gbs == 0 for v in (pos, warm, decay))
    unit = "iterations" if iters else "samples"
    per = gbs if iters else 1
    sched = {"max_lr": max_lr, "min_lr": min_lr, "warmup_steps": warm // per,
             "decay_steps": decay // per, "decay_style": style, "num_steps": pos // gbs,
             "unit": unit, "samples_per_step": gbs, "num_samples": pos}
    span = "iters" if iters else "samples"
    flags = ["--lr", repr(max_lr), "--min-lr", repr(min_lr), "--lr-decay-style", style,
             f"--lr-warmup-{span}", str(warm // per), f"--lr-decay-{span}", str(decay // per),
             "--global-batch-size", str(gbs)]
    for flag, name in (("--weight-decay", "weight_decay"), ("--adam-beta1", "adam_beta1"),
                       ("--adam-beta2", "adam_beta2"), ("--adam-eps", "adam_eps"),
                       ("--clip-grad", "clip_grad")):
        value = getattr(a, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            flags += [flag, repr(float(value))]
    return {"iteration": iteration, "consumed_samples": consumed, "scheduler": sched,
            "optimizer_flags": flags}


# ------------------------------------------------------------------------ writing
def write_megaq_checkpoint(config: dict, weights, out_dir: str, *, overwrite: bool = False,
                           vocab_size: int | None = None, tp: int = 1, pp: int = 1,
                           vp: int = 1) -> dict:
    """A megaq checkpoint at iteration 0 (TP 1, PP 1: megaq reshards on load to any
    TP x PP x DP) with fresh AdamW moments, plus megaq_args.txt / .json: the architecture
    flags. Written by the shared interop writer (megaq.interop.common), so it is the
    same form as a training save and as the Hugging Face import. The vocabulary rows are
    megaq's padding of `vocab_size` (default: the checkpoint's true vocab when its args
    name one, else every embedding row); config["provenance"], when given, is what the
    files record of the source (default: the Megatron-LM run's). Returns {"dir", "flags",
    "load_flags", "tensors"}."""
    from megaq.interop.common import (ImportedTraining, check_output, megaq_layout,
                                      megaq_layout_flags, megaq_run_config, replace_dir,
                                      temp_dir_for, write_megaq_args,
                                      write_megaq_checkpoint as write_checkpoint)

    if os.path.exists(out_dir) and not overwrite:
        raise MegatronImportError(f"{out_dir} exists; choose a new --output or pass --overwrite")
    check_output(out_dir, overwrite, config["source"], writes="megaq")  # not in / around the input
    params = dict(weights)  # reads every shard; the embedding fixes vocab_rows
    rows = config["vocab_rows"]
    vocab = vocab_size or config.get("vocab_size") or rows
    if vocab > rows:
        raise MegatronImportError(f"vocab size {vocab} exceeds the checkpoint's {rows} embedding "
                                  "rows; pass the tokenizer's vocab size")
    divisor = _vocab_divisor(config["make_vocab_size_divisible_by"], vocab, rows, tp)
    flags = (_with_flag(config["flags"], "--make-vocab-size-divisible-by", str(divisor))
             + ["--vocab-size", str(vocab)] + megaq_layout_flags(tp, pp, vp, config["num_layers"]))
    state = config.get("training")
    if state:  # the run's optimizer settings, recorded with the configuration
        flags = flags + state["optimizer_flags"]
    try:
        run = megaq_run_config(flags, tp, pp)
    except InteropError as e:
        raise MegatronImportError(f"the imported model does not fit megaq at TP {tp} x PP {pp}"
                                  f"{f' x VP {vp}' if vp > 1 else ''}: {e}") from None

    layout = megaq_layout(run.model, tp, pp, vp)
    # the weights and the saved args must describe the same model (q/k layer norms, say)
    # a tied head's copy (on megaq's last pipeline stage at PP > 1, or on Megatron's) is
    # the embedding: it is read from the embedding, and a saved copy is not needed
    tied_copy = {"output_layer.weight"} if run.model.tie_embeddings else set()
    wanted = {info.name for info in layout} - tied_copy
    extra = set(params) - wanted - tied_copy
    for what, names in (("has no place in the model its saved args describe", extra),
                        ("is missing, though its saved args imply it", wanted - set(params))):
        if names:
            first = sorted(names)[0]
            raise MegatronImportError(f"{config['source']}: tensor {first}"
                                      f"{f' (and {len(names) - 1} more)' if len(names) > 1 else ''} "
                                      f"{what}; the checkpoint's weights and args disagree")

    def padded(name: str, t: torch.Tensor) -> torch.Tensor:
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = fit_rows(t, 0, run.padded_vocab_size, name)
        return t

    def source(info) -> str:
        return "embedding.word_embeddings.weight" if info.name in tied_copy else info.name

    def full_tensor(info) -> torch.Tensor:
        return padded(info.name, params[source(info)])

    training = None
    if state:
        def moments(info):
            sd = state["params"][source(info)]
            return padded(info.name, sd["exp_avg"]), padded(info.name, sd["exp_avg_sq"])
        training = ImportedTraining(state["iteration"], state["consumed_samples"], state["step"],
                                    state["scheduler"], moments)
    tmp = temp_dir_for(out_dir)
    try:
        write_checkpoint(tmp, run, layout, full_tensor,
                         extra=config.get("provenance") or {
                             "imported_from": config["source"],
                             "megatron_iteration": config["iteration"],
                             "megatron_layout": config["megatron_layout"]},
                         training=training)
        write_megaq_args(tmp, out_dir, flags, {"source": config["source"]})
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"dir": out_dir, "flags": flags, "tensors": len(params),
            "load_flags": ["--load", out_dir, "--no-load-rng"]}


def _vocab_divisor(megatron_divisor: int, vocab: int, rows: int, tp: int) -> int:
    """--make-vocab-size-divisible-by that keeps the checkpoint's `rows` output rows at
    TP `tp`: padding rows take part in the softmax (their logits are not masked), so
    adding zero rows would change the model's loss. Megatron's own divisor when it
    still gives `rows`, else rows / tp; a TP not dividing `rows` is refused."""
    from megaq.parallel.tensor_parallel import pad_vocab_size
    for m in (megatron_divisor, megatron_divisor // tp, rows // tp):
        if m >= 1 and pad_vocab_size(vocab, m, tp) == rows:
            return m
    raise MegatronImportError(f"the checkpoint's {rows} vocabulary rows cannot be split over TP "
                              f"{tp} without adding rows, which would change the model's output; "
                              f"choose a --tensor-model-parallel-size dividing {rows}")


def _with_flag(flags: list[str], flag: str, value: str) -> list[str]:
    out = list(flags)
    out[out.index(flag) + 1] = value
    return out


def convert_to_megaq(a) -> str:
    """tools/convert_checkpoint.py --from megatron --to megaq: `a.input` (a Megatron-LM
    --save directory) -> `a.output` (megaq checkpoint); returns the report lines."""
    tp, pp, vp = target_layout(a, MegatronImportError)
    if getattr(a, "seq_length", None) is not None or \
            (getattr(a, "make_vocab_size_divisible_by", 1) or 1) != 1:
        raise MegatronImportError("--seq-length and --make-vocab-size-divisible-by are read from "
                                  "the Megatron-LM checkpoint's args; drop them for --from megatron")
    found = _iteration_dir(a.input) if os.path.isdir(a.input) else None
    # the optimizer state imports from torch_dist (the torch format's has no by-name mapping)
    optimizer = bool(found and _is_torch_dist(found[0]) and not getattr(a, "no_optimizer", False))
    config, weights = load_megatron_checkpoint(a.input, optimizer=optimizer)
    out = write_megaq_checkpoint(config, weights, a.output, overwrite=getattr(a, "overwrite", False),
                                 tp=tp, pp=pp, vp=vp)
    lay = config["megatron_layout"]
    state = config.get("training")
    if state:
        note = (f"; optimizer state imported: AdamW moments, step {state['step']}, LR schedule, "
                f"iteration {state['iteration']}, {state['consumed_samples']} consumed samples")
    elif config["has_optimizer"]:
        note = "; Megatron's optimizer state was not imported (fresh AdamW moments)"
    else:
        note = ""
    return (f"[convert] {a.input} (Megatron-LM {config.get('format', 'torch')} iteration "
            f"{config['iteration']}, TP {lay['tp']} x PP {lay['pp']}) -> {out['dir']} at TP {tp} x "
            f"PP {pp}{f' x VP {vp}' if vp > 1 else ''}: {out['tensors']} tensors{note}\n"
            f"[convert] train from it with: python pretrain_gpt.py {' '.join(out['flags'])} "
            f"{' '.join(out['load_flags'])} <data and training flags>")
