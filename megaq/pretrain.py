"""The pretraining entry behind pretrain_gpt.py: Megatron-LM's flags, megaq's TP x PP x ZeRO(++).

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 12 --hidden-size 768 ...

parse flags -> RunConfig -> init torch.distributed -> topology -> data -> model chunks
and their ZeRO engine (megaq.parallelize) -> checkpoint load -> Trainer.train().
``main(argv, topo=None)`` is callable in-process (tests and tools pass the topology
``megaq.testing.ranks.run_on_ranks`` built); ``build_trainer(config, topo)`` stops
before training, for callers that drive the loop themselves.
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


def _init_distributed(config):
    """The process groups of the layout the flags gave (config.parallel.layout, built
    once from the launcher's world size and node map) and of hpZ's size."""
    from megaq.parallel.launch import group_timeout, init_from_env
    from megaq.parallel.topology import build_topology
    from megaq.runtime import peers
    parallel, layout = config.parallel, config.parallel.layout
    rank, world = init_from_env(parallel.distributed_backend,
                                parallel.distributed_timeout_minutes, parallel.device)
    peers.start(rank, world, layout.node_of)  # a lost rank can then be named (megaq.runtime.failure)
    return build_topology(layout, rank, hpz_size=config.zero.hpz_partition_size,
                          timeout=group_timeout(parallel.distributed_timeout_minutes))


def _check_topology_matches(config, topo) -> None:
    """main(argv, topo): the caller's topology must be the one the flags describe."""
    from megaq.config.arguments import ArgumentsError
    lay, want = topo.layout, config.parallel.layout
    hpz, want_hpz = topo.hpz.size, config.zero.hpz_partition_size
    if lay != want or hpz != want_hpz:
        raise ArgumentsError(f"the given topology (TP={lay.tp}, PP={lay.pp}, hpZ={hpz}, "
                             f"order {lay.order}, {lay.ranks_per_node} ranks per node) does not "
                             f"match the flags (TP={want.tp}, PP={want.pp}, hpZ={want_hpz}, "
                             f"order {want.order}, {want.ranks_per_node} ranks per node)")


def main(argv: list[str] | None = None, topo=None):
    """Train; returns the final TrainState. Raises ArgumentsError / CheckpointError /
    DataError / TrainingDiverged with one-line messages (the CLI prints them)."""
    from megaq.config.arguments import parse_config

    t_start = time.perf_counter()
    if topo is None:
        from megaq.parallel.launch import rank_env_from_slurm
        from megaq.parallel.topology import ranks_per_node_from_env
        rank_env_from_slurm()  # srun-started ranks (scripts/pretrain_slurm.sbatch)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        config = parse_config(argv, world_size=world,
                              ranks_per_node=ranks_per_node_from_env(world, rank),
                              print_notes=rank == 0)
        topo = _init_distributed(config)
    else:
        config = parse_config(argv, world_size=topo.layout.world_size,
                              ranks_per_node=topo.layout.ranks_per_node,
                              print_notes=topo.rank == 0)
        _check_topology_matches(config, topo)
    if topo.rank == 0:
        print_arguments(argv, config)
    if config.checkpointing.save_hf:  # refuse an architecture transformers lacks before training
        from megaq.interop.hf import model_family
        model_family(config.model)
    state = build_trainer(config, topo, t_start, hardware=_hardware_flags(argv)).train()
    if config.checkpointing.save_hf:
        save_hf(config.checkpointing, topo)
    return state


def print_arguments(argv, config) -> None:
    """Megatron's start-up arguments block: every megaq flag under its argparse name (the
    parsed value, default or given), the Megatron-LM flags megaq only notes, aliases or
    refuses when they were given (the hundreds not given would be noise), and the
    layout's world and data-parallel sizes."""
    from megaq.config.arguments import build_parser
    from megaq.config.megatron_flags import IMPLEMENTED, MEGATRON_FLAGS
    from megaq.runtime.logging_utils import arguments_block
    values = vars(build_parser().parse_args(argv))
    for f in MEGATRON_FLAGS:
        dest = f.name.lstrip("-").replace("-", "_")
        if f.kind != IMPLEMENTED and values.get(dest) in (None, False):
            values.pop(dest, None)
    values.update(world_size=config.parallel.world_size, data_parallel_size=config.parallel.dp,
                  # as run: given, set by a Megatron-LM spelling, or the default (the
                  # flag's own default is None, so that a given stage can be told apart)
                  zero_stage=config.zero.stage)
    print(arguments_block(values), flush=True)


def save_hf(checkpointing, topo) -> None:
    """--save-hf: rank 0 exports the final checkpoint under --save to transformers form
    (megaq.interop.hf, one process); the other ranks wait for it."""
    from megaq.interop.hf import export_to_hf
    from megaq.parallel import comm
    comm.barrier(topo.world)  # the final checkpoint is complete on disk
    if topo.rank == 0:
        out = export_to_hf(checkpointing.save, checkpointing.save_hf, overwrite=True)
        print(f" saved the final model in Hugging Face form to {out['dir']} ({out['family']}, "
              f"{out['bytes'] / 2**20:.1f} MiB)", flush=True)
    comm.barrier(topo.world)


def build_trainer(config, topo, t_start: float | None = None, hardware=None):
    """Everything up to the first iteration: data, model, engine, checkpoint load.
    `config` is a megaq.config.run.RunConfig; `topo` this rank's Topology; `t_start` the
    perf_counter() the setup time printed counts from (default: now); `hardware` the
    machine of the plan written into the metrics file (megaq.planner.run.HardwareFlags;
    without --gpu: the preset of the CUDA device it trains on, else H200)."""
    from megaq.runtime import failure
    from megaq.checkpoint import guard
    from megaq.checkpoint.errors import CheckpointError
    from megaq.checkpoint.load import load_checkpoint
    from megaq.data.setup import build_data
    from megaq.lr_schedule import LRSchedule
    from megaq.parallel import fp8_delayed
    from megaq.parallelize import parallelize
    from megaq.runtime.logging_utils import parameter_count_line
    from megaq.training import TrainingParts, Trainer, TrainState

    t_start = time.perf_counter() if t_start is None else t_start
    rank0 = topo.rank == 0
    if rank0:
        _print_banner(config, topo)
    t, log = config.training, config.logging
    seed_everything(config.model.seed, topo)
    n_evals = t.train_iters // log.eval_interval + 1 if log.eval_iters else 0
    data = build_data(config.data, topo, seq_length=config.model.seq_length, seed=config.model.seed,
                      global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                      # Megatron's sizes: --train-samples, or the steps' samples
                      num_samples=(t.train_samples or t.train_iters * t.global_batch_size,
                                   n_evals * log.eval_iters * t.global_batch_size,
                                   # one evaluation of the test split, at the end
                                   log.eval_iters * t.global_batch_size))
    config = config.resolved(data.config, data.vocab_size)
    chunks, engine = parallelize(config.model, topo, config.zero, optimizer=config.optimizer,
                                 vp_size=config.virtual_pipeline_size, device=_device(config.parallel))
    if topo.dp_rank == 0:  # Megatron: one line per (tensor, pipeline) rank
        print(parameter_count_line(topo.tp_rank, topo.pp_rank, engine.num_parameters()),
              flush=True)
    schedule = LRSchedule.from_config(config.optimizer, t.global_batch_size, t.schedule_unit)
    state = TrainState()

    save = config.checkpointing.save
    if save:  # one job per directory; stale .tmp saves removed (megaq.checkpoint.guard)
        guard.claim_save_directory(save, topo)
    source, finetune = checkpoint_source(config.checkpointing)
    if source:
        # every rank reads its own files; all agree before anyone exits (megaq.runtime.failure).
        # --finetune: weights only; iteration, samples, moments, schedule, RNG start fresh.
        with failure.agreed(topo.world):
            loaded = load_checkpoint(
                source, config=config, topo=topo, engine=engine,
                lr_schedule=None if finetune else schedule, model_chunks=chunks,
                load_rng=not (finetune or config.checkpointing.no_load_rng),
                load_optim=not (finetune or config.checkpointing.no_load_optim))
        if loaded is None:
            if rank0:
                print(f" no checkpoint found in {source}: starting from scratch", flush=True)
        elif finetune:
            if rank0:
                print(f" fine-tuning from the weights of {loaded['path']} (its iteration "
                      f"{loaded['iteration']}); iteration, consumed samples, optimizer state, "
                      f"LR schedule and RNG start fresh", flush=True)
        else:
            if loaded["consumed_samples"] % t.global_batch_size:
                raise CheckpointError(
                    f"{loaded['path']} consumed {loaded['consumed_samples']} samples, not a multiple "
                    f"of --global-batch-size {t.global_batch_size}; resume with a global batch "
                    f"size dividing it (e.g. the checkpoint's {loaded['saved_global_batch_size']})")
            state.iteration = loaded["iteration"]
            state.consumed_samples = loaded["consumed_samples"]
            state.skipped_total = loaded["extra"].get("skipped_total", 0)
            state.nan_total = loaded["extra"].get("nan_total", 0)
            note = fp8_delayed.restore(chunks, topo, loaded["extra"].get("fp8_amax"))
            if note and rank0:
                print(f" note: {note}", flush=True)
            if rank0:
                print(f" loaded checkpoint {loaded['path']} at iteration {state.iteration} "
                      f"(consumed samples {state.consumed_samples})", flush=True)
                _truncate_metrics(config.logging.metrics_file, state.iteration)

    parts = TrainingParts(config=config, topo=topo, model_chunks=chunks, engine=engine,
                          lr_schedule=schedule, train_batches=data.train,
                          valid_batches=data.valid, test_batches=data.test,
                          flops_per_iteration=flops_per_iteration(config),
                          zero_model_bytes=int(_zero_model_bytes(engine)),
                          plan=_plan_record(config, hardware) if rank0 else None)
    trainer = Trainer(parts, state)
    if rank0:
        print(f" setup (process groups, data, model, engine, checkpoint) took "
              f"{time.perf_counter() - t_start:.1f} s; training", flush=True)
    return trainer


def checkpoint_source(checkpointing) -> tuple[str | None, bool]:
    """(directory to load, as a fine-tuning start?) under Megatron-LM's rules: --load,
    resumed (or, with --finetune, its weights only); --pretrained-checkpoint DIR when
    --load holds no checkpoint yet (a fine-tuning job's first start; its requeued runs
    then resume from --load), as --finetune."""
    from megaq.checkpoint.errors import CheckpointError
    from megaq.checkpoint.paths import TRACKER_FILE, not_a_checkpoint_root, read_tracker
    from megaq.interop.megatron import load_refusal
    c = checkpointing
    # a path that is plainly something else (a file, one iteration, a Megatron-LM, HF or
    # DeepSpeed directory) is a mistake to name, not an empty directory to start fresh in
    for flag_name, path in (("--load", c.load), ("--pretrained-checkpoint", c.pretrained_checkpoint)):
        if not path:
            continue
        reason = not_a_checkpoint_root(path)
        if reason:
            raise CheckpointError(f"{flag_name} {reason}")
        reason = load_refusal(path)  # its line names the converter's command
        if reason:
            raise CheckpointError(reason)
    if c.pretrained_checkpoint and (not c.load or read_tracker(c.load) is None):
        if read_tracker(c.pretrained_checkpoint) is None:
            raise CheckpointError(
                f"--pretrained-checkpoint {c.pretrained_checkpoint} holds no checkpoint (no "
                f"{TRACKER_FILE}); name a megaq checkpoint directory (tools/"
                f"convert_checkpoint.py writes one from Megatron-LM or Hugging Face weights)")
        return c.pretrained_checkpoint, True
    if c.finetune and c.load and read_tracker(c.load) is None:
        raise CheckpointError(f"--finetune: {c.load} holds no checkpoint to start from (no "
                              f"{TRACKER_FILE}); name the pretrained checkpoint with "
                              f"--load, or use --pretrained-checkpoint DIR")
    return c.load, c.finetune


def _truncate_metrics(path: str | None, iteration: int) -> None:
    """A resumed run repeats the iterations after its checkpoint: drop their lines, left
    by the run that stopped, so the file (and its plots) keep one history."""
    from megaq.runtime.metrics import drop_records_after
    if path and os.path.isfile(path):
        dropped = drop_records_after(path, iteration)
        if dropped:
            print(f" metrics file {path}: removed {dropped} line(s) after iteration {iteration}, "
                  f"logged by the run that stopped before saving them", flush=True)


def _hardware_flags(argv):
    """The hardware flags of the command line (the plan's machine)."""
    from megaq.config.arguments import build_parser
    from megaq.config.flags import from_flags
    from megaq.planner.run import HardwareFlags
    return from_flags(HardwareFlags, build_parser().parse_args(argv))


def _plan_record(config, hardware) -> dict:
    """The plan for the machine this rank trains on: --gpu, else the CUDA device's preset."""
    from megaq.planner.run import HardwareFlags, plan_record
    dev = _device(config.parallel)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    return plan_record(config, (hardware or HardwareFlags()).on_device(name))


def dry_run(argv) -> int | None:
    """--dry-run: parse and check the flags, the data and tokenizer files and --load, and
    print this run's plan; returns the exit code (0: it fits; 2: a problem, each printed
    as one `error:` line, all of them at once, or a plan that does not fit) without
    starting a process group; None without --dry-run. argparse's own problems (an
    unknown flag, a bad value, a missing flag) are among the lines; without --dry-run
    the first of them stops the launch, as always. The world is --num-nodes x
    --gpus-per-node when given, else the launcher's."""
    from megaq.config.arguments import (build_parser, print_deepspeed_mapping, print_notes_once,
                                        run_problems)
    from megaq.parallel.topology import ranks_per_node_from_env
    from megaq.plan_cli import dry_run as print_plan
    from megaq.planner.hardware import DEFAULT_GPU, gpu_preset
    flags, problems = build_parser().parse_all(argv)
    if not (flags.dry_run if flags is not None else "--dry-run" in (argv or sys.argv[1:])):
        return None
    if flags is None:  # argparse could not go on: what it found
        return _print_problems(problems)
    if flags.num_nodes is not None:
        per_node = flags.gpus_per_node or gpu_preset(flags.gpu or DEFAULT_GPU).gpus_per_node
        world = flags.num_nodes * per_node
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        per_node = ranks_per_node_from_env(world, int(os.environ.get("RANK", "0")),
                                           flags.gpus_per_node)
    config, flags, problems, notes = run_problems(argv, world_size=world,
                                                  ranks_per_node=per_node, parse_all=True)
    problems += launch_file_problems(flags)
    print_deepspeed_mapping(flags)  # what a --deepspeed-config file was read as, refused or not
    if problems:
        return _print_problems(problems)
    print_notes_once(flags, notes)
    return print_plan(config, flags)


def _print_problems(problems: list[str]) -> int:
    """--dry-run's verdict on a bad launch: one `error:` line per problem; exit code 2."""
    for line in problems:
        print(f"error: {line}", file=sys.stderr, flush=True)
    return 2


def launch_file_problems(flags) -> list[str]:
    """What a launch would find wrong in its files, one line each, without reading more
    than their headers: data prefixes without .bin / .idx, tokenizer files that do not
    load, a --load / --pretrained-checkpoint that is not a megaq checkpoint or whose
    newest iteration's manifest is incomplete or lists a missing file or one of another
    size (the full SHA-256 check runs at load). `flags`: the parsed flags, so a problem
    is found even when the configuration did not build."""
    from megaq.checkpoint.errors import CheckpointError
    from megaq.data.blending import parse_data_path
    from megaq.data.errors import DataError
    from megaq.data.indexed import IndexedDataset
    from megaq.data.tokenizer import build_tokenizer, infer_tokenizer_type
    problems = []
    blends = [("--data-path", flags.data_path), ("--train-data-path", flags.train_data_path),
              ("--valid-data-path", flags.valid_data_path), ("--test-data-path",
                                                             flags.test_data_path)]
    for name, blend in blends:
        try:
            prefixes = parse_data_path(list(blend), name)[1] if blend else []
        except DataError:
            continue  # the configuration reported it
        problems += [f"{name} {p}: {p}.bin / {p}.idx not found; check the prefix "
                     f"(tools/preprocess_data.py writes them)" for p in prefixes
                     if not IndexedDataset.exists(p)]
    tokenizer_type = infer_tokenizer_type(flags.tokenizer_type, flags.tokenizer_model,
                                          flags.vocab_file, flags.merge_file)
    given = (flags.tokenizer_model, flags.vocab_file, flags.merge_file)  # none: the config said so
    if any(b for _, b in blends) and tokenizer_type != "NullTokenizer" and any(given):
        try:
            build_tokenizer(tokenizer_type, flags.tokenizer_model, flags.vocab_file,
                            flags.merge_file)
        except (DataError, OSError, ValueError) as e:
            problems.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    for name, path in (("--load", flags.load), ("--pretrained-checkpoint",
                                                flags.pretrained_checkpoint)):
        if path:
            try:
                _check_checkpoint_files(name, path, verify=not flags.no_verify_checkpoint)
            except CheckpointError as e:
                problems.append(str(e))
    return problems


def _check_checkpoint_files(flag_name: str, path: str, verify: bool) -> None:
    """CheckpointError when `path` is not a megaq checkpoint directory (nor an empty one
    to start in), or its newest iteration's files do not match the manifest's list."""
    from megaq.checkpoint.errors import CheckpointError
    from megaq.checkpoint.integrity import read_manifest
    from megaq.checkpoint.paths import iteration_dir, not_a_checkpoint_root, read_tracker
    from megaq.interop.megatron import load_refusal
    reason = not_a_checkpoint_root(path)
    if reason:
        raise CheckpointError(f"{flag_name} {reason}")
    reason = load_refusal(path)
    if reason:
        raise CheckpointError(reason)
    iteration = read_tracker(path)
    if iteration is None or not verify:
        return
    ckpt = iteration_dir(path, iteration)
    for rel, entry in sorted(read_manifest(ckpt)["files"].items()):
        if os.path.isabs(rel) or ".." in rel.split("/"):
            raise CheckpointError(f"{ckpt}'s manifest lists {rel}, outside the checkpoint; "
                                  f"it was altered after it was saved")
        file = os.path.join(ckpt, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing (the manifest lists it); the checkpoint "
                                  f"is incomplete")
        if os.path.getsize(file) != entry["bytes"]:
            raise CheckpointError(f"{file} is damaged: {os.path.getsize(file)} bytes, the "
                                  f"manifest expects {entry['bytes']}; restore the file or "
                                  f"load an earlier iteration")


def flops_per_iteration(config) -> float:
    """Model FLOPs of one global batch (megaq.model.flops; recomputation not counted)."""
    from megaq.model.flops import num_flops
    return float(num_flops(config.model, config.training.global_batch_size
                           * config.model.seq_length, config.parallel.tp))


def _device(parallel) -> torch.device:
    """CUDA when the process group runs on NCCL or --device cuda asks for it, else CPU
    (gloo: CPU ranks, even on a GPU host, unless --device cuda). --device cuda without a
    CUDA device is an error here too, not a quiet CPU run (launch.require_cuda, as the
    launch path for command-line runs; this covers ranks set up in-process)."""
    import torch.distributed as dist
    from megaq.parallel.launch import require_cuda
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    if parallel.device == "cuda":
        require_cuda()
    if nccl or parallel.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _zero_model_bytes(engine) -> int:
    m = getattr(engine, "zero_model_bytes", 0)
    return m() if callable(m) else m


def _backend_name() -> str:
    import torch.distributed as dist
    return dist.get_backend() if dist.is_initialized() else "none"


def _device_description(parallel) -> str:
    """What the ranks compute on, e.g. 'device cuda (NVIDIA H200)' or 'device cpu'."""
    dev = _device(parallel)
    if dev.type == "cuda":
        return f"device cuda ({torch.cuda.get_device_name(dev)})"
    return "device cpu"


def _print_banner(config, topo) -> None:
    lay, z, t = topo.layout, config.zero, config.training
    zpp = [name for on, name in ((z.quantized_weights, "qwZ"),
                                 (z.hpz_partition_size > 1, f"hpZ({z.hpz_partition_size})"),
                                 (z.weight_deltas, f"weight deltas(int{z.weight_delta_bits})"),
                                 (z.quantized_gradients, f"qgZ(int{z.grad_bits_intra})")) if on]
    print(f" megaq: {_device_description(config.parallel)}, backend {_backend_name()}; "
          f"world {lay.world_size} = TP {lay.tp} x PP {lay.pp} x DP {lay.dp} on "
          f"{lay.num_nodes} node(s) of {lay.ranks_per_node}; ZeRO stage {z.stage}"
          f"{' + ' + ' + '.join(zpp) if zpp else ''}; {'bf16' if t.bf16 else 'fp32'}; "
          f"global batch {t.global_batch_size} = micro {t.micro_batch_size} x DP {lay.dp} "
          f"x {t.num_micro_batches} micro-batches", flush=True)


def cli(argv=None) -> int:
    from megaq.runtime import failure
    from megaq.config.arguments import ArgumentsError
    from megaq.checkpoint import guard
    from megaq.checkpoint.errors import CheckpointError
    from megaq.data.errors import DataError
    from megaq.interop.errors import InteropError
    from megaq.runtime import peers
    from megaq.parallel.comm import CollectiveFailed
    from megaq.parallel.pipeline import PipelineConfigError
    from megaq.parallel.topology import LayoutError
    from megaq.planner.hardware import HardwareError
    from megaq.training import TrainingDiverged
    from megaq.zero import ZeroConfigError
    failure.install_sigterm_grace()  # a rank stopped by the launcher first names a lost peer
    code = 1  # an uncaught exception: its traceback, exit 1
    try:
        dry = dry_run(argv)
        if dry is None:
            main(argv)
        code = dry or 0
    except CollectiveFailed as e:  # a peer vanished: one line per survivor, no teardown
        code = failure.report_collective_failure(e, failure.current_rank_and_world()[0])
        guard.unlock_all()
        failure.exit_now(code)
    except (ArgumentsError, CheckpointError, DataError, LayoutError, PipelineConfigError,
            TrainingDiverged, ZeroConfigError, InteropError, failure.AgreedError,
            HardwareError) as e:
        code = 2
        failure.report(e, *failure.current_rank_and_world())  # every rank, at once (see there)
    except KeyboardInterrupt:
        code = 130
        failure.report(KeyboardInterrupt("interrupted (Ctrl-C); nothing saved since the last "
                                         "checkpoint (--exit-signal-handler saves on Ctrl-C)"),
                       *failure.current_rank_and_world())
    finally:
        if code != 0:  # the peers' roll call must not count this rank lost
            peers.mark_left(code)
        guard.unlock_all()
        _shut_down_distributed(orderly=code == 0)
    return code


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
