"""The GPT model (GPT-2 and Llama families) built from tensor-parallel layers."""

from megaq.model.config import GPTConfig, ModelConfigError
from megaq.model.gpt import GPTModel
from megaq.parallel.pipeline.split import build_stage_chunks


def build_model_chunks(config: GPTConfig, topo, vp_size: int | None = None,
                       model_cls=GPTModel) -> list:
    """This rank's GPT chunks (one per virtual pipeline stage) over its layers.

    `model_cls` may be any class with GPTModel's constructor (config, tp_group,
    pre_process, post_process, layer_start, layer_end), e.g. a benchmark's stand-in.
    """
    def make_chunk(start, end, pre_process, post_process):
        return model_cls(config, topo.tp, pre_process=pre_process, post_process=post_process,
                         layer_start=start, layer_end=end)
    return build_stage_chunks(make_chunk, config.num_layers, topo, vp_size)


__all__ = ["GPTConfig", "GPTModel", "ModelConfigError", "build_model_chunks"]
