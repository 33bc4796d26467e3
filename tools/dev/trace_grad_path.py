"""Walk a gradient's path through megaq and count its bounces (docs/ARCHITECTURE.md,
"The gradient path").

One training step of a tiny GPT (pretrain's Trainer, mock data, one micro-batch) on 4
gloo ranks posing as 2 nodes x 2, ZeRO-3 + qgZ (DP 4 = 2 nodes x 2 ranks), after one
untraced warm-up step. On rank 0, sys.setprofile records every call into megaq/ and
kernels/ from the first post-accumulate-grad hook to the return of the engine's
``step``. Work that autograd starts for other reasons inside that window (the model's
backward, the weight gathers of earlier layers) is left out: a call that the autograd
engine makes into megaq is followed only when it is a parameter's gradient hook or the
end-of-backward callback. A kernel is one stop, its entry in kernels/ (what it calls
inside kernels/ is the kernel's own and depends on the backend: the torch reference
here, Triton on a GPU); --kernel-internals follows those calls too.

The calls collapse to *stops*, each function once, in the order of its first call. A
*return* is a stop in another file than the stop before it, in a file seen before.

    python -m tools.dev.trace_grad_path            # stops, files, returns
    python -m tools.dev.trace_grad_path --stops    # and every stop, in order
"""

import argparse
import contextlib
import io
import os
import sys
import tempfile

ENGINE = os.path.join("megaq", "zero", "engine.py")
ROOTS = {(ENGINE, "_weak_hook.<locals>.hook"), (ENGINE, "ZeroEngine._end_backward")}
START, END = (ENGINE, "_weak_hook.<locals>.hook"), (ENGINE, "ZeroEngine.step")
AUTOGRAD_RUN = os.path.join("torch", "autograd", "graph.py")  # _engine_run_backward


class Tracer:
    """The sys.setprofile callback: the (file, function) of each call on the path."""

    def __init__(self, repo: str, kernel_internals: bool):
        self.repo, self.kernel_internals = repo + os.sep, kernel_internals
        self.calls: list[tuple[str, str]] = []
        self.started = self.done = False
        self.skipped = None  # a frame autograd called for other work: ignored until it returns

    def _ours(self, frame):
        path = frame.f_code.co_filename
        if path.startswith(self.repo):
            rel = path[len(self.repo):]
            served = os.path.join("megaq", "kernels") + os.sep  # the link to kernels/
            if rel.startswith(served):
                rel = rel[len("megaq" + os.sep):]
            if rel.startswith(("megaq" + os.sep, "kernels" + os.sep)):
                return rel
        return None

    def _from_autograd(self, frame) -> bool:
        """Called by the autograd engine (not by megaq code through torch's wrappers)?"""
        f = frame.f_back
        while f is not None and self._ours(f) is None:
            if f.f_code.co_filename.endswith(AUTOGRAD_RUN):
                return True
            f = f.f_back
        return False

    def __call__(self, frame, event, arg):
        if self.done or event not in ("call", "return"):
            return
        if self.skipped is not None:
            if event == "return" and frame is self.skipped:
                self.skipped = None
            return
        rel = self._ours(frame)
        if rel is None:
            return
        stop = (rel, frame.f_code.co_qualname)
        if event == "return":
            self.done = self.started and stop == END
            return
        if not self.started:
            if stop != START:
                return
            self.started = True
        elif (stop not in ROOTS and self._from_autograd(frame)) or (
                not self.kernel_internals and rel.startswith("kernels")
                and (self._ours(frame.f_back) or "").startswith("kernels")):
            self.skipped = frame
            return
        self.calls.append(stop)


def _rank(topo, argv, kernel_internals):
    import torch

    from megaq import pretrain
    from megaq.config.arguments import parse_config

    torch.set_num_threads(1)
    with contextlib.redirect_stdout(io.StringIO()):
        config = parse_config(argv, world_size=topo.layout.world_size,
                              ranks_per_node=topo.layout.ranks_per_node)
        trainer = pretrain.build_trainer(config, topo)
    batches = trainer.p.train_batches(0)
    trainer.train_step(next(batches))  # warm-up: lazy imports and first-use setup
    tracer = Tracer(os.path.dirname(os.path.dirname(os.path.abspath(pretrain.__file__))),
                    kernel_internals)
    if topo.rank == 0:
        sys.setprofile(tracer)
    try:
        trainer.train_step(next(batches))
    finally:
        sys.setprofile(None)
    return tracer.calls


def walk(calls: list[tuple[str, str]]) -> tuple[list[tuple[str, str, bool]], list[str]]:
    """The stops (first calls, in order) as (file, function, is a return), and the files."""
    stops, seen, prev = [], set(), None
    for path, fn in dict.fromkeys(calls):
        stops.append((path, fn, path != prev and path in seen))
        seen.add(path)
        prev = path
    return stops, sorted(seen)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stops", action="store_true", help="print every stop, in order")
    p.add_argument("--kernel-internals", action="store_true",
                   help="follow the calls a kernel makes inside kernels/ too")
    args = p.parse_args(argv)
    if sys.version_info < (3, 11):
        sys.exit("error: this tool names functions by code.co_qualname: run it on Python 3.11 or later")
    from megaq.testing.ranks import run_on_ranks

    with tempfile.TemporaryDirectory() as tmp:
        train = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                 "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
                 "--train-iters", "2", "--lr", "1e-2", "--mock-data", "--vocab-size", "64",
                 "--eval-iters", "0", "--data-cache-path", os.path.join(tmp, "cache"),
                 "--zero-stage", "3", "--zero-quantized-gradients",
                 "--zero-quantization-block-size", "64"]
        calls = run_on_ranks(_rank, 4, ranks_per_node=2, args=(train, args.kernel_internals))[0]
    stops, files = walk(calls)
    if not stops:
        sys.exit("error: no gradient hook ran in the traced step (nothing to walk)")
    if args.stops:
        for i, (path, fn, back) in enumerate(stops, 1):
            print(f"{i:4d}  {path}:{fn}{'  <- return' if back else ''}")
    returns = sum(back for _, _, back in stops)
    print(f"{len(stops)} stops in {len(files)} files, {returns} returns to a file already visited")
    print("files: " + " ".join(files))


if __name__ == "__main__":
    main()
