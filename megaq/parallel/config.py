"""ParallelConfig: how the ranks are laid out (pretrain_gpt.py's parallelism flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megaq.config.flags import flag, set_derived, switch
from megaq.parallel.topology import Layout, LayoutError


@dataclass(frozen=True)
class ParallelConfig:
    FLAG_GROUP: ClassVar[str] = "parallelism"

    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size",
                                           "TP: ranks splitting each layer", 1, type=int)
    pipeline_model_parallel_size: int = flag("--pipeline-model-parallel-size",
                                             "PP: pipeline stages", 1, type=int)
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        "--num-layers-per-virtual-pipeline-stage", "interleaved 1F1B: layers per model chunk",
        type=int)
    gpus_per_node: int | None = flag(
        "--gpus-per-node", "ranks per node for the node map (default: from torchrun/slurm); a "
        "smaller value makes one machine pose as several nodes", type=int)
    use_tp_pp_dp_mapping: bool = switch(
        "--use-tp-pp-dp-mapping", "rank order TP fastest, then PP, then DP (Megatron's flag); "
        "the default order puts DP before PP, which keeps a pipeline stage's DP groups on as "
        "few nodes as possible")
    distributed_backend: str | None = flag("--distributed-backend",
                                           "default: nccl with CUDA, else gloo",
                                           choices=["nccl", "gloo"])
    device: str | None = flag(
        "--device", "what the ranks compute on (default: cuda with NCCL, else cpu; `--device "
        "cpu` alone picks gloo); with "
        "--distributed-backend gloo, `--device cuda` keeps tensors on the GPUs and carries the "
        "collectives through host memory, so several ranks may share one GPU (the emulated "
        "cluster's GPU mode, docs/CLUSTER_EMULATION.md)", choices=["cuda", "cpu"])
    distributed_timeout_minutes: float = flag(
        "--distributed-timeout-minutes", "a collective waiting this long for a peer fails the "
        "job (every process group; fractions allowed)", 10, type=float)
    # ---- from the launcher, not from these flags ----
    world_size: int = 1
    ranks_per_node: int | None = None  # the launcher's; --gpus-per-node overrides it
    layout: Layout | None = None       # derived: the validated rank grid

    def __post_init__(self):
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise LayoutError(f"--gpus-per-node must be >= 1 (got {self.gpus_per_node})")
        if self.distributed_backend == "nccl" and self.device == "cpu":
            raise LayoutError("--distributed-backend nccl needs --device cuda: NCCL moves GPU "
                              "memory only (use --distributed-backend gloo for CPU ranks)")
        if not self.distributed_timeout_minutes > 0:
            raise LayoutError(f"--distributed-timeout-minutes must be > 0 minutes "
                              f"(got {self.distributed_timeout_minutes})")
        layout = Layout(world_size=self.world_size, tp=self.tensor_model_parallel_size,
                        pp=self.pipeline_model_parallel_size,
                        ranks_per_node=self.gpus_per_node or self.ranks_per_node,
                        order=self.rank_order)
        set_derived(self, layout=layout)

    @property
    def rank_order(self) -> str:
        """The topology's rank order named by --use-tp-pp-dp-mapping."""
        return "tp-pp-dp" if self.use_tp_pp_dp_mapping else "tp-dp-pp"

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def dp(self) -> int:
        return self.layout.dp
