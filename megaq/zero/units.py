"""Split model chunks into sites (where hooks fire) and units (what is gathered).

A *site* is a run of modules executed together in forward: per chunk, the
embedding; each transformer layer; the head (final_norm + output_layer). A *unit*
is a set of parameters gathered and released together, with one sharded
:class:`FlatPartition` (and a replicated one for parameters below the persistence
threshold; under stage 0 everything is replicated; under stages 1 and 2 the sharded
partition keeps its gathered weights resident). Each unit is *owned* by the site
whose modules hold its parameters; a site may also *borrow* another site's unit:

* tied embeddings on one stage (PP = 1): the head's output layer reads the word
  embedding weight, so the head site borrows the embedding unit;
* tied embeddings over stages (PP > 1): the ``shared_embedding`` weight is a unit of
  its own on the first and the last stage (owned by the embedding site and the head
  site respectively), so both stages shard it identically and the fp32 gradient
  shards can be all-reduced over ``topo.embedding`` element for element.

Parameters of a chunk that no site covers (none in GPTModel) become a replicated
partition of the chunk's first site, so they are never released.

With FP8 weight gathers (``ZeroConfig.fp8_weights``) the weights of the FP8 GEMM
layers in a unit's sharded partition are gathered in E4M3; under stage 0 they are held
in E4M3 only (megaq.zero.fp8_resident). Either way each such layer is pointed at its
weight's E4M3 view and scale (:func:`_bind_fp8_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megaq.parallel.fp8 import fp8_gemm_layers, use_fp8_weight
from megaq.zero.config import ZeroConfig, check_fp8_weight_gathers, fp8_weights_kept_in_e4m3
from megaq.zero.partition import FlatPartition


@dataclass(eq=False)
class Unit:
    name: str
    parts: list[FlatPartition]  # at most one sharded + one replicated

    @property
    def sharded(self) -> FlatPartition | None:
        return next((p for p in self.parts if p.sharded), None)


@dataclass(eq=False)
class Site:
    name: str
    chunk: int
    modules: list[nn.Module]
    owned: list[Unit] = field(default_factory=list)
    borrowed: list[Unit] = field(default_factory=list)
    owned_param_count: int = 0

    @property
    def units(self) -> list[Unit]:
        return self.owned + self.borrowed

    @property
    def gathered_units(self) -> list[Unit]:
        """Units with a sharded partition (the ones gather/release acts on)."""
        return [u for u in self.units if u.sharded is not None]


def _site_modules(chunk: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    sites = []
    if getattr(chunk, "embedding", None) is not None:
        sites.append(("embedding", [chunk.embedding]))
    for i, layer in enumerate(getattr(chunk, "layers", [])):
        sites.append((f"layers.{i}", [layer]))
    head = [m for m in (getattr(chunk, "final_norm", None), getattr(chunk, "output_layer", None))
            if m is not None]
    if head:
        sites.append(("head", head))
    return sites


def _head_reads_embedding(chunk: nn.Module) -> bool:
    """Tied on one stage: the output layer has no weight and is handed the embedding's."""
    out, emb = getattr(chunk, "output_layer", None), getattr(chunk, "embedding", None)
    return out is not None and emb is not None and getattr(out, "weight", 0) is None


def build_sites(model_chunks: list[nn.Module], topo, cfg: ZeroConfig) -> list[Site]:
    """All sites of all chunks, in forward order per chunk."""
    dp = topo.dp
    pp_first = topo.is_first_stage

    def counted(p) -> bool:
        # Global norm: TP-split params are distinct per TP rank; replicated ones count
        # on TP rank 0 only; a tied embedding copy counts on the first stage only.
        if getattr(p, "shared_embedding", False) and not pp_first:
            return False
        return bool(getattr(p, "tensor_model_parallel", False)) or topo.tp_rank == 0

    fp8_layers = {id(m.weight): m for c in model_chunks for m in fp8_gemm_layers(c)}
    # the model's FP8 recipe (a rowwise layer if any) against the weight gather settings
    recipes = sorted({m.gemm.recipe for m in fp8_layers.values()}, key=lambda r: not r.rowwise)
    check_fp8_weight_gathers(recipes[0] if recipes else None, cfg)
    # id(weight) -> its FP8 GEMM layer, for the weights held in E4M3: ZeRO-3's FP8 weight
    # gathers, or stage 0's E4M3-only weights (each a multiple of 16 elements, the
    # alignment cuBLASLt reads them with; else stage 0 keeps 16-bit weights as before)
    scaling = recipes[0].scaling if recipes else None
    e4m3 = (cfg.stage == 3 and cfg.fp8_weights) or (
        fp8_weights_kept_in_e4m3(cfg.stage, cfg.gather_dtype.itemsize, scaling)
        and all(m.weight.numel() % 16 == 0 for m in fp8_layers.values()))
    if not e4m3:
        fp8_layers = {}
    fp8_ids = frozenset(fp8_layers)

    def make_unit(name: str, named: list[tuple[str, nn.Parameter]], shared: bool = False) -> Unit:
        if cfg.stage == 0:
            big, small = [], named
        else:
            small = [(n, p) for n, p in named
                     if p.numel() < cfg.param_persistence_threshold and not shared]
            big = [(n, p) for n, p in named if not any(p is q for _, q in small)]
        parts = []
        if big:
            parts.append(FlatPartition(name, big, cfg.gather_dtype, dp.size, dp.rank, cfg.block_size,
                                       True, counted, shared_embedding=shared, fp8_params=fp8_ids,
                                       resident=cfg.weights_resident))
            _bind_fp8_weights(parts[-1], fp8_layers)
        if small:
            parts.append(FlatPartition(name + ".replicated", small, cfg.gather_dtype, dp.size,
                                       dp.rank, cfg.block_size, False, counted, shared_embedding=shared,
                                       fp8_params=fp8_ids if cfg.stage == 0 else frozenset()))
            _bind_fp8_weights(parts[-1], fp8_layers)
        return Unit(name, parts)

    sites: list[Site] = []
    for c, chunk in enumerate(model_chunks):
        prefix = f"chunk{c}." if len(model_chunks) > 1 else ""
        name_of = {id(p): prefix + n for n, p in chunk.named_parameters()}
        owner: dict[int, Unit] = {}
        chunk_sites: list[Site] = []
        for sname, modules in _site_modules(chunk):
            site = Site(prefix + sname, c, modules)
            seen, mine, shared = set(), [], []
            for m in modules:
                for p in m.parameters():
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    if id(p) in owner:
                        if owner[id(p)] not in site.borrowed:
                            site.borrowed.append(owner[id(p)])
                    elif getattr(p, "shared_embedding", False):
                        shared.append((name_of[id(p)], p))
                    else:
                        mine.append((name_of[id(p)], p))
            for named, uname, is_shared in ((mine, site.name, False),
                                            (shared, prefix + "shared_embedding", True)):
                if named:
                    unit = make_unit(uname, named, is_shared)
                    site.owned.append(unit)
                    site.owned_param_count += len(named)
                    for _, p in named:
                        owner[id(p)] = unit
            chunk_sites.append(site)
        if chunk_sites and _head_reads_embedding(chunk):
            head, emb = chunk_sites[-1], chunk_sites[0]
            for u in emb.owned:
                if u not in head.borrowed:
                    head.borrowed.append(u)
        orphans = [(name_of[id(p)], p) for p in chunk.parameters() if id(p) not in owner]
        if orphans and not chunk_sites:
            raise ValueError(f"model chunk {c} has parameters ({orphans[0][0]}, ...) but none of "
                             f"embedding / layers / final_norm / output_layer; the engine needs "
                             f"GPTModel's layout to place its hooks")
        if orphans:
            site = chunk_sites[0]
            unit = Unit(site.name + ".extra", [FlatPartition(
                site.name + ".extra", orphans, cfg.gather_dtype, dp.size, dp.rank,
                cfg.block_size, False, counted)])
            site.owned.append(unit)
            site.owned_param_count += len(orphans)
        sites.extend(chunk_sites)
    return sites


def _bind_fp8_weights(part: FlatPartition, fp8_layers: dict) -> None:
    """Point each FP8 GEMM layer of the partition at its weight's gathered E4M3 form."""
    for slot in part.fp8_slots:
        use_fp8_weight(fp8_layers[id(slot.param)], slot.fp8_weight, slot.fp8_inv)


def all_partitions(sites: list[Site]) -> list[FlatPartition]:
    out, seen = [], set()
    for s in sites:
        for u in s.owned:
            for p in u.parts:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def check_params(model_chunks: list[nn.Module], cfg: ZeroConfig) -> None:
    for chunk in model_chunks:
        for n, p in chunk.named_parameters():
            if p.dtype != cfg.gather_dtype:
                raise ValueError(f"parameter {n} is {p.dtype} but the engine's gather_dtype is "
                                 f"{cfg.gather_dtype}; build the model in the gather dtype "
                                 f"(params_dtype, --bf16) or set gather_dtype={p.dtype}")
            if not p.requires_grad:
                raise ValueError(f"parameter {n} has requires_grad=False; the ZeRO engine trains "
                                 f"every parameter: remove frozen parameters or set requires_grad")
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"parameter {n} has dtype {p.dtype}; use float32/bfloat16 params")
