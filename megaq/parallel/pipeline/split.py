"""Which layers live where: stages, virtual chunks, and the checks that refuse bad splits.

Layers are split evenly over ``pp`` pipeline stages and, with interleaving, into ``vp``
virtual chunks per stage, assigned round-robin as Megatron does: with
``L = num_layers / (pp * vp)`` layers per chunk, chunk ``v`` of stage ``p`` holds the
global layers ``[(v*pp + p)*L, (v*pp + p + 1)*L)``. The word embedding lives on the first
chunk of stage 0, the final norm + output layer + loss on the last chunk of the last stage.

Every layout that does not divide is refused with one message naming the flag to change:
Megatron-derived codebases have been reported to silently drop the remainder layers.
"""

from __future__ import annotations


class PipelineConfigError(ValueError):
    """An impossible pipeline layout; the message names the problem and the fix."""


def virtual_pipeline_size(num_layers: int, pp: int,
                          num_layers_per_virtual_stage: int | None) -> int:
    """Chunks per stage (``vp``) from --num-layers-per-virtual-pipeline-stage (None -> 1)."""
    check_layer_split(num_layers, pp)
    if num_layers_per_virtual_stage is None:
        return 1
    if pp == 1:
        raise PipelineConfigError(
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 "
            "(interleaving splits each pipeline stage); drop the flag or raise the PP size")
    if num_layers_per_virtual_stage < 1:
        raise PipelineConfigError(
            f"--num-layers-per-virtual-pipeline-stage must be >= 1 "
            f"(got {num_layers_per_virtual_stage})")
    per_stage = num_layers // pp
    if per_stage % num_layers_per_virtual_stage:
        raise PipelineConfigError(
            f"--num-layers-per-virtual-pipeline-stage {num_layers_per_virtual_stage} does not "
            f"divide the {per_stage} layers per pipeline stage (--num-layers {num_layers} / "
            f"--pipeline-model-parallel-size {pp}); use a divisor of {per_stage}")
    return per_stage // num_layers_per_virtual_stage


def check_layer_split(num_layers: int, pp: int, vp: int = 1) -> None:
    if pp < 1 or vp < 1:
        raise PipelineConfigError(f"pipeline size and virtual chunks must be >= 1 "
                                  f"(got pp={pp}, vp={vp})")
    if vp > 1 and pp == 1:
        raise PipelineConfigError(
            "virtual pipeline stages need --pipeline-model-parallel-size > 1; "
            "drop --num-layers-per-virtual-pipeline-stage or raise the PP size")
    if num_layers % pp:
        raise PipelineConfigError(
            f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
            f"layers would be dropped: choose a PP size dividing {num_layers} or change the layers")
    if num_layers % (pp * vp):
        raise PipelineConfigError(
            f"--num-layers {num_layers} does not split into {pp} stages x {vp} virtual chunks; "
            f"choose --num-layers-per-virtual-pipeline-stage dividing {num_layers // pp}")


def chunk_layer_range(num_layers: int, pp: int, vp: int, stage: int, chunk: int) -> tuple[int, int]:
    """Global [start, end) layers of virtual chunk `chunk` on pipeline stage `stage`."""
    check_layer_split(num_layers, pp, vp)
    if not (0 <= stage < pp and 0 <= chunk < vp):
        raise PipelineConfigError(f"stage {stage} / chunk {chunk} outside pp={pp}, vp={vp}")
    per_chunk = num_layers // (pp * vp)
    start = (chunk * pp + stage) * per_chunk
    return start, start + per_chunk


def stage_layer_ranges(num_layers: int, pp: int, vp: int, stage: int) -> list[tuple[int, int]]:
    """The layer ranges of every chunk of one stage, in chunk order."""
    return [chunk_layer_range(num_layers, pp, vp, stage, v) for v in range(vp)]


def check_num_microbatches(num_microbatches: int, pp: int, vp: int) -> None:
    if num_microbatches < 1:
        raise PipelineConfigError(f"need at least one micro-batch per step (got {num_microbatches})")
    if vp > 1 and num_microbatches % pp:
        raise PipelineConfigError(
            f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) to "
            f"be a multiple of --pipeline-model-parallel-size {pp}; set --global-batch-size to a "
            f"multiple of micro-batch-size x DP x {pp}")


def num_microbatches_per_step(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """global_batch / (micro_batch x DP), refusing remainders (they would drop samples)."""
    per_step = micro_batch_size * dp
    if micro_batch_size < 1 or global_batch_size < 1 or global_batch_size % per_step:
        raise PipelineConfigError(
            f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size "
            f"{micro_batch_size} x data-parallel size {dp} = {per_step}; pick a multiple of {per_step}")
    return global_batch_size // per_step


def build_stage_chunks(make_chunk, num_layers: int, topo, vp_size: int | None = None) -> list:
    """This rank's model chunks, one per virtual stage, from a factory.

    ``make_chunk(layer_start, layer_end, pre_process, post_process)`` builds one chunk
    holding the global layers ``[layer_start, layer_end)``; ``pre_process`` marks the
    chunk that owns the input embedding, ``post_process`` the one that owns the output
    layer and loss. The split knows layers and stages, never the model class
    (megaq.parallelize builds GPTModel chunks with it, step 1 of its order).
    """
    pp, stage, vp = topo.layout.pp, topo.pp_rank, vp_size or 1
    return [make_chunk(start, end, stage == 0 and v == 0, stage == pp - 1 and v == vp - 1)
            for v, (start, end) in enumerate(stage_layer_ranges(num_layers, pp, vp, stage))]
