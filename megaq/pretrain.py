"""The pretraining entry behind pretrain_gpt.py: Megatron-LM's flags, megaq's TP x PP x ZeRO(++).

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 12 --hidden-size 768 ...

parse flags -> RunConfig -> init torch.distributed -> topology -> data -> model chunks ->
ZeRO engine -> checkpoint load -> Trainer.train(). ``main(argv, topo=None)`` is callable
in-process (tests and tools pass the topology ``megaq.parallel.launch.run_on_ranks``
built); ``build_trainer(config, topo)`` stops before training, for callers that drive
the loop themselves.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time

import numpy as np
import torch


def seed_everything(seed: int, topo) -> None:
    """Megatron's seeding: seed + 100 * pp_rank for python / numpy / torch, and the TP
    RNG tracker's model-parallel stream (seed + 2718 + tp_rank) for TP-split dropout."""
    from megaq.parallel.tensor_parallel import model_parallel_manual_seed
    seed = seed + 100 * topo.pp_rank
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_manual_seed(seed, topo.tp_rank)


def _init_distributed(parallel):
    from megaq.parallel.launch import init_from_env
    from megaq.parallel.topology import Layout, build_topology, ranks_per_node_from_env
    rank, world = init_from_env(parallel.distributed_backend)
    rpn = ranks_per_node_from_env(world, rank, parallel.gpus_per_node)
    layout = Layout(world_size=world, tp=parallel.tp, pp=parallel.pp, ranks_per_node=rpn,
                    hpz_size=parallel.hpz_size, order=parallel.rank_order)
    return build_topology(layout, rank)


def _check_topology_matches(parallel, topo) -> None:
    from megaq.arguments import ArgumentsError
    lay, want = topo.layout, parallel.layout
    if lay != want:
        raise ArgumentsError(f"the given topology (TP={lay.tp}, PP={lay.pp}, hpZ={lay.hpz_size}, "
                             f"order {lay.order}, {lay.ranks_per_node} ranks per node) does not "
                             f"match the flags (TP={want.tp}, PP={want.pp}, hpZ={want.hpz_size}, "
                             f"order {want.order}, {want.ranks_per_node} ranks per node)")


def main(argv: list[str] | None = None, topo=None):
    """Train; returns the final TrainState. Raises ArgumentsError / CheckpointError /
    DataError / TrainingDiverged with one-line messages (the CLI prints them)."""
    from megaq.arguments import parse_config

    t_start = time.perf_counter()
    if topo is None:
        from megaq.parallel.topology import ranks_per_node_from_env
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        config = parse_config(argv, world_size=world,
                              ranks_per_node=ranks_per_node_from_env(world, rank))
        topo = _init_distributed(config.parallel)
    else:
        config = parse_config(argv, world_size=topo.layout.world_size,
                              ranks_per_node=topo.layout.ranks_per_node)
        _check_topology_matches(config.parallel, topo)
    return build_trainer(config, topo, t_start).train()


def build_trainer(config, topo, t_start: float | None = None):
    """Everything up to the first iteration: data, model, engine, checkpoint load.
    `config` is a megaq.config.RunConfig; `topo` this rank's Topology; `t_start` the
    perf_counter() the setup time printed counts from (default: now)."""
    from megaq import checkpoint as ckpt
    from megaq.data.setup import build_data
    from megaq.lr_schedule import LRSchedule
    from megaq.model import build_model_chunks
    from megaq.training import TrainingParts, Trainer, TrainState
    from megaq.zero import build_engine

    t_start = time.perf_counter() if t_start is None else t_start
    rank0 = topo.rank == 0
    if rank0:
        _print_banner(config, topo)
    t, log = config.training, config.logging
    seed_everything(t.seed, topo)
    n_evals = t.train_iters // log.eval_interval + 1 if log.eval_iters else 0
    data = build_data(config.data, topo, seq_length=config.model.seq_length, seed=t.seed,
                      global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                      num_samples=(t.train_iters * t.global_batch_size,
                                   n_evals * log.eval_iters * t.global_batch_size,
                                   log.eval_iters * t.global_batch_size))
    config = config.resolved(data.config, data.vocab_size)
    chunks = build_model_chunks(config.model, topo, config.virtual_pipeline_size)
    device = _device()
    chunks = [c.to(device) for c in chunks]
    engine = build_engine(chunks, topo, config.zero)
    schedule = LRSchedule.from_config(config.optimizer)
    state = TrainState()

    load = config.checkpointing.load
    if load:
        loaded = ckpt.load_checkpoint(load, config=config, topo=topo, engine=engine,
                                      lr_schedule=schedule, model_chunks=chunks,
                                      load_rng=not config.checkpointing.no_load_rng,
                                      load_optim=not config.checkpointing.no_load_optim)
        if loaded is None:
            if rank0:
                print(f" no checkpoint found in {load}: starting from scratch", flush=True)
        else:
            if loaded["consumed_samples"] % t.global_batch_size:
                raise ckpt.CheckpointError(
                    f"{loaded['path']} consumed {loaded['consumed_samples']} samples, not a multiple "
                    f"of --global-batch-size {t.global_batch_size}; resume with a global batch "
                    f"size dividing it (e.g. the checkpoint's {loaded['saved_global_batch_size']})")
            state.iteration = loaded["iteration"]
            state.consumed_samples = loaded["consumed_samples"]
            state.skipped_total = loaded["extra"].get("skipped_total", 0)
            state.nan_total = loaded["extra"].get("nan_total", 0)
            if rank0:
                print(f" loaded checkpoint {loaded['path']} at iteration {state.iteration} "
                      f"(consumed samples {state.consumed_samples})", flush=True)

    parts = TrainingParts(config=config, topo=topo, model_chunks=chunks, engine=engine,
                          lr_schedule=schedule, train_batches=data.train,
                          valid_batches=data.valid,
                          flops_per_iteration=flops_per_iteration(config),
                          zero_model_bytes=int(_zero_model_bytes(engine)))
    trainer = Trainer(parts, state)
    if rank0:
        print(f" setup (process groups, data, model, engine, checkpoint) took "
              f"{time.perf_counter() - t_start:.1f} s; training", flush=True)
    return trainer


def flops_per_iteration(config) -> float:
    """Model FLOPs of one global batch (megaq.model.flops; recomputation not counted)."""
    from megaq.model.flops import num_flops
    return float(num_flops(config.model, config.training.global_batch_size
                           * config.model.seq_length, config.parallel.tp))


def _device() -> torch.device:
    """CUDA when the process group runs on NCCL, else CPU (gloo: CPU ranks, even on a GPU host)."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _zero_model_bytes(engine) -> int:
    m = getattr(engine, "zero_model_bytes", 0)
    return m() if callable(m) else m


def _print_banner(config, topo) -> None:
    lay, z, t = topo.layout, config.zero, config.training
    zpp = [name for on, name in ((z.quantized_weights, "qwZ"),
                                 (z.hpz_partition_size > 1, f"hpZ({z.hpz_partition_size})"),
                                 (z.quantized_gradients, f"qgZ(int{z.grad_bits_intra})")) if on]
    print(f" megaq: world {lay.world_size} = TP {lay.tp} x PP {lay.pp} x DP {lay.dp} on "
          f"{lay.num_nodes} node(s) of {lay.ranks_per_node}; ZeRO stage {z.stage}"
          f"{' + ' + ' + '.join(zpp) if zpp else ''}; {'bf16' if t.bf16 else 'fp32'}; "
          f"global batch {t.global_batch_size} = micro {t.micro_batch_size} x DP {lay.dp} "
          f"x {t.num_micro_batches} micro-batches", flush=True)


def cli(argv=None) -> int:
    from megaq.arguments import ArgumentsError
    from megaq.checkpoint import CheckpointError
    from megaq.data.errors import DataError
    from megaq.parallel.pipeline import PipelineConfigError
    from megaq.parallel.topology import LayoutError
    from megaq.training import TrainingDiverged
    from megaq.zero import ZeroConfigError
    finished = False
    try:
        main(argv)
        finished = True
    except (ArgumentsError, CheckpointError, DataError, LayoutError, PipelineConfigError,
            TrainingDiverged, ZeroConfigError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        _shut_down_distributed(orderly=finished)
    return 0


def _shut_down_distributed(orderly: bool) -> None:
    """Tear the process groups down. After a finished run every rank first meets at a
    barrier, so no rank closes its sockets while a peer is still in the last collective
    (only after success: after an error the peers may never arrive)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    if orderly:
        dist.barrier()
    dist.destroy_process_group()


def exit_now(code: int):
    """Leave without Python's interpreter finalization.

    Finalization tears down the interpreter while C++ threads of torch (the autograd
    engine's, gloo's) can still try to take the GIL; that race aborted finished runs
    with SIGABRT, "terminate called without an active exception", after the last
    iteration and the teardown above: seen in CI and in 2 of ~36 local runs of the
    emulated two-node test (tests/test_emulated_cluster.py); 0 in 46 runs since.
    Everything megaq writes is closed by then (metrics file, TensorBoard writer,
    checkpoints renamed into place); torch.compile's worker pool is stopped first.
    """
    with contextlib.suppress(Exception):  # no pool started, or a torch without this helper
        from torch._inductor.async_compile import shutdown_compile_workers
        shutdown_compile_workers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
