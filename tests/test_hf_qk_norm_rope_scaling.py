"""--qk-layernorm and --use-rope-scaling through the HF bridge (megaq/interop/hf.py).

megaq's Llama 3.1 inverse frequencies equal transformers' "llama3" rope init; a Qwen3
model (per-head q/k RMSNorms) and a Llama with llama3 rope scaling import into megaq
with transformers' logits at positions where the scaling matters, and export back
bit-identical with the same config; unsupported variants are refused in one line.
"""

import json
import os

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install the pins of "
                           "pyproject.toml's test extra)")

from data_fixtures import tool  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

transformers.utils.logging.disable_progress_bar()

from megaq.checkpoint import paths  # noqa: E402
from megaq.checkpoint.consolidate import load_consolidated_model  # noqa: E402
from megaq.interop.hf import InteropError, model_family  # noqa: E402
from megaq.model import GPTConfig  # noqa: E402
from megaq.model.layers import RotaryEmbedding  # noqa: E402

# theta 1e6 with head dim 8: wavelengths 6, 199, 6283 and 198,692 positions, so one
# frequency lies in llama3's smoothed band (2048..8192) and one is divided by the factor
THETA = 1_000_000
LLAMA3 = {"rope_type": "llama3", "rope_theta": float(THETA), "factor": 8.0,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _convert(argv, capsys=None):
    if capsys is not None:
        capsys.readouterr()
    rc = tool("convert_checkpoint").main([str(a) for a in argv])
    return rc, (capsys.readouterr().err if capsys is not None else "")


def _hf_model(path, kind):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters=dict(LLAMA3) if kind.endswith("scaled")
                  else {"rope_type": "default", "rope_theta": float(THETA)})
    if kind.startswith("qwen3"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
        with torch.no_grad():  # norms away from their all-ones init, so a mix-up shows
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.eval().save_pretrained(str(path))
    return model


def test_llama3_inverse_frequencies_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for factor, head_dim in ((8.0, 128), (32.0, 64)):
        cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                       rope_parameters={**LLAMA3, "factor": factor,
                                                        "rope_theta": 500000.0})
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        got = RotaryEmbedding(head_dim, 500000, rope_scaling_factor=factor).inv_freq
        plain = RotaryEmbedding(head_dim, 500000).inv_freq
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
        assert not torch.equal(got, plain)  # the scaling changed some frequencies


@pytest.mark.parametrize("kind", ["llama_scaled", "qwen3", "qwen3_scaled"])
def test_import_matches_transformers_and_round_trips(tmp_path, kind):
    hf = _hf_model(tmp_path / "hf", kind)
    rc, _ = _convert(["--from", "hf", "--to", "megaq", "--input", tmp_path / "hf",
                      "--output", tmp_path / "mq", "--tensor-model-parallel-size", "2",
                      "--seq-length", "16"])
    assert rc == 0
    flags = open(tmp_path / "mq" / "megaq_args.txt").read().split()
    assert ("--use-rope-scaling" in flags) == kind.endswith("scaled")
    assert ("--qk-layernorm" in flags) == kind.startswith("qwen3")

    # megaq's own forward (TP2 checkpoint consolidated) at positions far past 8192
    model, _ = load_consolidated_model(paths.iteration_dir(tmp_path / "mq", 0))
    ids = torch.arange(24).reshape(2, 12) % 96
    pos = torch.arange(20000, 20012).expand(2, 12)
    with torch.no_grad():
        ours = model.eval()(ids, position_ids=pos)[..., :96]
        theirs = hf(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    rc, _ = _convert(["--to", "hf", "--input", tmp_path / "mq", "--output", tmp_path / "back"])
    assert rc == 0
    a = load_file(str(tmp_path / "hf" / "model.safetensors"))
    b = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.load(open(tmp_path / "back" / "config.json"))
    assert cfg["model_type"] == ("qwen3" if kind.startswith("qwen3") else "llama")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids, position_ids=pos).logits, theirs)


@pytest.mark.parametrize("edit,expect", [
    ({"rope_parameters": {**LLAMA3, "low_freq_factor": 2.0}},
     "rope_parameters.low_freq_factor = 2.0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type = 'yarn'"),
    ({"attention_bias": True}, "field attention_bias = True"),
    ({"use_sliding_window": True}, "field use_sliding_window = True"),
])
def test_import_refusals(tmp_path, capsys, edit, expect):
    _hf_model(tmp_path / "hf", "qwen3")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.load(open(path)), **edit}))
    rc, err = _convert(["--from", "hf", "--to", "megaq", "--input", tmp_path / "hf",
                        "--output", tmp_path / "out"], capsys)
    assert rc == 2 and err.startswith("error:") and err.count("\n") == 1 and expect in err, err
    assert not os.path.exists(tmp_path / "out")


def test_export_families():
    llama = dict(num_layers=1, hidden_size=32, num_attention_heads=4)
    assert model_family(GPTConfig.llama(qk_layernorm=True, **llama)) == "qwen3"
    with pytest.raises(InteropError, match="Qwen3 .* has no MLP biases"):
        model_family(GPTConfig.llama(qk_layernorm=True, add_bias_linear=True, **llama))
    with pytest.raises(InteropError, match="--qk-layernorm exports as Qwen3"):
        model_family(GPTConfig(qk_layernorm=True, **llama))  # GPT-2 shaped
