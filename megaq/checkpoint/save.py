"""Saving a checkpoint: the entry every caller uses, whatever the format."""

from __future__ import annotations

from megaq.checkpoint import formats, staging
from megaq.checkpoint.errors import NonFiniteWeights
from megaq.checkpoint.paths import latest_iteration


def save_checkpoint(root: str, iteration: int, *, config, topo, engine, lr_schedule,
                    consumed_samples: int, extra: dict | None = None,
                    save_optim: bool = True) -> str:
    """Collective over every rank. Returns the final directory. Writes the format of
    --ckpt-format (megaq.checkpoint.formats). save_optim=False (--no-save-optim)
    leaves out the optimizer state: weights, RNG streams, the LR schedule and the
    position only (such a checkpoint loads with --no-load-optim or --finetune)."""
    staging.wait_for_async_save()  # a background save in flight commits first, whatever happens here
    refuse_non_finite_weights(root, iteration, engine)  # before anything is staged or written
    return formats.named(config.checkpointing.ckpt_format).save(
        root, iteration, config=config, topo=topo, engine=engine, lr_schedule=lr_schedule,
        consumed_samples=consumed_samples, extra=extra, save_optim=save_optim)


def refuse_non_finite_weights(root: str, iteration: int, engine) -> None:
    """Collective: raise NonFiniteWeights on every rank when any fp32 master weight of any
    shard is inf or nan, so that `latest` never moves onto weights that cannot train on.
    One all-reduce of one number after a pass over this rank's shard (what the save
    writes, read once more: small next to writing it)."""
    if engine.params_finite():
        return
    latest = latest_iteration(root)
    if latest is not None:
        keep = (f"the previous checkpoint (iteration {latest}) stays latest; resume from it with "
                f"a lower --lr (plus --override-opt_param-scheduler) or a smaller --weight-decay")
    else:
        keep = "no checkpoint was written; start again with a lower --lr or --weight-decay"
    raise NonFiniteWeights(f"refusing to save iteration {iteration} to {root}: the weights hold "
                           f"inf or nan (an update overflowed them); {keep}")
