"""Pretrain a GPT / Llama-style model: Megatron-LM's flags, megaq's TP x PP x ZeRO(++).

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 12 --hidden-size 768 ...

Thin entry: parse args -> init torch.distributed -> topology -> model chunks -> data ->
ZeRO engine -> checkpoint load -> train(). ``main(argv, topo=None)`` is callable
in-process: tests pass the topology that ``megaq.parallel.launch.run_on_ranks`` built.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys

import numpy as np
import torch


def model_config(args):
    from megaq.model import GPTConfig
    return GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
        seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu, add_bias_linear=not args.disable_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        sequence_parallel=args.sequence_parallel,
        recompute_activations=args.recompute_activations,
        compile_blocks=args.compile_blocks, attention_repeat_kv=args.attention_repeat_kv,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32, seed=args.seed)


def zero_config(args):
    from megaq.zero import ZeroConfig
    kw = dict(stage=args.zero_stage,
              gather_dtype=torch.bfloat16 if args.bf16 else torch.float32,
              lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
              weight_decay=args.weight_decay,
              quantized_weights=args.zero_quantized_weights,
              hpz_partition_size=args.zero_hpz_partition_size,
              quantized_gradients=args.zero_quantized_gradients,
              grad_bits_intra=args.zero_quantized_gradients_intra_bits or args.zero_quantized_gradients_bits,
              grad_bits_inter=args.zero_quantized_gradients_bits,
              error_feedback=args.zero_gradient_error_feedback,
              grad_exact_own_rows=not args.zero_quantized_gradients_quantize_own_rows)
    if args.zero_quantization_block_size:
        kw["block_size"] = args.zero_quantization_block_size
    if args.zero_quantized_gradients_chunk:
        kw["grad_chunk"] = args.zero_quantized_gradients_chunk
    return ZeroConfig(**kw)


def seed_everything(args, topo) -> None:
    """Megatron's seeding: seed + 100 * pp_rank for python / numpy / torch, and the TP
    RNG tracker's model-parallel stream (seed + 2718 + tp_rank) for TP-split dropout."""
    from megaq.parallel.tensor_parallel import model_parallel_manual_seed
    seed = args.seed + 100 * topo.pp_rank
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_manual_seed(seed, topo.tp_rank)


def _init_distributed(args):
    from megaq.arguments import rank_order
    from megaq.parallel.launch import init_from_env
    from megaq.parallel.topology import Layout, build_topology, ranks_per_node_from_env
    rank, world = init_from_env(args.distributed_backend)
    rpn = ranks_per_node_from_env(world, rank, args.gpus_per_node)
    layout = Layout(world_size=world, tp=args.tensor_model_parallel_size,
                    pp=args.pipeline_model_parallel_size, ranks_per_node=rpn,
                    hpz_size=args.zero_hpz_partition_size, order=rank_order(args))
    return build_topology(layout, rank)


def _check_topology_matches(args, topo) -> None:
    from megaq.arguments import ArgumentsError, rank_order
    lay = topo.layout
    want = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.zero_hpz_partition_size, rank_order(args))
    if (lay.tp, lay.pp, lay.hpz_size, lay.order) != want or (
            args.gpus_per_node and args.gpus_per_node != lay.ranks_per_node):
        raise ArgumentsError(f"the given topology (TP={lay.tp}, PP={lay.pp}, hpZ={lay.hpz_size}, "
                             f"order {lay.order}, {lay.ranks_per_node} ranks per node) does not "
                             f"match the flags (TP, PP, hpZ, order = {want}, --gpus-per-node "
                             f"{args.gpus_per_node})")


def main(argv: list[str] | None = None, topo=None, hooks: dict | None = None):
    """Train; returns the final TrainState. Raises ArgumentsError / CheckpointError /
    DataError / TrainingDiverged with one-line messages (the CLI prints them)."""
    import time
    from megaq.arguments import parse_args

    t_start = time.perf_counter()
    if topo is None:
        from megaq.parallel.topology import ranks_per_node_from_env
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        args = parse_args(argv, world_size=world,
                          ranks_per_node=ranks_per_node_from_env(world, rank))
        topo = _init_distributed(args)
    else:
        args = parse_args(argv, world_size=topo.layout.world_size,
                          ranks_per_node=topo.layout.ranks_per_node)
        _check_topology_matches(args, topo)
    for k, v in (hooks or {}).items():  # test-only injections (e.g. a checkpoint fault)
        setattr(args, k, v)
    rank0 = topo.rank == 0
    if rank0:
        _print_banner(args, topo)

    from megaq import checkpoint as ckpt
    from megaq.lr_schedule import LRSchedule
    from megaq.parallel.pipeline import build_model_chunks
    from megaq.training import TrainingParts, Trainer, TrainState
    from megaq.zero import build_engine

    seed_everything(args, topo)
    data = build_data(args, topo)  # sets args.vocab_size / args.padded_vocab_size
    config = model_config(args)
    chunks = build_model_chunks(config, topo, args.virtual_pipeline_model_parallel_size)
    device = _device()
    chunks = [c.to(device) for c in chunks]
    engine = build_engine(chunks, topo, zero_config(args))
    schedule = LRSchedule.from_args(args)
    state = TrainState()

    if args.load:
        loaded = ckpt.load_checkpoint(args.load, args=args, topo=topo, engine=engine,
                                      lr_schedule=schedule, model_chunks=chunks,
                                      load_rng=not args.no_load_rng,
                                      load_optim=not args.no_load_optim)
        if loaded is None:
            if rank0:
                print(f" no checkpoint found in {args.load}: starting from scratch", flush=True)
        else:
            if loaded["consumed_samples"] % args.global_batch_size:
                raise ckpt.CheckpointError(
                    f"{loaded['path']} consumed {loaded['consumed_samples']} samples, not a multiple "
                    f"of --global-batch-size {args.global_batch_size}; resume with a global batch "
                    f"size dividing it (e.g. the checkpoint's {loaded['args_global_batch_size']})")
            state.iteration = loaded["iteration"]
            state.consumed_samples = loaded["consumed_samples"]
            state.skipped_total = loaded["extra"].get("skipped_total", 0)
            state.nan_total = loaded["extra"].get("nan_total", 0)
            if rank0:
                print(f" loaded checkpoint {loaded['path']} at iteration {state.iteration} "
                      f"(consumed samples {state.consumed_samples})", flush=True)

    parts = TrainingParts(args=args, topo=topo, model_chunks=chunks, engine=engine,
                          lr_schedule=schedule, train_batches=data.train,
                          valid_batches=data.valid,
                          flops_per_iteration=flops_per_iteration(config, args),
                          zero_model_bytes=int(_zero_model_bytes(engine)))
    trainer = Trainer(parts, state)
    if rank0:
        print(f" setup (process groups, data, model, engine, checkpoint) took "
              f"{time.perf_counter() - t_start:.1f} s; training", flush=True)
    return trainer.train()


class Data:
    """train(consumed) / valid(consumed) -> BatchIterator (one list of micro-batches per step)."""

    def __init__(self, train, valid):
        self.train, self.valid = train, valid


def build_data(args, topo) -> Data:
    """Tokenizer + train/valid datasets + this rank's batch iterators.

    Sets args.vocab_size (tokenizer's, or --vocab-size for mock data) and
    args.padded_vocab_size. Index caches are built by global rank 0 while the others
    wait at a barrier, then every rank memory-maps them.
    """
    from megaq.data.builtin import default_cache_dir, ensure_builtin_corpus
    from megaq.data.gpt_dataset import build_train_valid_test_datasets
    from megaq.data.iterator import BatchIterator
    from megaq.data.tokenizer import build_tokenizer
    from megaq.parallel import comm
    from megaq.parallel.tensor_parallel import pad_vocab_size

    eod = None
    if args.demo_corpus is not None:
        prefix, model = ensure_builtin_corpus(args.demo_corpus or None)
        args.data_path, args.tokenizer_model = [prefix], model
        args.tokenizer_type = "SentencePieceTokenizer"
    if args.mock_data or args.tokenizer_type == "NullTokenizer":
        args.vocab_size = args.vocab_size or 1024
    else:
        tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        args.vocab_size, eod = tok.vocab_size, tok.eod
    args.padded_vocab_size = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                            args.tensor_model_parallel_size)
    gbs = args.global_batch_size
    n_evals = args.train_iters // args.eval_interval + 1 if args.eval_iters else 0
    num_samples = (args.train_iters * gbs, n_evals * args.eval_iters * gbs,
                   args.eval_iters * gbs)
    cache = args.data_cache_path or os.path.join(default_cache_dir(), "indices")
    train_ds, valid_ds, _ = build_train_valid_test_datasets(
        args.data_path, args.split, args.seq_length, args.seed, num_samples, cache,
        mock=args.mock_data, vocab_size=args.vocab_size, build=topo.rank == 0,
        barrier=lambda: comm.barrier(topo.world))
    needs_data = topo.is_first_stage or topo.is_last_stage

    def iterator(ds):
        if ds is None:
            return None
        return lambda consumed: BatchIterator(ds, gbs, args.micro_batch_size, topo.dp_rank,
                                              topo.layout.dp, consumed_samples=consumed,
                                              needs_data=needs_data, eod=eod)
    return Data(iterator(train_ds), iterator(valid_ds))


def flops_per_iteration(config, args) -> float:
    """Model FLOPs of one global batch (megaq.model.flops; recomputation not counted)."""
    from megaq.model.flops import num_flops
    return float(num_flops(config, args.global_batch_size * args.seq_length,
                           args.tensor_model_parallel_size))


def _device() -> torch.device:
    """CUDA when the process group runs on NCCL, else CPU (gloo: CPU ranks, even on a GPU host)."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _zero_model_bytes(engine) -> int:
    m = getattr(engine, "zero_model_bytes", 0)
    return m() if callable(m) else m


def _print_banner(args, topo) -> None:
    lay = topo.layout
    zpp = [name for on, name in ((args.zero_quantized_weights, "qwZ"),
                                 (args.zero_hpz_partition_size > 1,
                                  f"hpZ({args.zero_hpz_partition_size})"),
                                 (args.zero_quantized_gradients,
                                  f"qgZ(int{args.zero_quantized_gradients_bits})")) if on]
    print(f" megaq: world {lay.world_size} = TP {lay.tp} x PP {lay.pp} x DP {lay.dp} on "
          f"{lay.num_nodes} node(s) of {lay.ranks_per_node}; ZeRO stage {args.zero_stage}"
          f"{' + ' + ' + '.join(zpp) if zpp else ''}; {'bf16' if args.bf16 else 'fp32'}; "
          f"global batch {args.global_batch_size} = micro {args.micro_batch_size} x DP {lay.dp} "
          f"x {args.num_micro_batches} micro-batches", flush=True)


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


def _exit_now(code: int):
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


if __name__ == "__main__":
    _exit_now(cli())
