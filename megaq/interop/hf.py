"""megaq <-> Hugging Face transformers: Llama family (Qwen3 for --qk-layernorm) and GPT-2,
both directions.

Export (`export_to_hf`): a megaq checkpoint of any TP x PP (x virtual PP) layout ->
a directory that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load with no custom code (config.json, safetensors, generation_config.json, tokenizer
files). It runs on one process, memory-maps the checkpoint's shard files and builds
one full tensor at a time, so peak memory stays near the largest tensor.

Import (`import_from_hf`): a transformers Llama-family or GPT-2 directory (safetensors
or .bin) -> a megaq checkpoint at iteration 0 for a chosen layout, plus the
pretrain_gpt.py flags that describe the architecture.

What differs between the two worlds (docs/INTEROP.md has the full table):
- megaq fuses Q, K, V into one matrix laid out by query group, [group][q heads of
  the group, k, v][head dim]; transformers' Llama has separate q/k/v_proj, GPT-2 one
  c_attn laid out [q | k | v].
- megaq fuses the SwiGLU gate and up projections into linear_fc1 = [gate; up].
- GPT-2's Conv1D stores weights as [in, out]: transposed against nn.Linear.
- Rotary: megaq's RoPE is the "rotate half" convention with cat(freqs, freqs) tables
  (megaq/model/layers.py, kernels/fused_rope.py), which is transformers' Llama
  convention, so q/k rows need no permutation.
- Vocabulary padding (TP divisibility) is kept: the padded rows are written and the
  config's vocab_size counts them; generation_config.json lists the padded ids in
  `suppress_tokens`, so `generate()` never samples them (their logits are not
  -inf in a plain forward pass: slice `[..., :vocab]` there).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from megaq import export_files
from megaq.checkpoint import integrity, safe_unpickle
from megaq.checkpoint.paths import iteration_dir
from megaq.checkpoint.reshard import fit_rows
from megaq.data import tokenizer_files
from megaq.data.errors import DataError
from megaq.interop.checkpoint_tokenizer import run_tokenizer
from megaq.interop.common import (InteropError, MegaqCheckpointReader, ParamInfo, check_output,
                                  megaq_layout, megaq_layout_flags, megaq_run_config, progress,
                                  replace_dir, temp_dir_for, write_json, write_megaq_args,
                                  write_megaq_checkpoint)
from megaq.interop.hf_tokenizer import write_tokenizer
from megaq.model.layers import (LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR,
                                LLAMA3_ORIGINAL_CONTEXT)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_HF_DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


# ------------------------------------------------------------------ model families
def model_family(config) -> str:
    """'llama' or 'gpt2': the transformers architecture that computes what this megaq
    model computes; refuses combinations neither has."""
    c = config
    if c.position_embedding_type == "rope" and c.normalization == "RMSNorm" and c.swiglu:
        if not c.qk_layernorm:
            return "llama"
        if c.add_bias_linear:  # Qwen3's MLP has no biases, its attention may
            raise InteropError("a --qk-layernorm model with linear biases has no transformers "
                               "counterpart: Qwen3 (per-head q/k norms) has no MLP biases; "
                               "train with --disable-bias-linear")
        return "qwen3"
    if c.qk_layernorm:
        raise InteropError("--qk-layernorm exports as Qwen3 (rope, RMSNorm, --swiglu); no "
                           "transformers architecture has per-head q/k norms with this model's "
                           "position embedding, norm and MLP")
    if c.position_embedding_type == "learned_absolute" and c.normalization == "LayerNorm" \
            and not c.swiglu:
        if not c.add_bias_linear:
            raise InteropError("a GPT-2 style model (learned positions, LayerNorm, GELU) without "
                               "biases (--disable-bias-linear) has no transformers counterpart: "
                               "GPT-2 always has biases")
        if c.num_query_groups != c.num_attention_heads:
            raise InteropError("a GPT-2 style model with grouped-query attention "
                               "(--num-query-groups) has no transformers counterpart")
        if c.kv_channels * c.num_attention_heads != c.hidden_size:
            raise InteropError("a GPT-2 style model with --kv-channels x heads != hidden size "
                               "has no transformers counterpart")
        return "gpt2"
    raise InteropError(
        f"no transformers architecture matches position embedding {c.position_embedding_type}, "
        f"{c.normalization}, {'SwiGLU' if c.swiglu else 'GELU'}: export supports the Llama "
        f"family (rope, RMSNorm, --swiglu) and GPT-2 (learned_absolute, LayerNorm, GELU)")


def _split_layer(name: str) -> tuple[int | None, str]:
    """'layers.3.mlp.linear_fc1.weight' -> (3, 'mlp.linear_fc1.weight'); others (None, name)."""
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        return int(idx), rest
    return None, name


class _Mapping:
    """Name and layout mapping of one family. `to_hf(name, full)` turns one full megaq
    tensor into its transformers tensors; `from_hf(name, get)` builds the full megaq
    tensor from transformers tensors (`get(hf_name, shape)` reads and checks one)."""

    layer_prefix = ""
    top: dict[str, str] = {}   # megaq name -> HF name (outside the blocks)
    block: dict[str, str] = {}  # megaq name inside a block -> HF name inside a block

    def __init__(self, config, padded_vocab: int):
        self.c, self.vp = config, padded_vocab
        c = config
        self.groups, self.d = c.num_query_groups, c.kv_channels
        self.rep = c.num_attention_heads // c.num_query_groups

    # the fused QKV layout: [group][rep q heads, k, v][d] along dim 0
    def split_qkv(self, t: torch.Tensor):
        x = t.reshape(self.groups, self.rep + 2, self.d, *t.shape[1:])
        rest = t.shape[1:]
        q = x[:, :self.rep].reshape(self.groups * self.rep * self.d, *rest)
        return q, x[:, self.rep].reshape(-1, *rest), x[:, self.rep + 1].reshape(-1, *rest)

    def merge_qkv(self, q, k, v):
        rest = q.shape[1:]
        return torch.cat([q.reshape(self.groups, self.rep, self.d, *rest),
                          k.reshape(self.groups, 1, self.d, *rest),
                          v.reshape(self.groups, 1, self.d, *rest)], dim=1).reshape(-1, *rest)

    def hf_name(self, name: str) -> str | None:
        layer, rest = _split_layer(name)
        if layer is None:
            return self.top.get(name)
        local = self.block.get(rest)
        return None if local is None else f"{self.layer_prefix}{layer}.{local}"

    def ignored_hf_name(self, hf_name: str) -> bool:
        """HF tensors that carry no weights (buffers some checkpoints include)."""
        return False


class LlamaMapping(_Mapping):
    layer_prefix = "model.layers."
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "final_norm.weight": "model.norm.weight",
           "output_layer.weight": "lm_head.weight"}
    block = {"input_layernorm.weight": "input_layernorm.weight",
             "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
             "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
             "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
             "mlp.linear_fc2.weight": "mlp.down_proj.weight",
             "mlp.linear_fc2.bias": "mlp.down_proj.bias"}

    def _qkv_names(self, layer, kind):
        return [f"{self.layer_prefix}{layer}.self_attn.{p}_proj.{kind}" for p in "qkv"]

    def _fc1_names(self, layer, kind):
        return [f"{self.layer_prefix}{layer}.mlp.{p}_proj.{kind}" for p in ("gate", "up")]

    def to_hf(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        layer, rest = _split_layer(name)
        if rest.startswith("self_attention.linear_qkv."):
            return list(zip(self._qkv_names(layer, rest.rsplit(".", 1)[1]), self.split_qkv(t)))
        if rest.startswith("mlp.linear_fc1."):  # [gate; up]
            return list(zip(self._fc1_names(layer, rest.rsplit(".", 1)[1]), t.chunk(2, dim=0)))
        return [(self.hf_name(name), t)]

    def from_hf(self, name: str, get) -> torch.Tensor:
        c, layer, rest = self.c, *_split_layer(name)
        h, f = c.hidden_size, c.ffn_hidden_size
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            q_rows, kv_rows = c.num_attention_heads * self.d, self.groups * self.d
            shapes = [(q_rows,), (kv_rows,), (kv_rows,)]
            if kind == "weight":
                shapes = [s + (h,) for s in shapes]
            return self.merge_qkv(*(get(n, s) for n, s in zip(self._qkv_names(layer, kind), shapes)))
        if rest.startswith("mlp.linear_fc1."):
            kind = rest.rsplit(".", 1)[1]
            shape = (f, h) if kind == "weight" else (f,)
            return torch.cat([get(n, shape) for n in self._fc1_names(layer, kind)], dim=0)
        shape = {"embedding.word_embeddings.weight": (None, h), "output_layer.weight": (None, h),
                 "self_attention.linear_proj.weight": (h, c.num_attention_heads * self.d),
                 "mlp.linear_fc2.weight": (h, f)}.get(rest, (h,))
        return get(self.hf_name(name), shape)

    def ignored_hf_name(self, hf_name: str) -> bool:
        return hf_name.endswith("rotary_emb.inv_freq")


class Qwen3Mapping(LlamaMapping):
    """Llama's names plus Qwen3's per-head RMSNorms on queries and keys (--qk-layernorm)."""

    block = {**LlamaMapping.block,
             "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
             "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}

    def from_hf(self, name: str, get) -> torch.Tensor:
        if name.endswith(("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")):
            return get(self.hf_name(name), (self.d,))
        return super().from_hf(name, get)


class GPT2Mapping(_Mapping):
    layer_prefix = "transformer.h."
    top = {"embedding.word_embeddings.weight": "transformer.wte.weight",
           "embedding.position_embeddings.weight": "transformer.wpe.weight",
           "final_norm.weight": "transformer.ln_f.weight",
           "final_norm.bias": "transformer.ln_f.bias",
           "output_layer.weight": "lm_head.weight"}
    block = {"input_layernorm.weight": "ln_1.weight", "input_layernorm.bias": "ln_1.bias",
             "pre_mlp_layernorm.weight": "ln_2.weight", "pre_mlp_layernorm.bias": "ln_2.bias",
             "self_attention.linear_qkv.weight": "attn.c_attn.weight",
             "self_attention.linear_qkv.bias": "attn.c_attn.bias",
             "self_attention.linear_proj.weight": "attn.c_proj.weight",
             "self_attention.linear_proj.bias": "attn.c_proj.bias",
             "mlp.linear_fc1.weight": "mlp.c_fc.weight", "mlp.linear_fc1.bias": "mlp.c_fc.bias",
             "mlp.linear_fc2.weight": "mlp.c_proj.weight", "mlp.linear_fc2.bias": "mlp.c_proj.bias"}
    # Conv1D weights are [in, out]: the transpose of megaq's (and nn.Linear's) [out, in]
    _conv1d = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
               "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")

    def to_hf(self, name, t):
        _, rest = _split_layer(name)
        if rest.startswith("self_attention.linear_qkv."):
            # per head [q, k, v] (MHA: one head per group) -> [all q | all k | all v]
            t = torch.cat(self.split_qkv(t), dim=0)
        if rest in self._conv1d:
            t = t.t()
        return [(self.hf_name(name), t.contiguous())]

    def from_hf(self, name, get):
        c, (_, rest) = self.c, _split_layer(name)
        h, f = c.hidden_size, c.ffn_hidden_size
        shape = {"embedding.word_embeddings.weight": (None, h), "output_layer.weight": (None, h),
                 "embedding.position_embeddings.weight": (c.max_position_embeddings, h),
                 "self_attention.linear_qkv.weight": (h, 3 * h),
                 "self_attention.linear_qkv.bias": (3 * h,),
                 "self_attention.linear_proj.weight": (h, h),
                 "mlp.linear_fc1.weight": (h, f), "mlp.linear_fc1.bias": (f,),
                 "mlp.linear_fc2.weight": (f, h)}.get(rest, (h,))
        t = get(self.hf_name(name), shape)
        if rest in self._conv1d:
            t = t.t().contiguous()
        if rest.startswith("self_attention.linear_qkv."):
            t = self.merge_qkv(*t.chunk(3, dim=0))
        return t

    def ignored_hf_name(self, hf_name):
        # causal-mask buffers stored by older GPT-2 checkpoints
        return hf_name.endswith((".attn.bias", ".attn.masked_bias"))


MAPPINGS = {"llama": LlamaMapping, "qwen3": Qwen3Mapping, "gpt2": GPT2Mapping}


# ------------------------------------------------------------------ safetensors out
class SafetensorsWriter:
    """Streams tensors into safetensors files, one tensor in memory at a time.

    The format puts a JSON header (names, dtypes, shapes, offsets) before the data, so
    each shard's data goes to a scratch file first; closing the shard writes header +
    data. A new shard starts when the next tensor would pass `max_shard_bytes`; with
    more than one, the files are model-0000i-of-0000n.safetensors plus
    model.safetensors.index.json (transformers' names)."""

    def __init__(self, out_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.out_dir, self.max = out_dir, max_shard_bytes
        self.shards: list[tuple[str, dict]] = []  # (scratch data file, header entries)
        self._f = None
        self._size = 0
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.dtype not in _SAFETENSORS_DTYPE:
            raise InteropError(f"cannot write {name}: dtype {t.dtype} is not supported")
        nbytes = t.numel() * t.element_size()
        if self._f is None or (self._size and self._size + nbytes > self.max):
            self._new_shard()
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._f.write(raw.tobytes() if raw.size == 0 else memoryview(raw))
        self.shards[-1][1][name] = {"dtype": _SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape),
                                    "data_offsets": [self._size, self._size + nbytes]}
        self._size += nbytes
        self.total += nbytes

    def _new_shard(self) -> None:
        if self._f is not None:
            self._f.close()
        path = os.path.join(self.out_dir, f".shard{len(self.shards)}.data")
        self._f = open(path, "wb")
        self._size = 0
        self.shards.append((path, {}))

    def close(self) -> list[str]:
        """Write the final files; returns their names."""
        if self._f is not None:
            self._f.close()
            self._f = None
        n = len(self.shards)
        names = [export_files.WEIGHTS] if n == 1 else \
            [export_files.shard_name(i + 1, n) for i in range(n)]
        weight_map = {}
        for (data_path, entries), fname in zip(self.shards, names):
            header = json.dumps({"__metadata__": {"format": "pt"}, **entries},
                                separators=(",", ":")).encode()
            header += b" " * (-len(header) % 8)  # keep the data 8-byte aligned
            with open(os.path.join(self.out_dir, fname), "wb") as out, open(data_path, "rb") as src:
                out.write(len(header).to_bytes(8, "little"))
                out.write(header)
                shutil.copyfileobj(src, out, 64 * 2**20)
            os.remove(data_path)
            weight_map.update({k: fname for k in entries})
        if n > 1:
            write_json(os.path.join(self.out_dir, export_files.WEIGHTS_INDEX),
                        {"metadata": {"total_size": self.total}, "weight_map": weight_map})
        return names


# ------------------------------------------------------------------ HF config files
def hf_config(config, family: str, padded_vocab: int, dtype: torch.dtype,
              special: dict) -> dict:
    """config.json for LlamaForCausalLM or GPT2LMHeadModel."""
    c = config
    common = {"vocab_size": padded_vocab, "initializer_range": c.init_method_std,
              "tie_word_embeddings": c.tie_embeddings, "use_cache": True,
              "dtype": _HF_DTYPE_NAME[dtype], "torch_dtype": _HF_DTYPE_NAME[dtype],
              "bos_token_id": special.get("bos"), "eos_token_id": special.get("eos"),
              "pad_token_id": special.get("pad")}
    from importlib.metadata import PackageNotFoundError, version
    try:  # the installed version, without importing transformers (seconds)
        common["transformers_version"] = version("transformers")
    except PackageNotFoundError:  # not installed: the field is informational
        pass
    if family in ("llama", "qwen3"):
        rope = {"rope_type": "default", "rope_theta": float(c.rotary_base)}
        if c.use_rope_scaling:
            rope = {"rope_type": "llama3", "rope_theta": float(c.rotary_base),
                    "factor": float(c.rope_scaling_factor),
                    "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
                    "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                    "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
        body = {"hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size,
                "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_query_groups, "head_dim": c.kv_channels,
                "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings,
                "rms_norm_eps": c.layernorm_epsilon,
                "rope_parameters": rope,
                "rope_theta": float(c.rotary_base),  # the fields' names before transformers 5
                **({"rope_scaling": rope} if c.use_rope_scaling else {}),
                "attention_bias": c.add_bias_linear,
                "attention_dropout": c.attention_dropout, **common}
        if family == "qwen3":
            return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **body,
                    "use_sliding_window": False, "sliding_window": None,
                    "max_window_layers": c.num_layers}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **body,
                "mlp_bias": c.add_bias_linear, "pretraining_tp": 1}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_embd": c.hidden_size, "n_layer": c.num_layers, "n_head": c.num_attention_heads,
            "n_inner": c.ffn_hidden_size, "n_positions": c.max_position_embeddings,
            "activation_function": "gelu",  # exact erf GELU, as megaq's F.gelu
            "layer_norm_epsilon": c.layernorm_epsilon, "resid_pdrop": c.hidden_dropout,
            "embd_pdrop": c.hidden_dropout, "attn_pdrop": c.attention_dropout,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, **common}


def generation_config(vocab: int, padded_vocab: int, special: dict) -> dict:
    gen = {"bos_token_id": special.get("bos"), "eos_token_id": special.get("eos"),
           "pad_token_id": special.get("pad")}
    if padded_vocab > vocab:
        # the TP padding rows: kept so shapes match, never sampled
        gen["suppress_tokens"] = list(range(vocab, padded_vocab))
    return {k: v for k, v in gen.items() if v is not None}


# ------------------------------------------------------------------------- export
def export_to_hf(ckpt_path: str, out_dir: str, *, dtype: torch.dtype = torch.float32,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 tokenizer_type: str | None = None, tokenizer_model: str | None = None,
                 vocab_file: str | None = None, merge_file: str | None = None,
                 overwrite: bool = False, log=print) -> dict:
    """Write a transformers directory for a megaq checkpoint (the model its stored
    configuration describes). Written to a temporary directory beside `out_dir`, renamed
    into place at the end. The tokenizer is the run's (megaq.interop.checkpoint_tokenizer:
    the checkpoint's copy of its files first), or the one the tokenizer arguments name;
    its files are written by megaq.interop.hf_tokenizer.

    Returns {"dir", "family", "files", "bytes", "tokenizer": bool, ...}."""
    check_output(out_dir, overwrite, ckpt_path, writes="hf")
    # a tokenizer asked for by name is shipped or refused, never dropped with a note
    named = {"--tokenizer-model": tokenizer_model, "--vocab-file": vocab_file,
             "--merge-file": merge_file}
    for flag_name, path in named.items():
        if path is not None and not (os.path.exists(path) and os.access(path, os.R_OK)):
            raise InteropError(f"{flag_name} {path} is not a readable file; pass the tokenizer "
                               f"the checkpoint was trained with (or leave the flag out to ship "
                               f"the checkpoint's own)")
    strict = tokenizer_type is not None or any(named.values())
    reader = MegaqCheckpointReader(ckpt_path)
    config = reader.model  # one process: its padded vocabulary is the checkpoint's
    family = model_family(config)
    vocab = config.vocab_size
    padded = config.padded_vocab_size(1)
    mapping = MAPPINGS[family](config, padded)
    layout = megaq_layout(config, reader.tp, reader.pp, reader.vp)
    try:  # found before anything is written: a named tokenizer that is no good stops here
        spec = run_tokenizer(reader.dir, reader.config["data"], vocab,
                             tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model,
                             vocab_file=vocab_file, merge_file=merge_file)
    except DataError as e:
        if strict:
            raise InteropError(str(e)) from None
        spec = None
        log(f" note: no tokenizer files: {e}")

    tmp = temp_dir_for(out_dir)
    try:
        writer = SafetensorsWriter(tmp, max_shard_bytes)
        for info in progress(layout, "exporting"):
            if info.name == "output_layer.weight" and config.tie_embeddings:
                continue  # the last stage's copy of the tied embedding
            full = reader.full(info)
            for hf_name, t in mapping.to_hf(info.name, full.float()):
                writer.add(hf_name, t.to(dtype))
            del full
        files = writer.close()

        special = {}
        if spec is not None:
            special = write_tokenizer(tmp, spec, config.seq_length, vocab, strict=strict, log=log)
        write_json(os.path.join(tmp, export_files.CONFIG),
                    hf_config(config, family, padded, dtype, special))
        write_json(os.path.join(tmp, export_files.GENERATION_CONFIG),
                    generation_config(vocab, padded, special))
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"dir": out_dir, "family": family, "files": files, "bytes": writer.total,
            "tokenizer": bool(special), "tokenizer_spec": spec, "source": reader.dir,
            "vocab": vocab, "padded_vocab": padded}


# ------------------------------------------------------------------------- import
class HFTensorSource:
    """Reads one tensor at a time from a transformers directory: model.safetensors,
    sharded safetensors with an index, or pytorch_model.bin (sharded or not; memory-mapped)."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        self._where: dict[str, str] = {}
        self._open: dict[str, object] = {}
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            path = os.path.join(hf_dir, index)
            if os.path.isfile(path):
                self._where = _read_json(path, "a sharded checkpoint's index").get("weight_map")
                if not isinstance(self._where, dict) or not self._where:
                    raise InteropError(f"{path} has no weight_map; the file is damaged or "
                                       f"incomplete: download it again")
                break
        else:
            for single in ("model.safetensors", "pytorch_model.bin"):
                if os.path.isfile(os.path.join(hf_dir, single)):
                    self._where = {name: single for name in self._names_in(single)}
                    break
        if not self._where:
            raise InteropError(f"{hf_dir} holds no model.safetensors, pytorch_model.bin or their "
                               f".index.json; pass a transformers model directory")
        self.used: set[str] = set()

    def _file(self, fname: str):
        if fname not in self._open:
            path = os.path.join(self.dir, fname)
            if not os.path.isfile(path):
                raise InteropError(f"{path} is missing (named by the index); the download is "
                                   f"incomplete")
            try:
                if fname.endswith(".safetensors"):
                    from safetensors import safe_open
                    self._open[fname] = safe_open(path, framework="pt")
                else:  # a pickle: tensors and containers only (megaq.checkpoint.safe_unpickle)
                    self._open[fname] = safe_unpickle.load(path, safe_unpickle.TENSORS, mmap=True)
                    if not isinstance(self._open[fname], dict):
                        raise InteropError(f"{path} holds a {type(self._open[fname]).__name__}, "
                                           f"not a state dict of tensors; download it again")
            except safe_unpickle.UnpicklingRefused as e:
                raise InteropError(str(e)) from None
            except InteropError:
                raise
            except Exception as e:  # noqa: BLE001 - a truncated or foreign file, any reader's error
                raise InteropError(f"{path} cannot be read ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}); the file is "
                                   f"damaged or incomplete: download it again") from None
        return self._open[fname]

    def _names_in(self, fname: str) -> list[str]:
        f = self._file(fname)
        return list(f.keys())

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise InteropError(f"{self.dir}: tensor {name} is missing; the checkpoint does not "
                               f"match its config.json")
        self.used.add(name)
        f = self._file(self._where[name])
        t = f.get_tensor(name) if hasattr(f, "get_tensor") else f.get(name)
        if not isinstance(t, torch.Tensor):
            raise InteropError(f"{os.path.join(self.dir, self._where[name])}: {name} is "
                               f"{'missing' if t is None else 'a ' + type(t).__name__}, not a "
                               f"tensor; the file is damaged or does not match its index")
        return t


def _read_json(path: str, what: str) -> dict:
    """A JSON object file of a transformers directory; anything else is an InteropError."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8 (a cut download)
        raise InteropError(f"{path} cannot be read as JSON ({type(e).__name__}: {e}); the file "
                           f"is damaged or incomplete: download it again") from None
    if not isinstance(obj, dict):
        raise InteropError(f"{path} holds a JSON {type(obj).__name__}, not {what} (an object); "
                           f"the file is damaged or not a transformers file: download it again")
    return obj


def _refuse(field, value, why):
    raise InteropError(f"config.json field {field} = {value!r} is not supported: {why}")


def flags_from_hf_config(cfg: dict, seq_length: int | None = None,
                         make_vocab_size_divisible_by: int = 1) -> tuple[str, list[str]]:
    """(family, pretrain_gpt.py architecture flags) for a transformers config.json, or
    an InteropError naming the first field megaq cannot represent."""
    mt = cfg.get("model_type")
    if mt == "llama":
        return "llama", _llama_flags(cfg, seq_length, make_vocab_size_divisible_by)
    if mt == "qwen3":
        return "qwen3", _qwen3_flags(cfg, seq_length, make_vocab_size_divisible_by)
    if mt == "gpt2":
        return "gpt2", _gpt2_flags(cfg, seq_length, make_vocab_size_divisible_by)
    _refuse("model_type", mt, "megaq imports the Llama family (model_type llama), Qwen3 "
            "and GPT-2")


_LLAMA3_FIXED = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
                 "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                 "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}


def _rope_flags(cfg: dict) -> tuple[float, list]:
    """(rope_theta, the --use-rope-scaling flags): Llama 3.1's "llama3" scaling with
    megatron-core's fixed constants is taken, any other scaling refused."""
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    flags = []
    for field, spec in (("rope_parameters", rope), ("rope_scaling", scaling or {})):
        kind = spec.get("rope_type", spec.get("type"))
        if kind == "llama3":
            for key, want in _LLAMA3_FIXED.items():
                if spec.get(key) != want:
                    _refuse(f"{field}.{key}", spec.get(key), f"megaq's --use-rope-scaling (as "
                            f"megatron-core's) fixes it at {want}")
            flags = ["--use-rope-scaling", "--rope-scaling-factor", float(spec["factor"])]
        elif kind not in (None, "default"):
            _refuse(f"{field}.rope_type", kind, "megaq's RoPE scaling is Llama 3.1's "
                    "(rope_type llama3, --use-rope-scaling) only")
        if spec.get("partial_rotary_factor", 1.0) != 1.0:
            _refuse(f"{field}.partial_rotary_factor", spec["partial_rotary_factor"],
                    "megaq rotates the full head dim")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse("partial_rotary_factor", cfg["partial_rotary_factor"],
                "megaq rotates the full head dim")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))), flags


def _llama_flags(cfg, seq_length, divisible_by) -> list[str]:
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", cfg["hidden_act"], "megaq's gated MLP is SwiGLU (silu)")
    if bool(cfg.get("attention_bias", False)) != bool(cfg.get("mlp_bias", False)):
        _refuse("attention_bias", cfg.get("attention_bias"),
                f"megaq has one bias switch for every linear layer, and mlp_bias is "
                f"{cfg.get('mlp_bias')}")
    theta, rope_flags = _rope_flags(cfg)
    if theta != int(theta):
        _refuse("rope_theta", theta, "megaq's --rotary-base is an integer")
    for field in ("sliding_window", "layer_types"):
        if cfg.get(field):
            _refuse(field, cfg[field], "megaq's attention is full causal attention")
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    maxpos = int(cfg.get("max_position_embeddings", 2048))
    flags = ["--num-layers", cfg["num_hidden_layers"], "--hidden-size", h,
             "--ffn-hidden-size", cfg["intermediate_size"], "--num-attention-heads", heads,
             "--kv-channels", head_dim, "--seq-length", seq_length or min(maxpos, 4096),
             "--max-position-embeddings", maxpos, "--position-embedding-type", "rope",
             "--rotary-base", int(theta), "--normalization", "RMSNorm",
             "--norm-epsilon", cfg.get("rms_norm_eps", 1e-6), "--swiglu",
             "--attention-dropout", cfg.get("attention_dropout", 0.0) or 0.0,
             "--hidden-dropout", 0.0, "--init-method-std", cfg.get("initializer_range", 0.02),
             "--vocab-size", cfg["vocab_size"],
             "--make-vocab-size-divisible-by", divisible_by, *rope_flags]
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", groups]
    if not cfg.get("attention_bias", False):
        flags.append("--disable-bias-linear")
    if not cfg.get("tie_word_embeddings", False):
        flags.append("--untie-embeddings-and-output-weights")
    return [str(x) for x in flags]


def _qwen3_flags(cfg, seq_length, divisible_by) -> list[str]:
    """Qwen3 is Llama with per-head q/k RMSNorms (--qk-layernorm) and no MLP biases."""
    if cfg.get("attention_bias", False):
        _refuse("attention_bias", True, "megaq has one bias switch for every linear layer "
                "and Qwen3's MLP has no biases")
    if cfg.get("use_sliding_window", False):
        _refuse("use_sliding_window", True, "megaq's attention is full causal attention")
    kinds = set(cfg.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        _refuse("layer_types", sorted(kinds), "megaq's attention is full causal attention")
    plain = {k: v for k, v in cfg.items() if k not in ("layer_types", "sliding_window")}
    return _llama_flags(plain, seq_length, divisible_by) + ["--qk-layernorm"]


def _gpt2_flags(cfg, seq_length, divisible_by) -> list[str]:
    act = cfg.get("activation_function", "gelu_new")
    if act != "gelu":
        _refuse("activation_function", act, "megaq's GPT-2 MLP uses exact (erf) GELU, "
                "activation_function 'gelu'; it has no tanh approximation")
    if cfg.get("scale_attn_by_inverse_layer_idx", False):
        _refuse("scale_attn_by_inverse_layer_idx", True, "megaq scales attention by 1/sqrt(d) only")
    if not cfg.get("scale_attn_weights", True):
        _refuse("scale_attn_weights", False, "megaq always scales attention by 1/sqrt(d)")
    if cfg.get("add_cross_attention", False):
        _refuse("add_cross_attention", True, "megaq is decoder-only")
    h, heads = cfg["n_embd"], cfg["n_head"]
    maxpos = int(cfg.get("n_positions", 1024))
    flags = ["--num-layers", cfg["n_layer"], "--hidden-size", h,
             "--ffn-hidden-size", cfg.get("n_inner") or 4 * h, "--num-attention-heads", heads,
             "--seq-length", seq_length or maxpos, "--max-position-embeddings", maxpos,
             "--norm-epsilon", cfg.get("layer_norm_epsilon", 1e-5),
             "--attention-dropout", cfg.get("attn_pdrop", 0.1),
             "--hidden-dropout", cfg.get("resid_pdrop", 0.1),
             "--init-method-std", cfg.get("initializer_range", 0.02),
             "--vocab-size", cfg["vocab_size"], "--make-vocab-size-divisible-by", divisible_by]
    if not cfg.get("tie_word_embeddings", True):
        flags.append("--untie-embeddings-and-output-weights")
    return [str(x) for x in flags]


def _imported_tokenizer(hf_dir: str, out_dir: str, vocab: int, log) -> tuple[list[str], dict]:
    """(tokenizer flags for megaq_args.txt, the data section naming the source's files)
    of a transformers directory: its SentencePiece tokenizer.model as
    GPTSentencePieceTokenizer (copied to CKPT/tokenizer.model), else its tokenizer.json
    as a HuggingFaceTokenizer (the copy in CKPT/iter_0000000/tokenizer/), when that
    tokenizer has the model's vocabulary; else none ([], {})."""
    out = os.path.abspath(out_dir)
    if os.path.isfile(os.path.join(hf_dir, export_files.TOKENIZER_MODEL)):
        source = {"tokenizer_type": "GPTSentencePieceTokenizer",
                  "tokenizer_model": os.path.join(hf_dir, export_files.TOKENIZER_MODEL)}
        return (["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                 os.path.join(out, export_files.TOKENIZER_MODEL)], source)
    if not os.path.isfile(os.path.join(hf_dir, export_files.TOKENIZER_JSON)):
        return [], {}
    from megaq.data.tokenizer import build_tokenizer
    try:
        size = build_tokenizer("HuggingFaceTokenizer", hf_dir).vocab_size
    except DataError as e:
        log(f" note: the tokenizer of {hf_dir} is not imported: {e}")
        return [], {}
    if size != vocab:
        log(f" note: the tokenizer of {hf_dir} is not imported: it has {size} ids, config.json's "
            f"vocab_size is {vocab}; pass the tokenizer flags for your data yourself")
        return [], {}
    copy = os.path.join(iteration_dir(out, 0), tokenizer_files.TOKENIZER_DIR)
    return (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", copy],
            {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": hf_dir})


def import_from_hf(hf_dir: str, out_dir: str, *, tp: int = 1,
                   pp: int = 1, vp: int = 1, seq_length: int | None = None,
                   make_vocab_size_divisible_by: int = 1, overwrite: bool = False,
                   log=print) -> dict:
    """Write a megaq checkpoint (iteration 0, zero AdamW moments) of a transformers model
    for a TP x PP (x VP) layout, plus megaq_args.txt / megaq_args.json: the flags that
    describe it; the checkpoint stores the RunConfig those flags give (megaq_run_config).
    Returns {"dir", "family", "flags", "load_flags"}."""
    check_output(out_dir, overwrite, hf_dir, writes="megaq")
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise InteropError(f"{hf_dir} has no config.json; pass a transformers model directory")
    hf_cfg = _read_json(cfg_path, "a model configuration")
    try:
        family, flags = flags_from_hf_config(hf_cfg, seq_length, make_vocab_size_divisible_by)
    except KeyError as e:  # a field every config.json of the family has
        raise InteropError(f"{cfg_path} has no field {e.args[0]!r}; the file is incomplete: "
                           f"download it again") from None
    except (TypeError, ValueError, AttributeError) as e:  # e.g. a number given as text
        raise InteropError(f"{cfg_path} has a field of the wrong type ({type(e).__name__}: {e}); "
                           f"fix the file or download it again") from None
    num_layers = int(flags[flags.index("--num-layers") + 1])
    if vp > 1 and num_layers % (pp * vp):
        raise InteropError(f"{num_layers} layers do not split into {pp} stages x {vp} virtual "
                           f"chunks; pick --virtual-pipeline-size dividing layers / PP")
    layout_flags = megaq_layout_flags(tp, pp, vp, num_layers)
    src = HFTensorSource(hf_dir)
    vocab = int(flags[flags.index("--vocab-size") + 1])
    tok_flags, tok_source = _imported_tokenizer(hf_dir, out_dir, vocab, log)
    run_config = megaq_run_config(flags + layout_flags + tok_flags, tp, pp)
    config = run_config.model
    padded = run_config.padded_vocab_size
    mapping = MAPPINGS[family](config, padded)
    if family == "gpt2" and not src.has(mapping.hf_name("embedding.word_embeddings.weight")) \
            and src.has("wte.weight"):  # original GPT-2 checkpoints: no "transformer." prefix
        mapping.layer_prefix, mapping.top = "h.", {k: v.replace("transformer.", "", 1)
                                                    for k, v in mapping.top.items()}
    layout = megaq_layout(config, tp, pp, vp)

    def get(name, shape):
        t = src.get(name)
        want = tuple(t.shape[0] if s is None else s for s in shape)
        if tuple(t.shape) != want:
            raise InteropError(f"{hf_dir}: tensor {name} has shape {tuple(t.shape)}, config.json "
                               f"implies {want}; the weights do not match the config")
        if not t.is_floating_point():
            raise InteropError(f"{hf_dir}: tensor {name} has dtype {t.dtype}, not floating point")
        return t.float()

    def full_tensor(info: ParamInfo) -> torch.Tensor:
        name = info.name
        if name == "output_layer.weight" and config.tie_embeddings:
            name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied pair
        t = mapping.from_hf(name, get)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if t.shape[0] != config.vocab_size:
                raise InteropError(f"{hf_dir}: {mapping.hf_name(name)} has {t.shape[0]} rows, "
                                   f"config.json vocab_size is {config.vocab_size}")
            t = fit_rows(t, 0, padded, name)  # TP padding rows: zero
        return t

    tmp = temp_dir_for(out_dir)
    try:
        write_megaq_checkpoint(tmp, run_config, layout, full_tensor,
                               extra={"imported_from": os.path.abspath(hf_dir), "family": family})
        unused = [n for n in src.names() if n not in src.used and not mapping.ignored_hf_name(n)
                  and not (config.tie_embeddings and n == mapping.hf_name("output_layer.weight"))]
        if unused:
            raise InteropError(f"{hf_dir}: tensor {unused[0]} (and {len(unused) - 1} more) has no "
                               f"megaq counterpart; the model has parts megaq lacks")
        if tok_source:  # the copy a run's save holds (data.tokenizer_files), hashed too
            it0 = iteration_dir(tmp, 0)
            tokenizer_files.copy_into(it0, tok_source, log=log)
            integrity.write_manifest(it0, integrity.read_manifest(it0)["files"])
            if tok_source["tokenizer_type"] != "HuggingFaceTokenizer":
                shutil.copyfile(tok_source["tokenizer_model"], os.path.join(tmp, "tokenizer.model"))
        all_flags = flags + layout_flags + tok_flags
        write_megaq_args(tmp, out_dir, all_flags, {"family": family,
                                                   "source": os.path.abspath(hf_dir)})
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"dir": out_dir, "family": family, "flags": all_flags,
            "load_flags": ["--load", out_dir, "--no-load-rng"]}
