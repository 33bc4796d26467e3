"""Import DeepSpeed checkpoints, with their optimizer state, into megaq (without DeepSpeed
installed).

DeepSpeed's universal checkpoint (``deepspeed/checkpoint/ds_to_universal.py`` run on a
saved tag) is the layout this reads by name::

    <tag>_universal/
      zero/<parameter name>/fp32.pt         the fp32 master weight (full tensor; ZeRO-1/2's
      zero/<parameter name>/exp_avg.pt      universal files hold {"param": tensor, ...})
      zero/<parameter name>/exp_avg_sq.pt   Adam's moments
      zero/<parameter name>/step.pt         ZeRO-1/2 only: the step
      zero/optimizer_state.pt               the optimizer's param groups (lr, betas, eps,
                                            weight decay) and, from ZeRO-3, its step
      *model_states.pt                      param_shapes (every parameter's name and shape),
                                            global_steps, global_samples, ds_config, ...

A ZeRO-3 tag as `engine.save_checkpoint` writes it (``global_stepN/``) is read too: each
data-parallel rank's ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` holds one flat fp32
partition (and one exp_avg, exp_avg_sq) per parameter group, in which every parameter of
the group takes ceil(numel / DP) elements on every rank, in param_shapes' order (how
ds_to_universal.py cuts them). A ZeRO-1/2 tag is refused with the command that makes its
universal form. The checkpoint root (with DeepSpeed's ``latest_universal`` or ``latest``
file) is accepted for either.

DeepSpeed does not record the architecture. Parameter names are either megaq's own (a
run whose model was megaq.model.GPTModel): the architecture is read off the shapes
(layers, widths, biases, norm type, SwiGLU, tied head, positions), with
--num-attention-heads given (the heads cannot be told from a fused QKV shape) and any
other architecture flag passed through; or a transformers model's (LlamaForCausalLM,
Qwen3ForCausalLM, GPT2LMHeadModel), with its config.json given (--hf-config): the
architecture and the name and layout mapping are the Hugging Face import's
(megaq.interop.hf), applied alike to the weights and to both moments (the mapping only
moves elements: splits, concatenations, transposes).
The optimizer state is imported with the step, the iteration and the consumed samples;
DeepSpeed's LR scheduler is not (its position is, and the run's flags give the schedule).

Every file is read through megaq.checkpoint.safe_unpickle (safe_unpickle.DEEPSPEED), and
must be a regular file inside the given directory: no symlink is followed, and a
parameter name from a file never becomes a path outside zero/.
"""

from __future__ import annotations

import math
import os
import re
import stat

import torch

from megaq.checkpoint import safe_unpickle
from megaq.interop.common import InteropError, read_foreign, target_layout

UNIVERSAL_LATEST, LATEST = "latest_universal", "latest"
ZERO_DIR, OPTIMIZER_STATE = "zero", "optimizer_state.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")
_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL_FILE = re.compile(r"(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
UNIVERSAL_HINT = ("python -m deepspeed.checkpoint.ds_to_universal --input_folder {tag} "
                  "--output_folder {tag}_universal")


class DeepSpeedImportError(InteropError):
    """A DeepSpeed checkpoint that cannot be imported as asked; one line naming why and
    the fix (tools/convert_checkpoint.py prints it as its `error:` line)."""


# ------------------------------------------------------------------ files and paths
def _entry(directory: str, name: str, want_dir: bool = False) -> str:
    """`directory/name`, which must be a regular file (a directory with want_dir) there:
    a symlink is refused, so nothing is read from outside the checkpoint."""
    if not _SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise DeepSpeedImportError(f"{directory}: the name {name!r} is not a plain file name; "
                                   "refused (the checkpoint was altered)")
    path = os.path.join(directory, name)
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        raise DeepSpeedImportError(f"{path} is missing; the checkpoint is incomplete") from None
    if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode)):
        what = ("a symlink" if stat.S_ISLNK(mode) else
                f"not a {'directory' if want_dir else 'regular file'}")
        raise DeepSpeedImportError(f"{path} is {what}; refused (megaq reads only the "
                                   "checkpoint's own files)")
    return path


def _load(path: str):
    return read_foreign(path, safe_unpickle.DEEPSPEED, DeepSpeedImportError)


def _read_tag(root: str) -> str | None:
    """The tag directory DeepSpeed's `latest_universal` (preferred) or `latest` names."""
    for tracker in (UNIVERSAL_LATEST, LATEST):
        if os.path.lexists(os.path.join(root, tracker)):
            with open(_entry(root, tracker), "rb") as f:
                tag = f.read(256).decode("utf-8", "replace").strip()
            if tracker == UNIVERSAL_LATEST:  # ds_to_universal writes the output's basename
                tag = os.path.basename(tag)
            return _entry(root, tag, want_dir=True)
    return None


def find_checkpoint(path: str) -> tuple[str, str]:
    """("universal" | "zero3", tag directory) for a DeepSpeed checkpoint root or tag."""
    if not os.path.isdir(path):
        raise DeepSpeedImportError(f"{path} is not a directory; pass a DeepSpeed checkpoint "
                                   "directory (save_checkpoint's save_dir or one of its tags)")
    if not os.path.lexists(os.path.join(path, ZERO_DIR)) and not _optim_files(path):
        tag = _read_tag(path)
        if tag is None:
            raise DeepSpeedImportError(
                f"{path} is not a DeepSpeed checkpoint: it holds no {ZERO_DIR}/ directory "
                f"(universal), no zero_pp_rank_*_optim_states.pt files (a saved tag) and no "
                f"{UNIVERSAL_LATEST} or {LATEST} file; pass save_checkpoint's directory")
        path = tag
    if os.path.lexists(os.path.join(path, ZERO_DIR)):
        _entry(path, ZERO_DIR, want_dir=True)
        return "universal", path
    return "zero3", path


def _optim_files(tag: str) -> dict[tuple[int, int], str]:
    out = {}
    for name in os.listdir(tag):
        m = _OPTIM_FILE.fullmatch(name)
        if m:
            out[(int(m.group(2)), int(m.group(1)))] = name  # (tp, dp)
    return out


# ------------------------------------------------------------------ the model states
def model_states(tag: str) -> dict:
    """The first model-state file of the tag (every rank's holds the same shapes)."""
    names = sorted(n for n in os.listdir(tag) if _MODEL_FILE.fullmatch(n))
    if not names:
        raise DeepSpeedImportError(f"{tag} holds no *mp_rank_00_model_states.pt; the checkpoint is "
                                   "incomplete (ds_to_universal.py copies it into the universal "
                                   "directory)")
    path = _entry(tag, names[0])
    sd = _load(path)
    if not isinstance(sd, dict) or not isinstance(sd.get("param_shapes"), (list, dict)):
        raise DeepSpeedImportError(f"{path} holds no param_shapes; it is not a DeepSpeed model-"
                                   "state file (or DeepSpeed saved no optimizer for the run)")
    if (sd.get("mp_world_size") or 1) != 1 or any(_MODEL_FILE.fullmatch(n).group(1) != "00"
                                                  for n in names):
        raise DeepSpeedImportError(f"{tag} was saved with model parallelism (mp_world_size "
                                   f"{sd.get('mp_world_size')}); megaq imports data-parallel "
                                   "DeepSpeed runs (ZeRO over DP only)")
    sd["_path"] = path
    return sd


def param_shape_groups(states: dict) -> list[dict[str, tuple]]:
    """[{name: shape}] per optimizer parameter group, in DeepSpeed's order."""
    groups = states["param_shapes"]
    groups = [groups] if isinstance(groups, dict) else groups
    out, seen = [], set()
    for group in groups:
        if not isinstance(group, dict):
            raise DeepSpeedImportError(f"{states['_path']}: param_shapes holds a "
                                       f"{type(group).__name__}, not a dict of shapes; the file "
                                       "is damaged")
        shapes = {}
        for name, shape in group.items():
            if (not isinstance(name, str) or name in seen or not isinstance(shape, (tuple, list))
                    or not all(isinstance(d, int) and d >= 0 for d in shape)):
                raise DeepSpeedImportError(f"{states['_path']}: param_shapes lists {name!r} with "
                                           f"shape {shape!r}; the file is damaged")
            seen.add(name)
            shapes[name] = tuple(shape)
        out.append(shapes)
    return out


# ------------------------------------------------------------------ optimizer state
def _as_tensor(value, path: str, shape: tuple) -> torch.Tensor:
    t = value.get("param") if isinstance(value, dict) else value  # ZeRO-1/2: {"param": ...}
    if not isinstance(t, torch.Tensor) or t.numel() != math.prod(shape):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise DeepSpeedImportError(f"{path} holds {got}, not the {shape} tensor param_shapes "
                                   "gives; the checkpoint is damaged or of another model")
    return t.detach().float().reshape(shape).clone()


def read_universal(tag: str, shapes: dict, optimizer: bool) -> dict:
    """{name: {"param", "exp_avg", "exp_avg_sq"}} (moments only with `optimizer`)."""
    zero = _entry(tag, ZERO_DIR, want_dir=True)
    out = {}
    for name, shape in shapes.items():
        where = _entry(zero, name, want_dir=True)
        files = {"param": "fp32.pt", **({m: f"{m}.pt" for m in MOMENTS} if optimizer else {})}
        entry = {}
        for key, fname in files.items():
            if key != "param" and not os.path.lexists(os.path.join(where, fname)):
                raise DeepSpeedImportError(
                    f"{where} holds no {fname}: the universal checkpoint has no Adam moments "
                    "for this parameter (saved without the optimizer, or converted partly); "
                    "import the weights only with --no-optimizer, or re-run ds_to_universal.py")
            path = _entry(where, fname)
            entry[key] = _as_tensor(_load(path), path, shape)
        out[name] = entry
    return out


def read_zero3(tag: str, groups: list[dict], states: dict, optimizer: bool) -> dict:
    """read_universal's result from a ZeRO-3 tag: each parameter's pieces cut out of every
    DP rank's flat partitions (ds_to_universal.py's extract_zero_shards_stage3)."""
    files = _optim_files(tag)
    dp = states.get("dp_world_size")
    if not files:
        raise DeepSpeedImportError(f"{tag} holds no zero_pp_rank_*_optim_states.pt; the checkpoint "
                                   "is incomplete")
    if not isinstance(dp, int) or sorted(files) != [(0, r) for r in range(dp)]:
        raise DeepSpeedImportError(f"{tag} holds the optimizer files of DP ranks "
                                   f"{sorted(r for _, r in files)}, the model states say DP {dp}; "
                                   "the checkpoint is incomplete")
    flats = []  # per rank: [per group {"param", "exp_avg", "exp_avg_sq"}]
    for r in range(dp):
        path = _entry(tag, files[(0, r)])
        sd = _load(path)
        osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        stage = getattr(osd.get("zero_stage"), "value", osd.get("zero_stage")) \
            if isinstance(osd, dict) else None
        if stage != 3:
            raise DeepSpeedImportError(
                f"{path} is a ZeRO stage {stage} optimizer file; megaq reads the universal layout "
                f"for it: run `{UNIVERSAL_HINT.format(tag=tag)}` and pass the output")
        if osd.get("partition_count", dp) != dp:
            raise DeepSpeedImportError(f"{path}: the optimizer partitions over "
                                       f"{osd.get('partition_count')} ranks, not the run's DP {dp}"
                                       "; megaq reads plain ZeRO-3 (no MiCS partition groups)"
                                       f": run `{UNIVERSAL_HINT.format(tag=tag)}` and pass the output")
        flat, state = osd.get("fp32_flat_groups"), (osd.get("optimizer_state_dict") or {}).get("state")
        if not (isinstance(flat, list) and len(flat) == len(groups) and isinstance(state, dict)):
            raise DeepSpeedImportError(f"{path} holds no fp32_flat_groups and optimizer state for "
                                       f"the {len(groups)} parameter groups param_shapes lists; the "
                                       "checkpoint is damaged")
        per_group = []
        for i in range(len(groups)):
            st = state.get(i)
            if optimizer and not (isinstance(st, dict) and all(m in st for m in MOMENTS)):
                raise DeepSpeedImportError(
                    f"{path} holds no Adam moments for parameter group {i} (an optimizer other "
                    "than Adam, or saved before the first step); import the weights only with "
                    "--no-optimizer")
            per_group.append({"param": flat[i], **({m: st[m] for m in MOMENTS} if optimizer else {})})
        flats.append(per_group)
    out = {}
    for i, group in enumerate(groups):
        offset = 0
        for name, shape in group.items():
            numel = math.prod(shape)
            part = math.ceil(numel / dp)
            entry = {}
            for key in flats[0][i]:
                pieces = [flats[r][i][key] for r in range(dp)]
                if any(not isinstance(p, torch.Tensor) or p.numel() < offset + part for p in pieces):
                    raise DeepSpeedImportError(f"{tag}: parameter group {i}'s flat {key} is shorter "
                                               f"than its parameters; the checkpoint is damaged")
                full = torch.cat([p.detach().flatten()[offset:offset + part] for p in pieces])
                entry[key] = full[:numel].float().reshape(shape).clone()
            out[name] = entry
            offset += part
    return out


def optimizer_step(tag: str, kind: str, names: list[str]) -> tuple[int, dict]:
    """(the Adam step count, the first param group's hyper-parameters) of the run."""
    if kind == "universal":
        path = _entry(_entry(tag, ZERO_DIR, want_dir=True), OPTIMIZER_STATE)
        sd = _load(path)
    else:
        path = _entry(tag, _optim_files(tag)[(0, 0)])
        sd = _load(path)
        sd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
    # ZeRO-3 keeps the torch optimizer's state dict inside; ZeRO-1/2's universal file
    # holds its param groups at the top (and the step in each zero/<name>/step.pt)
    inner = sd.get("optimizer_state_dict", sd) if isinstance(sd, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        raise DeepSpeedImportError(f"{path} holds no optimizer param groups; the checkpoint is "
                                   "damaged (or saved without the optimizer: --no-optimizer)")
    steps = {int(st["step"]) for st in (inner.get("state") or {}).values()
             if isinstance(st, dict) and isinstance(st.get("step"), (int, float, torch.Tensor))}
    if not steps and kind == "universal":  # ZeRO-1/2 universal: one step.pt per parameter
        for name in names:
            step_file = os.path.join(tag, ZERO_DIR, name, "step.pt")
            if os.path.lexists(step_file):
                value = _load(_entry(os.path.dirname(step_file), "step.pt"))
                steps.add(int(value.get("param") if isinstance(value, dict) else value))
    if len(steps) != 1:
        raise DeepSpeedImportError(f"{path}: the optimizer's parameter groups hold steps "
                                   f"{sorted(steps)}, not one; the checkpoint is damaged")
    groups = inner.get("param_groups")
    hyper = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], dict) else {}
    decay = [g.get("weight_decay") for g in groups or [] if isinstance(g, dict)]
    return steps.pop(), dict(hyper, weight_decay=max((d for d in decay if d is not None),
                                                     default=None))


# ------------------------------------------------------------------ the architecture
def architecture(shapes: dict, heads: int | None, where: str) -> dict:
    """megaq's architecture values (megatron.architecture_from_args's keys) read off the
    parameter shapes of a megaq GPTModel; `heads` (--num-attention-heads) is needed."""
    def shape(name):
        if name not in shapes:
            raise DeepSpeedImportError(
                f"{where} holds no parameter {name}; the DeepSpeed run's model is not megaq's "
                "GPTModel (megaq imports DeepSpeed runs of megaq.model.GPTModel, whose names "
                "it keeps)")
        return shapes[name]
    layers = {int(m.group(1)) for n in shapes if (m := re.match(r"layers\.(\d+)\.", n))}
    if not layers or layers != set(range(len(layers))):
        raise DeepSpeedImportError(f"{where}: the parameters number layers {sorted(layers)[:8]}, "
                                   "not 0..N-1; the run's model is not megaq's GPTModel")
    if not heads or heads < 1:
        raise DeepSpeedImportError("--from deepspeed needs --num-attention-heads (a DeepSpeed "
                                   "checkpoint records shapes only, and a fused QKV weight does "
                                   "not tell the heads)")
    rows, hidden = shape("embedding.word_embeddings.weight")
    qkv_rows = shape("layers.0.self_attention.linear_qkv.weight")[0]
    proj_in = shape("layers.0.self_attention.linear_proj.weight")[1]
    ffn = shape("layers.0.mlp.linear_fc2.weight")[1]
    fc1_rows = shape("layers.0.mlp.linear_fc1.weight")[0]
    kv, rem = divmod(proj_in, heads)
    groups2 = qkv_rows // kv - heads if kv and not rem and qkv_rows % kv == 0 else -1
    if groups2 < 2 or groups2 % 2 or heads % (groups2 // 2):
        raise DeepSpeedImportError(f"--num-attention-heads {heads} does not fit the attention "
                                   f"weights (QKV {qkv_rows} rows, projection {proj_in} columns); "
                                   "give the run's head count")
    positions = shapes.get("embedding.position_embeddings.weight")
    return {
        "num_layers": len(layers), "hidden_size": hidden, "ffn_hidden_size": ffn,
        "num_attention_heads": heads, "num_query_groups": groups2 // 2, "kv_channels": kv,
        "seq_length": positions[0] if positions else None,
        "max_position_embeddings": positions[0] if positions else None,
        "position_embedding_type": "learned_absolute" if positions else "rope",
        "rotary_base": 10000, "use_rope_scaling": False, "rope_scaling_factor": 8.0,
        "qk_layernorm": "layers.0.self_attention.q_layernorm.weight" in shapes,
        "normalization": "LayerNorm" if "layers.0.input_layernorm.bias" in shapes else "RMSNorm",
        "norm_epsilon": 1e-5, "swiglu": fc1_rows == 2 * ffn,
        "add_bias_linear": "layers.0.self_attention.linear_proj.bias" in shapes,
        "untie_embeddings_and_output_weights": "output_layer.weight" in shapes,
        "make_vocab_size_divisible_by": 1, "padded_vocab_size": rows, "vocab_size": None,
        "hidden_dropout": None, "attention_dropout": None,
    }


def from_hf_names(tensors: dict, hf_config: str, seq_length: int | None,
                  where: str) -> tuple[dict, list[str], dict]:
    """(arch values write_megaq_checkpoint reads, megaq flags, {megaq name: {key: full
    tensor}}) of a DeepSpeed run of a transformers model, by the Hugging Face import's
    mapping (megaq.interop.hf), applied to the weights and to each moment alike."""
    from megaq.interop.common import megaq_layout, megaq_run_config
    from megaq.interop.hf import MAPPINGS, _read_json, flags_from_hf_config
    cfg_path = os.path.join(hf_config, "config.json") if os.path.isdir(hf_config) else hf_config
    if not os.path.isfile(cfg_path):
        raise DeepSpeedImportError(f"--hf-config {hf_config} is not a config.json nor a directory "
                                   "holding one; pass the transformers config of the run's model")
    cfg = _read_json(cfg_path, "a model configuration")
    try:
        family, flags = flags_from_hf_config(cfg, seq_length, 1)
    except (KeyError, TypeError, ValueError) as e:
        raise DeepSpeedImportError(f"{cfg_path} is incomplete or malformed ({type(e).__name__}: "
                                   f"{e}); pass the run's config.json") from None
    run = megaq_run_config(flags, 1, 1)
    mapping = MAPPINGS[family](run.model, run.padded_vocab_size)
    used = set()

    def getter(key):
        def get(hf_name, shape):
            if hf_name not in tensors:
                raise DeepSpeedImportError(f"{where}: the run's model has no parameter {hf_name}, "
                                           f"which {cfg_path} implies; the checkpoint is not of "
                                           "that model")
            t = tensors[hf_name][key]
            want = tuple(t.shape[0] if d is None else d for d in shape)
            if tuple(t.shape) != want:
                raise DeepSpeedImportError(f"{where}: {hf_name} has shape {tuple(t.shape)}, "
                                           f"{cfg_path} implies {want}; the checkpoint is not of "
                                           "that model")
            used.add(hf_name)
            return t
        return get
    keys = list(next(iter(tensors.values())))
    out = {info.name: {k: mapping.from_hf(info.name, getter(k)) for k in keys}
           for info in megaq_layout(run.model, 1, 1)}
    unused = sorted(n for n in set(tensors) - used if not mapping.ignored_hf_name(n))
    if unused:
        raise DeepSpeedImportError(f"{where}: parameter {unused[0]} (and {len(unused) - 1} more) "
                                   f"has no megaq counterpart in a {family} model; the model has "
                                   "parts megaq lacks")
    value = lambda flag: int(flags[flags.index(flag) + 1])  # noqa: E731
    arch = {"num_layers": value("--num-layers"), "vocab_size": value("--vocab-size"),
            "make_vocab_size_divisible_by": 1, "seq_length": value("--seq-length"),
            "padded_vocab_size": out["embedding.word_embeddings.weight"]["param"].shape[0]}
    return arch, flags, out


# ------------------------------------------------------------------ the conversion
def load_deepspeed_checkpoint(path: str, *, heads: int | None, optimizer: bool = True,
                              model_flags: list[str] = (), hf_config: str | None = None,
                              seq_length: int | None = None) -> tuple[dict, dict]:
    """(config, weights) as megatron.load_megatron_checkpoint gives them, for
    megatron.write_megaq_checkpoint: config["training"] holds the optimizer state and the
    run's position when `optimizer`. `hf_config`: the run's model is that transformers
    model (else megaq's GPTModel, of `heads` attention heads)."""
    from megaq.interop.megatron import architecture_flags
    kind, tag = find_checkpoint(path)
    states = model_states(tag)
    groups = param_shape_groups(states)
    shapes = {n: s for g in groups for n, s in g.items()}
    tensors = (read_universal(tag, shapes, optimizer) if kind == "universal"
               else read_zero3(tag, groups, states, optimizer))
    if hf_config:
        arch, flags, tensors = from_hf_names(tensors, hf_config, seq_length, states["_path"])
        flags += list(model_flags)
    else:
        arch = architecture(shapes, heads, states["_path"])
        flags = architecture_flags(arch) + list(model_flags)
    iteration = states.get("global_steps")
    samples = states.get("global_samples")
    ds_config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    bf16 = ds_config.get("bf16")
    if isinstance(bf16, dict) and bf16.get("enabled") is True and "--bf16" not in flags:
        flags.append("--bf16")  # DeepSpeed's bf16 mode: bf16 weights and compute, fp32 masters
    config = dict(arch, flags=flags, iteration=iteration,
                  source=os.path.abspath(path), vocab_rows=arch["padded_vocab_size"],
                  has_optimizer=optimizer, format=kind,
                  provenance={"imported_from": os.path.abspath(path),
                              "deepspeed_tag": os.path.basename(os.path.normpath(tag)),
                              "deepspeed_version": str(states.get("ds_version")),
                              "deepspeed_global_steps": iteration})
    if optimizer:
        for what, value in (("global_steps", iteration), ("global_samples", samples)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DeepSpeedImportError(f"{states['_path']}: {what} is {value!r}, not a "
                                           "non-negative integer; the file is damaged")
        step, hyper = optimizer_step(tag, kind, list(shapes))
        gbs = ds_config.get("train_batch_size")
        scheduled = states.get("lr_scheduler") is not None
        flags = []
        # the param groups' lr is the schedule's current value when DeepSpeed ran one
        for flag, value in (("--lr", None if scheduled else hyper.get("lr")),
                            ("--weight-decay", hyper.get("weight_decay")),
                            ("--adam-beta1", (hyper.get("betas") or (None, None))[0]),
                            ("--adam-beta2", (hyper.get("betas") or (None, None))[1]),
                            ("--adam-eps", hyper.get("eps")),
                            ("--clip-grad", ds_config.get("gradient_clipping")),
                            ("--global-batch-size", gbs)):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flags += [flag, str(value) if flag == "--global-batch-size" else repr(float(value))]
        if not scheduled:
            flags += ["--lr-decay-style", "constant"]  # the client optimizer's fixed LR
        config["training"] = {
            "params": {n: {m: t[m] for m in MOMENTS} for n, t in tensors.items()},
            "step": step, "iteration": iteration, "consumed_samples": samples,
            "scheduler": {"num_steps": iteration, "num_samples": samples},
            "optimizer_flags": flags,
            "lr_scheduler_kept": not scheduled}
    return config, {n: t["param"] for n, t in tensors.items()}


def convert_to_megaq(a) -> str:
    """tools/convert_checkpoint.py --from deepspeed --to megaq: `a.input` (a DeepSpeed
    checkpoint) -> `a.output` (megaq checkpoint at the layout flags); the report lines."""
    import shlex

    from megaq.interop.megatron import write_megaq_checkpoint
    tp, pp, vp = target_layout(a, DeepSpeedImportError)
    if (getattr(a, "make_vocab_size_divisible_by", 1) or 1) != 1:
        raise DeepSpeedImportError("--make-vocab-size-divisible-by is read from the checkpoint "
                                   "(its embedding rows are kept); drop it for --from deepspeed")
    model_flags = shlex.split(getattr(a, "model_flags", None) or "")
    hf_config = getattr(a, "hf_config", None)
    seq = getattr(a, "seq_length", None)
    if seq and not hf_config:
        model_flags += ["--seq-length", str(seq)]
    optimizer = not getattr(a, "no_optimizer", False)
    config, weights = load_deepspeed_checkpoint(
        a.input, heads=getattr(a, "num_attention_heads", None), optimizer=optimizer,
        model_flags=model_flags, hf_config=hf_config, seq_length=seq)
    if config["seq_length"] is None and "--seq-length" not in model_flags:
        raise DeepSpeedImportError("the model has rotary positions, so its sequence length is not "
                                   "in the checkpoint; give --seq-length")
    out = write_megaq_checkpoint(config, iter(weights.items()), a.output,
                                 overwrite=getattr(a, "overwrite", False), tp=tp, pp=pp, vp=vp)
    state = config.get("training")
    if state:
        note = (f"; optimizer state imported: Adam moments, step {state['step']}, iteration "
                f"{state['iteration']}, {state['consumed_samples']} consumed samples"
                + ("" if state["lr_scheduler_kept"] else
                   "; DeepSpeed's LR scheduler is not imported (its position is): give the "
                   "schedule's flags (--lr, warm-up, decay)"))
    else:
        note = "; weights only (fresh AdamW moments, iteration 0)"
    return (f"[convert] {a.input} (DeepSpeed {config['format']}, {config['provenance']['deepspeed_tag']}) "
            f"-> {out['dir']} at TP {tp} x PP {pp}{f' x VP {vp}' if vp > 1 else ''}: "
            f"{out['tensors']} tensors{note}\n"
            f"[convert] train from it with: python pretrain_gpt.py {' '.join(out['flags'])} "
            f"{' '.join(out['load_flags'])} <data and training flags>")
