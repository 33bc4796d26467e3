"""The training loop: steps, evaluation, log lines, metrics, checkpoints.

One step = the pipeline schedule over the step's micro-batches (gradient accumulation:
global batch / (micro batch x DP) of them; no pipelining when PP = 1) + the engine's
grad sync, clipping and optimizer update. Host synchronisation: none per micro-batch;
one per iteration (a small all-reduce of the step's loss, whose finiteness and the
grad norm's decide in the engine's step whether the update is applied, on every rank
alike); the comm counters are gathered once per logged iteration.

Early exit (Megatron's flags): --exit-interval N, --exit-duration-in-mins M, and
--exit-signal-handler (SIGTERM / SIGUSR1 on any rank); the stop vote rides on the
per-iteration loss all-reduce, so all ranks stop after the same iteration, save a
checkpoint (with --save) and return normally.

A non-finite loss or grad norm skips the update (the LR schedule does not advance)
and is counted; ``--max-consecutive-skipped-iters`` in a row stop the run with a
:class:`TrainingDiverged` error.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

import torch

from megaq.runtime import failure, watchdog
from megaq.checkpoint import staging
from megaq.runtime.logging_utils import (TensorBoard, Timers, WandB, memory_report_line,
                                 memory_stats, perplexity, timers_block, training_log_line,
                                 validation_log_line)
from megaq.runtime.profiling import StepProfiler
from megaq.runtime.metrics import MetricsFileError, MetricsWriter, SetAside, comm_per_node_per_iteration
from megaq.parallel import comm, fp8_delayed
from megaq.parallel.pipeline import get_forward_backward_func, pipeline_tensor_shape
from megaq.parallel.pipeline.p2p import StepTimer
from megaq.planner.run import comparison_line


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite iterations."""

    agreed = True  # every rank raises it at the same iteration (the loss is all-reduced)


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_total: int = 0
    nan_total: int = 0
    consecutive_bad: int = 0
    losses: dict = field(default_factory=dict)       # iteration -> lm loss (every iteration)
    grad_norms: dict = field(default_factory=dict)
    val_losses: dict = field(default_factory=dict)   # iteration -> validation loss
    test_loss: float | None = None                   # the end-of-training test-set loss
    exit_reason: str | None = None                   # set when stopped before --train-iters


@dataclass
class TrainingParts:
    """What the loop drives; built by megaq.pretrain.build_trainer."""

    config: object  # megaq.config.run.RunConfig
    topo: object
    model_chunks: list
    engine: object
    lr_schedule: object
    # callable(consumed_samples) -> iterator yielding, per step, this rank's list of
    # micro-batch dicts (megaq.data.iterator.BatchIterator); valid may be None
    train_batches: object
    valid_batches: object = None
    test_batches: object = None  # as valid_batches; evaluated once at the end
    flops_per_iteration: float = 0.0  # model FLOPs of one global batch (no recompute)
    zero_model_bytes: int = 0
    # the planner's prediction for this run ({"type": "plan", ...}: megaq.planner.run),
    # written first into the metrics file and compared with the measured step at the end
    plan: dict | None = None


class Trainer:
    def __init__(self, parts: TrainingParts, state: TrainState | None = None):
        self.p = parts
        self.config, self.topo = parts.config, parts.topo
        self.state = state or TrainState()
        c = self.config
        # the settings the loop reads all the time
        self.training, self.logging = c.training, c.logging
        vp = len(parts.model_chunks)
        self.forward_backward = get_forward_backward_func(self.topo.layout.pp, vp)
        self.tensor_shape = pipeline_tensor_shape(c.model.seq_length, c.training.micro_batch_size,
                                                  c.model.hidden_size, self.topo.layout.tp,
                                                  c.model.sequence_parallel)
        self.rank0 = self.topo.rank == 0
        # rank 0 opens the file; a path it cannot write stops every rank with its line
        with failure.agreed(self.topo.world, catch=(MetricsFileError,)):
            self.metrics = MetricsWriter(c.logging.metrics_file, enabled=self.rank0)
        if parts.plan:
            self.metrics.write(parts.plan)
        self.measured_step_s: float | None = None  # the last logged interval's step time
        self.tb = TensorBoard(c.logging.tensorboard_dir, enabled=self.rank0)
        log = c.logging
        self.wandb = WandB(log.wandb_project, log.wandb_exp_name,
                           log.wandb_save_dir or os.path.join(c.checkpointing.save or ".",
                                                              "wandb"),
                           config=c.to_dict(), enabled=self.rank0,
                           log=lambda line: print(line, flush=True))
        self.device = next(parts.model_chunks[0].parameters()).device
        self.timers = Timers(log.timing_log_level, self.device)
        self.profiler = StepProfiler(log, self.topo.rank, self.device,
                                     log.tensorboard_dir or "profile")
        # reduce the loss over the ranks that hold it: last stage, all TP x DP ranks
        self._loss_divisor = self.topo.layout.tp * self.topo.layout.dp
        self._t_start = time.time()
        self._signal_received: str | None = None
        self._stop_agreed = False

    # ------------------------------------------------------------------ one step
    def _on_device(self, batches: list) -> list:
        """The iterator yields CPU tensors; copy them to the model's device (async)."""
        if self.device.type == "cpu":
            return batches
        return [None if mb is None else
                {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                 for k, v in mb.items()} for mb in batches]

    def _loss_tokens(self, batches: list) -> torch.Tensor:
        """This rank's loss tokens in `batches` (fp64; 0 off the last pipeline stage)."""
        n = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.topo.is_last_stage:
            for mb in batches:
                n = n + mb["loss_mask"].to(self.device, torch.float64).sum()
        return n

    def _run_schedule(self, batches, forward_only: bool, token_loss_scale=None) -> torch.Tensor:
        t = self.training
        batches = self._on_device(batches)
        if token_loss_scale is None and t.calculate_per_token_loss and not forward_only \
                and self.topo.is_last_stage:
            # --calculate-per-token-loss: each micro-batch's loss is its token sum x
            # m x DP / (loss tokens of the global batch), so that the engine's DP average of
            # the accumulated grads is the gradient of the global batch's token mean (the
            # last stage's DP group holds the whole global batch; no host sync)
            tokens = self._loss_tokens(batches)
            comm.all_reduce(tokens, self.topo.dp, "dp_misc")
            token_loss_scale = t.num_micro_batches * self.topo.layout.dp / tokens.clamp(min=1.0)
        # --timing-log-level 2: the schedule's own clock splits compute from p2p waits
        step_timer = (StepTimer(sync=self.timers.sync)
                      if self.timers.on(2) and not forward_only else None)
        losses = self.forward_backward(
            self.p.model_chunks, batches, t.num_micro_batches, self.topo,
            tensor_shape=self.tensor_shape, dtype=t.params_dtype, forward_only=forward_only,
            timer=step_timer, token_loss_scale=token_loss_scale)
        if step_timer is not None:
            self.timers.add("forward-compute", step_timer.forward_s, 2)
            self.timers.add("backward-compute", step_timer.backward_s, 2)
            if self.topo.layout.pp > 1:
                self.timers.add("pipeline-p2p", step_timer.p2p_s, 2)
        if losses:
            return torch.stack(losses).float().sum().double()
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def _global_mean(self, local_sum: torch.Tensor, micro_batches: int,
                     local_tokens: torch.Tensor | None = None) -> float:
        """Mean micro-batch loss over the global batch, on every rank (one host sync); with
        local_tokens, local_sum is a token sum and the mean is over the tokens.

        The same all-reduce carries this rank's "please stop" vote (a signal arrived, or
        --exit-duration-in-mins passed), so every rank agrees on stopping for free."""
        dev = local_sum.device
        tokens = (torch.zeros((), dtype=torch.float64, device=dev) if local_tokens is None
                  else local_tokens.reshape(()).double())
        t = torch.stack([local_sum.reshape(()).double(),
                         torch.tensor(float(self._stop_vote()), dtype=torch.float64, device=dev),
                         tokens])
        comm.all_reduce(t, self.topo.world, "dp_misc")
        loss_sum, votes, all_tokens = t.tolist()
        self._stop_agreed = self._stop_agreed or votes > 0
        if local_tokens is not None:  # TP copies count in both sums alike
            return loss_sum / max(all_tokens, 1.0)
        return loss_sum / (self._loss_divisor * micro_batches)

    def _stop_vote(self) -> bool:
        minutes = self.training.exit_duration_in_mins
        if self._signal_received is not None:
            return True
        return bool(minutes and time.time() - self._t_start > minutes * 60)

    def _install_signal_handler(self) -> dict:
        """--exit-signal-handler's handlers, for the length of train(); returns the ones
        they replace, which train() puts back (a program that trains in-process, a
        notebook, keeps its own Ctrl-C and SIGTERM afterwards)."""
        def handler(signum, frame):  # noqa: ARG001 - signal API
            if signum == signal.SIGINT and self._signal_received is not None:
                failure.exit_now(130, f"[rank {self.topo.rank}] error: interrupted again "
                                      f"(second Ctrl-C): exiting at once, without saving")
            self._signal_received = signal.Signals(signum).name
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
        return previous

    def train_step(self, batches) -> tuple[float, float, bool]:
        """Returns (loss, grad_norm, applied)."""
        engine, timers = self.p.engine, self.timers
        engine.zero_grad()
        timers.start("forward-backward")
        loss_sum = self._run_schedule(batches, forward_only=False)
        timers.stop("forward-backward")
        timers.start("all-grads-sync")
        engine.finish_grad_sync()
        timers.stop("all-grads-sync")
        timers.start("optimizer")
        timers.start("optimizer-clip-main-grad", 2)
        engine.clip_grad_norm(self.config.optimizer.clip_grad)  # queued: no host sync
        timers.stop("optimizer-clip-main-grad", 2)
        timers.stop("optimizer")
        loss = self._global_mean(loss_sum, self.training.num_micro_batches)  # the one host sync
        timers.start("optimizer")
        timers.start("optimizer-inner-step", 2)
        # the update, or none when the loss or the grad norm is not finite (every rank
        # alike: both are global); then the engine's post-step hooks (FP8 histories)
        result = engine.step(self.p.lr_schedule.get_lr(), loss=loss)
        timers.stop("optimizer-inner-step", 2)
        timers.stop("optimizer")
        if not result.skipped:
            self.p.lr_schedule.step()
        return loss, result.grad_norm, not result.skipped

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, iteration: int, where: str = "", final: bool = False) -> float | None:
        t, log, vb = self.training, self.logging, self.p.valid_batches
        if vb is None or log.eval_iters == 0:
            return None
        # Each evaluation reads the next eval_iters global batches of the validation
        # split (as Megatron's persistent validation iterator), a pure function of the
        # number of evaluations so far, so resumed runs see the same batches. The final
        # evaluation (end of training, off the interval) reads the batches after those.
        n_evals = iteration // log.eval_interval + (1 if final else 0)
        start = max(0, n_evals - 1) * log.eval_iters * t.global_batch_size
        loss = self._eval_loss(vb(start))
        self.state.val_losses[iteration] = loss
        self._print_eval(iteration, loss, where)
        self.metrics.write({"type": "validation", "iteration": iteration, "val_loss": loss,
                            "val_ppl": perplexity(loss)})
        self._scalars({"lm loss validation": loss, "lm loss validation ppl": perplexity(loss)},
                      iteration)
        return loss

    def evaluate_test(self, iteration: int) -> float | None:
        """Megatron's end-of-training evaluation on the test split: eval_iters global
        batches from its start, printed "on test set" and written to the metrics file
        (type "test"); kept out of the validation scalars so their curve stays the
        validation split's. None without a test split or with --eval-iters 0."""
        if self.p.test_batches is None or self.logging.eval_iters == 0:
            return None
        loss = self._eval_loss(self.p.test_batches(0))
        self._print_eval(iteration, loss, "on test set")
        self.metrics.write({"type": "test", "iteration": iteration, "test_loss": loss,
                            "test_ppl": perplexity(loss)})
        return loss

    def _eval_loss(self, it) -> float:
        """The mean loss of the next eval_iters global batches of `it`, forward only,
        dropout off; its traffic is not charged to the training steps."""
        t, log = self.training, self.logging
        with SetAside(), torch.no_grad():
            for c in self.p.model_chunks:
                c.eval()
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            # --calculate-per-token-loss: token sums, divided by the tokens of all the
            # evaluation's batches (as Megatron's evaluate)
            per_token = t.calculate_per_token_loss
            tokens = torch.zeros((), dtype=torch.float64, device=self.device) if per_token \
                else None
            for _ in range(log.eval_iters):
                batches = next(it)
                if per_token:
                    tokens = tokens + self._loss_tokens(batches)
                total = total + self._run_schedule(batches, forward_only=True,
                                                   token_loss_scale=1.0 if per_token else None)
            for c in self.p.model_chunks:
                c.train()
            return self._global_mean(total, t.num_micro_batches * log.eval_iters, tokens)

    def _print_eval(self, iteration: int, loss: float, where: str) -> None:
        if self.rank0:
            line = validation_log_line(iteration, loss, where)
            bar = "-" * (len(line) + 1)
            print(f"{bar}\n{line}\n{bar}", flush=True)

    # ---------------------------------------------------------------- checkpoint
    def save(self) -> None:
        # imported here: the checkpoint formats import torch.distributed.checkpoint (half
        # a second), which the CLI's --help and refusals, importing this module for its
        # errors, do not need
        from megaq.checkpoint.save import save_checkpoint

        s = self.state
        with SetAside():
            t0 = time.perf_counter()
            path = save_checkpoint(
                self.config.checkpointing.save, s.iteration, config=self.config, topo=self.topo,
                engine=self.p.engine, lr_schedule=self.p.lr_schedule,
                consumed_samples=s.consumed_samples,
                extra={"skipped_total": s.skipped_total, "nan_total": s.nan_total,
                       "fp8_amax": fp8_delayed.checkpoint_extra(self.p.model_chunks, self.topo)},
                save_optim=not self.config.checkpointing.no_save_optim)
        if self.rank0:
            ms = (time.perf_counter() - t0) * 1000
            if staging.async_save_in_flight():
                print(f" checkpoint at iteration {s.iteration:7d} staged in {ms:.0f} ms; writing "
                      f"{path} in the background (--async-save)", flush=True)
            else:
                print(f" saved checkpoint at iteration {s.iteration:7d} to {path} "
                      f"({ms:.0f} ms)", flush=True)

    def wait_for_async_save(self) -> None:
        """The end of the run: a background save (--async-save) is written and committed."""
        t0 = time.perf_counter()
        iteration = staging.wait_for_async_save()
        if iteration is not None and self.rank0:
            print(f" background checkpoint at iteration {iteration:7d} committed (waited "
                  f"{(time.perf_counter() - t0) * 1000:.0f} ms)", flush=True)

    # ---------------------------------------------------------------------- loop
    def train(self) -> TrainState:
        self.topo.comm_timing.on = self.logging.log_comm_time  # this run's, never the next one's
        watchdog.start(self.topo.rank, self.training.hang_timeout_minutes)
        previous = self._install_signal_handler() if self.training.exit_signal_handler else {}
        try:
            return self._train_loop()
        except comm.CollectiveFailed as e:  # a peer vanished: say when (megaq.runtime.failure)
            e.iteration = self.state.iteration
            raise
        finally:
            watchdog.stop()
            self.topo.comm_timing.on = False
            for sig, handler in previous.items():  # None: one not set from Python
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def _save_if_healthy(self) -> bool:
        """Save unless the last iteration was skipped (non-finite): a save that falls in
        a streak of skipped iterations waits for the next good one, so `latest` never
        names weights that no longer give a finite loss. True when it saved."""
        if self.state.consecutive_bad:
            if self.rank0:
                print(f" checkpoint at iteration {self.state.iteration} postponed: "
                      f"{self.state.consecutive_bad} iteration(s) in a row skipped (non-finite "
                      f"loss or grad norm); saving after the next finite one", flush=True)
            return False
        self.save()
        return True

    def _train_loop(self) -> TrainState:
        t, log, s = self.training, self.logging, self.state
        save_dir, save_interval = self.config.checkpointing.save, self.config.checkpointing.save_interval
        batches = self.p.train_batches(s.consumed_samples) if s.iteration < t.train_iters else None
        interval = {"t0": time.perf_counter(), "iters": 0, "loss": 0.0, "counted": 0,
                    "skipped": 0, "nan": 0}
        comm.STATS.reset()
        last_saved = s.iteration
        save_postponed = False
        # Megatron's memory report: at the logged iterations until one past the first
        # after the start (so it includes the optimizer state the first step allocates)
        report_memory, first_iteration = True, s.iteration + 1
        while s.iteration < t.train_iters:
            lr = self.p.lr_schedule.get_lr()
            self.timers.start("batch-generator", 2)
            step_batches = next(batches)
            self.timers.stop("batch-generator", 2)
            self.profiler.before_step(s.iteration)
            loss, grad_norm, applied = self.train_step(step_batches)
            s.iteration += 1
            self.profiler.after_step(s.iteration)
            s.consumed_samples += t.global_batch_size
            s.losses[s.iteration] = loss
            s.grad_norms[s.iteration] = grad_norm
            watchdog.beat(s.iteration)
            interval["iters"] += 1
            if applied:
                s.consecutive_bad = 0
                interval["loss"] += loss
                interval["counted"] += 1
            else:
                s.consecutive_bad += 1
                s.skipped_total += 1
                s.nan_total += 1
                interval["skipped"] += 1
                interval["nan"] += 1
                if s.consecutive_bad >= t.max_consecutive_skipped_iters:
                    raise TrainingDiverged(
                        f"stopping at iteration {s.iteration}: {s.consecutive_bad} iterations in a "
                        f"row had a non-finite loss or gradient norm (last loss {loss}, grad norm "
                        f"{grad_norm}); lower --lr, check the data, or raise "
                        f"--max-consecutive-skipped-iters")

            reason = self._exit_reason()
            if s.iteration % log.log_interval == 0 or s.iteration == t.train_iters or reason:
                self._log(interval, lr, grad_norm)
                if report_memory:
                    self._report_memory()
                    report_memory = s.iteration <= first_iteration
                interval.update(t0=time.perf_counter(), iters=0, loss=0.0, counted=0,
                                skipped=0, nan=0)
            t_aside = time.perf_counter()  # evaluation and saving are not training time
            if log.eval_iters and s.iteration % log.eval_interval == 0:
                self.evaluate(s.iteration)
            if save_postponed or (save_dir and save_interval and s.iteration % save_interval == 0):
                save_postponed = not self._save_if_healthy()
                last_saved = s.iteration if not save_postponed else last_saved
            interval["t0"] += time.perf_counter() - t_aside
            if reason:
                if save_dir and s.iteration != last_saved and self._save_if_healthy():
                    last_saved = s.iteration
                if self.rank0:
                    print(f" exiting program at iteration {s.iteration}: {reason}", flush=True)
                s.exit_reason = reason
                break
        if save_dir and s.iteration != last_saved and s.iteration > 0:
            self._save_if_healthy()
        self.wait_for_async_save()
        if log.eval_iters and s.iteration not in s.val_losses and s.exit_reason is None:
            self.evaluate(s.iteration, where="on validation set", final=True)
        if s.exit_reason is None:  # Megatron: the test set after the last validation
            s.test_loss = self.evaluate_test(s.iteration)
        self.metrics.close()
        self.tb.close()
        self.wandb.close()
        if self.rank0 and self.p.plan:
            peak = memory_stats(self.device)["peak"] if self.device.type == "cuda" else None
            print(comparison_line(self.p.plan, self.measured_step_s, peak), flush=True)
        return s

    def _exit_reason(self) -> str | None:
        t, s = self.training, self.state
        if t.exit_interval and s.iteration % t.exit_interval == 0:
            return f"--exit-interval {t.exit_interval}"
        if self._stop_agreed:
            return ("a rank received a signal (--exit-signal-handler) or --exit-duration-in-mins "
                    f"{t.exit_duration_in_mins} passed")
        return None

    def _report_memory(self) -> None:
        """Megatron's report_memory line, from each rank of DP rank 0 (one per TP and
        PP rank); nothing off CUDA."""
        line = memory_report_line(self.topo.rank, self.state.iteration, self.device)
        if line is not None and self.topo.dp_rank == 0:
            print(line, flush=True)

    def _log(self, interval: dict, lr: float, grad_norm: float) -> None:
        t, s, topo, log = self.training, self.state, self.topo, self.logging
        iters = interval["iters"]
        elapsed = time.perf_counter() - interval["t0"]
        comm_bytes = comm_per_node_per_iteration(topo.world, iters)  # collective
        comm_ms = None
        if topo.comm_timing.on:
            comm_ms = {p: sec * 1000.0 / iters for p, sec in comm.mean_seconds(topo.world).items()}
        comm.STATS.reset()
        # optional collectives, on every rank: the params norm (one all-reduce), and one
        # gather of every rank's timers and memory
        params_norm = float(self.p.engine.params_norm()) if log.log_params_norm else None
        memory = memory_stats(self.device) if log.log_memory_to_tensorboard else None
        per_rank = None
        if self.timers.level or memory is not None:
            per_rank = comm.all_gather_objects(topo.world, {
                "timers": self.timers.take(), "peak": memory and memory["peak"]})
        elapsed_ms = elapsed * 1000.0 / iters
        tflops = self.p.flops_per_iteration / (elapsed_ms / 1000.0) / topo.layout.world_size / 1e12
        tokens_per_s = t.global_batch_size * self.config.model.seq_length * iters / elapsed
        loss = interval["loss"] / interval["counted"] if interval["counted"] else float("nan")
        self.measured_step_s = elapsed_ms / 1000.0
        if not self.rank0:
            return
        print(training_log_line(
            iteration=s.iteration, train_iters=t.train_iters, consumed_samples=s.consumed_samples,
            elapsed_ms=elapsed_ms, lr=lr, global_batch_size=t.global_batch_size, lm_loss=loss,
            loss_scale=1.0, grad_norm=grad_norm, skipped=interval["skipped"],
            nan=interval["nan"], tflops_per_gpu=tflops if log.log_throughput else None,
            tokens_per_s_per_gpu=(tokens_per_s / topo.layout.world_size
                                  if log.log_throughput else None),
            params_norm=params_norm), flush=True)
        block = self.timers.level and timers_block([r["timers"] for r in per_rank], iters)
        if block:
            print(block, flush=True)
        if comm_ms is not None:
            print(" communication time per iteration (ms, mean over ranks, collectives run "
                  "synchronously): " + " | ".join(f"{p}: {ms:.2f}" for p, ms in comm_ms.items()),
                  flush=True)
        record = {
            "type": "train", "iteration": s.iteration, "consumed_samples": s.consumed_samples,
            "lm_loss": loss, "lr": lr, "grad_norm": grad_norm, "elapsed_ms": elapsed_ms,
            "tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops,
            "skipped_iterations": interval["skipped"], "nan_iterations": interval["nan"],
            "comm": comm_bytes, "zero_model_bytes": self.p.zero_model_bytes,
            "nodes": topo.layout.num_nodes, "world_size": topo.layout.world_size,
            "tp": topo.layout.tp, "pp": topo.layout.pp, "dp": topo.layout.dp,
        }
        if comm_ms is not None:
            record["comm_time_ms"] = comm_ms
        if params_norm is not None:
            record["params_norm"] = params_norm
        if memory is not None:
            record["peak_memory_bytes"] = [r["peak"] for r in per_rank]
        self.metrics.write(record)
        # Megatron's tags ("throughput": TFLOP/s per GPU), then megaq's own
        # (tokens-per-second, comm-time-ms/<phase>, zero-memory-bytes/<part>)
        scalars = {"learning-rate": lr, "batch-size": t.global_batch_size, "lm loss": loss,
                   "loss-scale": 1.0, "grad-norm": grad_norm,
                   "iteration-time": elapsed_ms / 1000.0, "throughput": tflops,
                   "tokens-per-second": tokens_per_s,
                   **{f"comm-time-ms/{p}": ms for p, ms in (comm_ms or {}).items()}}
        if params_norm is not None:
            scalars["params-norm"] = params_norm
        if memory is not None:  # Megatron's names (this rank's), and the engine's bytes
            scalars.update({k: v for k, v in memory.items() if k != "peak"})
            scalars.update({f"zero-memory-bytes/{k}": v
                            for k, v in self.p.engine.memory_report().items()})
        self._scalars(scalars, s.iteration)

    def _scalars(self, values: dict, iteration: int) -> None:
        """The same scalars to TensorBoard and wandb (each a no-op when not asked for);
        TensorBoard also gets Megatron's "vs samples" twins (wandb, as Megatron, not)."""
        self.tb.scalars(values, iteration, samples=self.state.consumed_samples)
        self.wandb.scalars(values, iteration)
