"""Pipeline parallelism: stage split, p2p between stages, 1F1B and interleaved schedules.

Typical step on one rank::

    chunks, engine = megaq.parallelize.parallelize(config, topo, zero_config, vp_size=vp_size)
    forward_backward = get_forward_backward_func(topo.layout.pp, len(chunks))
    losses = forward_backward(chunks, microbatches, num_microbatches, topo,
                              tensor_shape=pipeline_tensor_shape(s, b, h, tp, sp))
    engine.finish_grad_sync()   # megaq.zero: sequence-parallel and tied-embedding grads too
    engine.step(lr)

See docs/PIPELINE.md.
"""

from megaq.parallel.pipeline.interleaved import forward_backward_pipelining_with_interleaving
from megaq.parallel.pipeline.p2p import PipelineP2P, StepTimer, pipeline_tensor_shape
from megaq.parallel.pipeline.schedules import (forward_backward_no_pipelining,
                                               forward_backward_pipelining_without_interleaving,
                                               masked_mean_loss)
from megaq.parallel.pipeline.split import (PipelineConfigError, build_stage_chunks,
                                           check_layer_split, check_num_microbatches,
                                           chunk_layer_range, num_microbatches_per_step,
                                           stage_layer_ranges, virtual_pipeline_size)


def get_forward_backward_func(pp_size: int, vp_size: int | None = 1):
    """The schedule for a layout: no pipelining, 1F1B, or interleaved 1F1B."""
    vp_size = vp_size or 1
    if vp_size > 1 and pp_size == 1:
        raise PipelineConfigError(
            "virtual pipeline stages need --pipeline-model-parallel-size > 1; "
            "drop --num-layers-per-virtual-pipeline-stage or raise the PP size")
    if pp_size == 1:
        return forward_backward_no_pipelining
    if vp_size == 1:
        return forward_backward_pipelining_without_interleaving
    return forward_backward_pipelining_with_interleaving


__all__ = [
    "PipelineConfigError", "PipelineP2P", "StepTimer",
    "build_stage_chunks", "check_layer_split", "check_num_microbatches", "chunk_layer_range",
    "forward_backward_no_pipelining", "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving", "get_forward_backward_func",
    "masked_mean_loss", "num_microbatches_per_step", "pipeline_tensor_shape",
    "stage_layer_ranges", "virtual_pipeline_size",
]
