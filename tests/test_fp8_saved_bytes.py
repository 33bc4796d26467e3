"""What a transformer block keeps for backward: with FP8 GEMMs, and attention's v
(megaq.testing.saved_bytes, the CPU proxy of a GPU step's activation memory;
tools/dev/saved_bytes.py prints it for bench_train's sizes).

The budget, per block, for the tensorwise and delayed recipes:

* compiled (inductor's partitioner, bench_train's -comp variants): no more than bf16
  keeps, no FP8 copy of a weight, and at most one FP8 copy of one GEMM input (the
  attention output's transposed copy: the partitioner does not see that the SDPA output
  it keeps for attention's backward already holds what it would recompute it from);
* eager: no more than bf16 keeps, no FP8 copy of a weight (backward casts the parameter
  again), one FP8 copy of each GEMM input and no bf16 one.

Byte counts, not tolerances: the counts are exact for a given graph; a change in what is
kept moves them by whole tensors (h or more bytes per token).
"""

import pytest
import torch

from megaq.model import GPTConfig
from megaq.testing.saved_bytes import block_saved_bytes

H, HEADS, SEQ, MB = 64, 4, 32, 2
TOKENS = SEQ * MB
FP8_RECIPES = [("hybrid", "tensorwise"), ("hybrid", "delayed")]


def _config(**kw):
    return GPTConfig.llama(num_layers=1, hidden_size=H, num_attention_heads=HEADS, vocab_size=64,
                           seq_length=SEQ, params_dtype=torch.bfloat16, **kw)


def _fp8_bytes(counted) -> int:
    return sum(n for name, n in counted.by_dtype.items() if name.startswith("float8"))


@pytest.fixture(scope="module")
def bf16_kept():
    return {compiled: block_saved_bytes(_config(), compiled=compiled, micro_batch=MB)
            for compiled in (False, True)}


@pytest.mark.slow  # torch.compile on the CPU
@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=lambda r: r[1])
def test_compiled_fp8_block_keeps_no_more_than_bf16_and_no_fp8_weights(bf16_kept, recipe):
    cfg = _config(fp8_format=recipe[0], fp8_recipe=recipe[1])
    counted = block_saved_bytes(cfg, compiled=True, micro_batch=MB)
    assert counted.total <= bf16_kept[True].total, (counted.by_dtype, bf16_kept[True].by_dtype)
    assert _fp8_bytes(counted) <= TOKENS * H, counted.by_dtype  # one [tokens, h] FP8 copy at most


@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=lambda r: r[1])
def test_eager_fp8_block_keeps_one_fp8_copy_of_each_gemm_input_and_no_weight_copy(bf16_kept, recipe):
    cfg = _config(fp8_format=recipe[0], fp8_recipe=recipe[1])
    counted = block_saved_bytes(cfg, compiled=False, micro_batch=MB)
    gemm_inputs = TOKENS * (3 * H + cfg.ffn_hidden_size)  # QKV, proj, fc1, fc2: 1 byte each
    assert counted.total <= bf16_kept[False].total, (counted.by_dtype, bf16_kept[False].by_dtype)
    assert _fp8_bytes(counted) == gemm_inputs, counted.by_dtype


@pytest.mark.slow  # the fixture compiles a block on the CPU
def test_attention_keeps_v_and_not_the_whole_qkv_output(bf16_kept):
    """SDPA keeps v for backward; as a slice of the QKV GEMM's output it kept that whole
    buffer (3x v's bytes here, MHA). No kept storage has the QKV output's size."""
    qkv_bytes = TOKENS * 3 * H * 2  # bf16
    for compiled, counted in bf16_kept.items():
        sizes = [n for n, _ in counted.storages.values()]
        assert qkv_bytes not in sizes, (compiled, sorted(sizes))
