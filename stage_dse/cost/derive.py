"""Closed-form training costs derived by walking the symbolic graphs.

What lives here: pure functions from :class:`stage_dse.graph.ModelGraphs` to named sympy
expressions (a breakdown plus its total) for parameters, flops, per-GPU memory and communication.
What does not: time (``cost.time``), numbers (``cost.compile`` binds and evaluates), any I/O.

Conventions:

* Everything is per optimizer step of ``global_batch`` sequences, per GPU of the heaviest
  pipeline stage, unless a name says ``global`` (summed over all GPUs).
* Layers spread over stages as ``plan.stage_layers`` says (:mod:`stage_dse.spec.stages`, the
  split traces use too); the first stage also holds the embeddings, the last the final norm,
  output layer and loss. Memory is that of the heaviest stage among the first, the last and
  two middle candidates (``mem_stage`` says which).
* Activations kept for backward are the tensors the forward ops save (:attr:`Op.saved`),
  de-duplicated, with all-gathered tensors replaced by their sources (they are gathered again in
  backward). Under selective recompute the attention-core tensors are dropped and the core is
  rerun; under full recompute each layer keeps only its input and reruns its forward (Korthikanti
  et al., MLSys 2023, sec. 4-5). Embedding and head are never recomputed.
* In-flight micro-batches: stage ``i`` of 1F1B holds ``min(pp - i, m)`` of them; interleaving
  with ``v`` chunks holds ``2 (pp - i - 1) + (v - 1) pp + 1`` chunks of ``1/v`` of its layers,
  at the first stage ``pp (1 + (pp - 1) / (pp v))`` micro-batches (Korthikanti et al.
  sec. 4.2.3, from Narayanan et al. SC21).
* Model states follow Rajbhandari et al. (ZeRO, SC20, sec. 5): 16-bit weights and gradients,
  ``master + optimizer states`` bytes per parameter, sharded over the dp x cp group by stage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import lru_cache

import sympy as sp

from stage_dse.cost.expr import _max, _min, _sum
from stage_dse.cost.key import EMBEDDING_GROUP, CostKey, cost_key, group_label
from stage_dse.cost.recompute import (
    _is_block,
    kept_activations,
    kept_bytes,
    recomputed_ops,
)
from stage_dse.graph.core import Graph
from stage_dse.graph.ir import CollKind, Frequency, OpKind, Phase, Tensor
from stage_dse.graph.layers import dense_layers_among, windowed_layers_among
from stage_dse.graph.symbols import DEGREE, S
from stage_dse.graph.transformer import DIMS, ModelGraphs, build_graphs
from stage_dse.spec import (
    MeshAxis,
    ModelSpec,
    ParallelPlan,
    PipelineSchedule,
    Recompute,
    TrainingSpec,
)

__all__ = [
    "EMBEDDING_GROUP",
    "CostKey",
    "SectionCosts",
    "TrainingCosts",
    "cost_key",
    "derive",
    "embedding_sync_bytes",
    "group_label",
    "kept_activations",
    "training_costs",
]


def embedding_sync_bytes(graphs: ModelGraphs, grad_bytes: int) -> sp.Expr:
    """Per-GPU buffer of the once-per-step all-reduce that sums the gradients of the two copies
    of tied word embeddings over the embedding group (0 when untied or pp == 1): the
    tensor-parallel shard of the embedding matrix, in gradient precision."""
    tied = graphs.tied_head_weight
    if tied is None:
        return sp.Integer(0)
    return (1 - _is_one(S.pp)) * graphs.head.computed(tied).local_numel * grad_bytes


def group_degree(group: Iterable[MeshAxis]) -> sp.Expr:
    return sp.Mul(*[DEGREE[m] for m in group])


def _active(group: Iterable[MeshAxis]) -> sp.Expr:
    """1 when the group has more than one member, else 0: a one-rank collective moves nothing."""
    return _min(1, group_degree(group) - 1)


def _is_one(x: sp.Expr) -> sp.Expr:
    """1 where the positive integer ``x`` is 1, else 0 (arithmetic, so it vectorizes)."""
    return _max(0, 2 - x)


# --------------------------------------------------------------------------- per section
@dataclass(frozen=True)
class SectionCosts:
    """Costs of one section (embed, one block, or head) per micro-batch, per GPU unless global."""

    params: sp.Expr
    """Parameters (global count)."""
    expert_params: sp.Expr
    """Parameters of routed experts (global count)."""
    expert_model_parallel_numel: sp.Expr
    """Routed-expert parameter elements per GPU before data-parallel (ZeRO) sharding."""
    weights_numel: sp.Expr
    """Parameter elements stored per GPU (after ZeRO-3 sharding)."""
    model_parallel_numel: sp.Expr
    """Parameter elements per GPU before any data-parallel (ZeRO) sharding."""
    kept_bytes: dict[Recompute, sp.Expr]
    recompute_working_bytes: dict[Recompute, sp.Expr]
    matmul_fwd_global_flops: sp.Expr
    matmul_fwd_executed_global_flops: sp.Expr
    """Forward matmuls over the mesh counting what causal kernels execute."""
    matmul_global_flops: dict[Recompute, sp.Expr]
    """Matmul (einsum and attention) ops of forward, backward and recompute over the mesh."""
    hardware_global_flops: dict[Recompute, sp.Expr]
    """All ops of forward and backward (and recompute) over the mesh, per micro-batch."""
    compute_flops: dict[Recompute, sp.Expr]
    """All ops of forward and backward (and recompute) per GPU, per micro-batch."""
    optimizer_flops: sp.Expr
    comm_per_microbatch: dict[tuple[CollKind, frozenset[MeshAxis]], dict[Recompute, sp.Expr]]
    comm_per_step: dict[tuple[CollKind, frozenset[MeshAxis]], sp.Expr]


def _rerun_share(mode: Recompute) -> sp.Expr:
    """The share of layers whose forward reruns under ``mode`` (block full recompute covers
    ``recompute_share`` of them; the other modes all)."""
    return S.recompute_share if mode is Recompute.FULL else sp.Integer(1)


@lru_cache(maxsize=1024)
def section_costs(
    graph: Graph, tied_copy: Tensor | None = None, modules: tuple[str, ...] = ()
) -> SectionCosts:
    """A section's sizes, flops and collectives under every recompute mode (``modules``: the
    Megatron-Core modules :attr:`Recompute.SELECTIVE` reruns; empty, the attention core).
    Once per graph section (the families of one graph share it; graphs hash by identity and
    are cached, and callers only read the result)."""
    stored = list(graph.weights)
    unique = [w for w in stored if w is not tied_copy]
    params = _sum([w.numel for w in unique])
    weights_numel = _sum([w.local_numel for w in stored])
    mp_numel = _sum([graph.computed(w).local_numel for w in stored])
    # routed experts: the weights whose expert axis is split over EP (the router is replicated)
    experts = [
        w for w in stored if DIMS.experts in w.axes and MeshAxis.EP in w.split_of(DIMS.experts)
    ]
    expert_params = _sum([w.numel for w in experts])
    expert_mp = _sum([graph.computed(w).local_numel for w in experts])

    kept: dict[Recompute, sp.Expr] = {}
    working: dict[Recompute, sp.Expr] = {}
    none_bytes = kept_bytes(graph, kept_activations(graph, Recompute.NONE))
    for mode in Recompute:
        kept[mode] = kept_bytes(graph, kept_activations(graph, mode, modules))
        # while a layer is rerun, its dropped tensors exist again until its backward finishes
        working[mode] = none_bytes - kept[mode] if _is_block(graph) else sp.Integer(0)
    if _is_block(graph):  # full recompute of some layers only (block method): the others keep all
        share = S.recompute_share
        kept[Recompute.FULL] = share * kept[Recompute.FULL] + (1 - share) * none_bytes

    fwd = [op for op in graph.ops if op.phase is Phase.FORWARD]
    bwd = [op for op in graph.ops if op.phase is Phase.BACKWARD]
    matmul_fwd = _sum([op.global_flops for op in fwd if op.matmul])
    matmul_fwd_executed = _sum([op.global_flops * op.executed_fraction for op in fwd if op.matmul])
    base_global = _sum([op.global_flops for op in fwd + bwd])
    base_local = _sum([op.flops for op in fwd + bwd])
    base_mm = _sum([op.global_flops for op in fwd + bwd if op.matmul])
    hw: dict[Recompute, sp.Expr] = {}
    mm: dict[Recompute, sp.Expr] = {}
    local: dict[Recompute, sp.Expr] = {}
    for mode in Recompute:
        rerun = recomputed_ops(graph, mode, modules)
        w = _rerun_share(mode)
        mm[mode] = base_mm + w * _sum([op.global_flops for op in rerun if op.matmul])
        hw[mode] = base_global + w * _sum([op.global_flops for op in rerun])
        local[mode] = base_local + w * _sum([op.flops for op in rerun])
    opt_flops = _sum([op.flops for op in graph.ops if op.kind is OpKind.OPTIMIZER])

    per_mb: dict[tuple[CollKind, frozenset[MeshAxis]], dict[Recompute, sp.Expr]] = {}
    per_step: dict[tuple[CollKind, frozenset[MeshAxis]], sp.Expr] = defaultdict(
        lambda: sp.Integer(0)
    )
    for mode in Recompute:
        rerun_comm = [op for op in recomputed_ops(graph, mode, modules) if op.is_comm]
        w = _rerun_share(mode)
        for op, weight in [(o, 1) for o in graph.ops if o.is_comm] + [(o, w) for o in rerun_comm]:
            key = (op.coll, op.group)
            size = _active(op.group) * op.comm_bytes
            if op.frequency is Frequency.PER_STEP:
                if mode is Recompute.NONE:
                    per_step[key] += size
                continue
            per_mb.setdefault(key, {m: sp.Integer(0) for m in Recompute})
            per_mb[key][mode] += weight * size
    return SectionCosts(
        params=params,
        expert_params=expert_params,
        expert_model_parallel_numel=expert_mp,
        weights_numel=weights_numel,
        model_parallel_numel=mp_numel,
        kept_bytes=kept,
        recompute_working_bytes=working,
        matmul_fwd_global_flops=matmul_fwd,
        matmul_fwd_executed_global_flops=matmul_fwd_executed,
        matmul_global_flops=mm,
        hardware_global_flops=hw,
        compute_flops=local,
        optimizer_flops=opt_flops,
        comm_per_microbatch=per_mb,
        comm_per_step=dict(per_step),
    )


# --------------------------------------------------------------------------- whole model
@dataclass(frozen=True)
class TrainingCosts:
    """Named expressions of one training step; every dict has a ``total`` where it sums."""

    params: dict[str, sp.Expr]
    memory_bytes: dict[str, sp.Expr]
    """Per GPU of the heaviest stage: weights, grads, optimizer, activations, working, total."""
    flops: dict[str, sp.Expr]
    comm_bytes: dict[str, sp.Expr]
    """Per GPU per step, by ``<kind>_<group>``: the buffer sizes handed to the collectives."""
    stage: dict[str, sp.Expr] = field(default_factory=dict)
    """Per-GPU quantities of one stage the time model needs (flops per micro-batch, ...)."""

    def all(self) -> dict[str, sp.Expr]:
        out: dict[str, sp.Expr] = {}
        for prefix, d in (
            ("params", self.params),
            ("mem", self.memory_bytes),
            ("flops", self.flops),
            ("comm", self.comm_bytes),
            ("stage", self.stage),
        ):
            for k, v in d.items():
                out[f"{prefix}_{k}"] = v
        return out


def _heaviest(totals: list[sp.Expr], i: int) -> sp.Boolean:
    """``totals[i]`` is at least every later total: one unevaluated relation against their
    maximum (sympy's And of relations canonicalised these large expressions at a cost of
    most of a family's derivation, and simplified nothing)."""
    later = totals[i + 1 :]
    return sp.Ge(totals[i], later[0] if len(later) == 1 else _max(*later), evaluate=False)


def derive(key: CostKey) -> TrainingCosts:
    """All cost expressions of a model family under one plan structure (cached)."""
    # memory, flops and bytes do not depend on rank order or overlap: share one derivation
    return _derive(CostKey(key.graph, key.recompute, key.schedule, key.recompute_modules))


@lru_cache(maxsize=512)
def _derive(key: CostKey) -> TrainingCosts:
    from stage_dse.graph.transformer import _build

    graphs: ModelGraphs = _build(key.graph)
    mode = key.recompute
    modules = key.recompute_modules
    emb = section_costs(graphs.embed)
    blk = section_costs(graphs.block, modules=modules)
    dns = section_costs(graphs.dense, modules=modules) if graphs.dense is not None else None
    win = section_costs(graphs.windowed, modules=modules) if graphs.windowed is not None else None
    head = section_costs(graphs.head, tied_copy=graphs.tied_head_weight)

    L, pp, v = S.layers, S.pp, S.virtual_stages
    m = S.global_batch / (S.dp * S.micro_batch)
    # the layer split (stage_dse.spec.stages): first, last, and two middle stages, the one with
    # the most layers and the one with the most layer-micro-batches of activations in flight
    first_layers, last_layers = S.first_layers, S.last_layers
    single = _is_one(pp)
    multi = 1 - single
    has_mid = _min(1, _max(0, pp - 2))
    data = S.dp * S.cp
    # expert replicas: the data-parallel ranks outside the expert group, and the context-
    # parallel ones unless the group spans them (ep_over_cp)
    expert_data = S.dp / S.ep_data * (1 if key.graph.ep_over_cp else S.cp)
    if key.graph.hybrid_shard:  # ZeRO shards over one sharding group of dp / dp_replicate
        data, expert_data = data / S.dp_replicate, expert_data / S.dp_replicate
    zero = key.graph.zero_stage

    # layers: a mixture-of-experts model may have dense-MLP ones, leading (on the first stage)
    # or interleaved (on every stage), as dense_layers_among counts them; middle stages hold
    # the most MoE layers their length allows (leading dense layers beyond the first stage
    # are lighter)
    # (sliding-window layers count as their full-attention twin plus what the window changes:
    # the windowed section once more and the full one once less; weights and the MLPs cancel)
    def layer_parts(layers: sp.Expr, where: str) -> list[tuple[SectionCosts, sp.Expr]]:
        parts = [(blk, layers)]
        if dns is not None:
            dense = dense_layers_among(layers, where)
            parts = [(dns, dense), (blk, layers - dense)]
        if win is not None:
            windowed = windowed_layers_among(layers, where)
            parts += [(win, windowed), (blk, -windowed)]
        return parts

    # multi-token prediction (model.mtp_layers, on the last stage): a layer of the block's kind
    # and a second pass through the output layer, whose weights are the head's own
    mtp = S.mtp_layers
    head_pass = replace(
        head,
        params=sp.Integer(0),
        expert_params=sp.Integer(0),
        expert_model_parallel_numel=sp.Integer(0),
        weights_numel=sp.Integer(0),
        model_parallel_numel=sp.Integer(0),
        optimizer_flops=sp.Integer(0),
        comm_per_step={},
    )
    mtp_parts = [(blk, mtp), (head_pass, mtp)] if key.graph.mtp else []

    # (section, count) of the whole model, the first stage and the last stage
    whole = [(emb, 1), *layer_parts(L, "whole"), (head, 1), *mtp_parts]
    first_parts = [
        (emb, 1),
        *layer_parts(first_layers, "first"),
        (head, single),
        *[(sec, single * k) for sec, k in mtp_parts],
    ]
    last_parts = [*layer_parts(last_layers, "last"), (head, 1), *mtp_parts]

    def total(parts, attr: str, sub=None) -> sp.Expr:
        out = []
        for sec, count in parts:
            value = getattr(sec, attr)
            out.append(count * (value[sub] if sub is not None else value))
        return _sum(out)

    params_total = total(whole, "params")
    experts_total = total(whole, "expert_params")
    params = {
        "embedding": emb.params,
        "layers": params_total - emb.params - head.params,
        "head": head.params,
        "total": params_total,
    }
    if key.graph.moe:
        # each token runs top_k of the routed experts
        params["active"] = params_total - experts_total * (1 - S.top_k / S.experts)

    # head weights held on the first stage only when pp == 1 (a tied head adds no parameter)
    head_unique_numel = head.weights_numel
    head_unique_mp = head.model_parallel_numel
    if graphs.tied_head_weight is not None:
        tied = graphs.tied_head_weight
        head_unique_numel -= tied.local_numel
        head_unique_mp -= graphs.head.computed(tied).local_numel

    def states(parts, head_numel, head_mp) -> dict[str, sp.Expr]:
        pb, gb, ob = (
            key.graph.param_bytes,
            key.graph.grad_bytes,
            key.graph.optimizer_bytes_per_param,
        )
        body = [(sec, c) for sec, c in parts if sec is not head]
        head_count = next((c for sec, c in parts if sec is head), 0)
        numel = total(body, "weights_numel") + head_count * head_numel
        mp = total(body, "model_parallel_numel") + head_count * head_mp
        # expert states are replicated over the expert_data ranks only (EP splits them)
        expert = total(body, "expert_model_parallel_numel")
        dense = mp - expert

        def sharded(n_dense, n_expert, on: bool) -> sp.Expr:
            return n_dense / data + n_expert / expert_data if on else n_dense + n_expert

        stored, master = pb, 0
        if zero == 3:  # under PyTorch FSDP's mixed precision the stored shard is the fp32
            # master itself: counted with the weights, the optimizer keeping its states only
            kept = S.fsdp_master_shards
            stored, master = pb + kept * (S.master_bytes - pb), kept * S.master_bytes
        return {
            "weights": numel * stored,
            # accumulated unsharded when ZeRO-2 reduces once per step (FSDP no_sync)
            "grads": sharded(dense, expert, zero >= 2 and not key.graph.grad_sync_per_step) * gb,
            "optimizer": sharded(dense, expert, zero >= 1) * (ob - master),
        }

    dual = key.schedule is PipelineSchedule.DUALPIPE

    def inflight(stage: sp.Expr) -> sp.Expr:
        """Micro-batches of a stage's activations alive at its peak (layer-weighted): 1F1B
        holds pp - stage; the interleaved schedule 2(pp - stage - 1) + (v - 1) pp + 1 chunks
        of 1/v of the stage's layers (Narayanan et al. SC21 sec. 2.2; at stage 0 this is
        Korthikanti et al.'s pp (1 + (pp - 1) / (pp v)))."""
        if key.schedule is PipelineSchedule.INTERLEAVED:
            return _min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v) / v
        if dual:  # pp + 1 stage-micro-batches over the rank's two stages (report Table 2)
            return _min(pp + 1, m) / 2
        return _min(pp - stage, m)

    working = blk.recompute_working_bytes[mode]
    if dns is not None:
        working = _max(working, dns.recompute_working_bytes[mode])

    # activation offload (one stage only): the first offload_layers layers' activations are in
    # host memory by the end of forward, counted as the model's block's
    offloaded = S.offload_layers * blk.kept_bytes[mode]

    def stage_memory(parts, head_numel, head_mp, index, head_kept) -> dict[str, sp.Expr]:
        body = [(sec, c) for sec, c in parts if sec is not head]
        act = inflight(index) * (total(body, "kept_bytes", mode) - offloaded) + head_kept
        return {
            **states(parts, head_numel, head_mp),
            "activations": act,
            "recompute_working": working,
        }

    if dual:  # DualPipe: rank i holds stage i and stage pp - 1 - i (the ends: a tied head
        # shares the embedding's copy)
        ends_parts = [(emb, 1), *layer_parts(first_layers, "first")]
        ends_parts += [*layer_parts(last_layers, "last"), (head, 1), *mtp_parts]
        ends = stage_memory(ends_parts, head_unique_numel, head_unique_mp, 0, head.kept_bytes[mode])
        candidates = [(sp.Integer(0), sp.Integer(1), ends), (pp - 1, multi, ends)]
    else:
        candidates = [
            (
                sp.Integer(0),
                sp.Integer(1),
                stage_memory(
                    first_parts,
                    head_unique_numel,
                    head_unique_mp,
                    0,
                    single * head.kept_bytes[mode],
                ),
            ),
            (
                pp - 1,
                multi,
                stage_memory(
                    last_parts,
                    head.weights_numel,
                    head.model_parallel_numel,
                    pp - 1,
                    head.kept_bytes[mode],
                ),
            ),
        ]
    for index, layers in ((S.mid_stage, S.mid_layers), (S.act_stage, S.act_layers)):
        mid_parts = layer_parts(layers, "mid")
        if dual:
            mid_parts = [(sec, 2 * c) for sec, c in mid_parts]
        candidates.append((index, has_mid, stage_memory(mid_parts, 0, 0, index, 0)))
    totals = [on * _sum(parts.values()) for _, on, parts in candidates]
    memory = {}
    for k in candidates[0][2]:
        pieces = []
        for i, (_, _, parts) in enumerate(candidates[:-1]):
            heaviest = _heaviest(totals, i)
            pieces.append((parts[k], heaviest))
        pieces.append((candidates[-1][2][k], True))
        memory[k] = sp.Piecewise(*pieces, evaluate=False)
    memory["total"] = _max(*totals)
    heaviest_stage = []
    for i, (index, _, _) in enumerate(candidates[:-1]):
        heaviest = _heaviest(totals, i)
        heaviest_stage.append((index, heaviest))
    heaviest_stage.append((candidates[-1][0], True))
    # the index of the pipeline stage whose memory is reported (the heaviest)
    memory["stage"] = sp.Piecewise(*heaviest_stage, evaluate=False)
    memory["first_stage_total"] = totals[0]
    memory["last_stage_total"] = _sum(candidates[1][2].values())

    # flops per step over all GPUs (matmuls: forward x 3 is the "model flops" of MFU)
    model_flops = 3 * m * total(whole, "matmul_fwd_global_flops")
    hw_flops = m * total(whole, "hardware_global_flops", mode)
    recompute = hw_flops - m * total(whole, "hardware_global_flops", Recompute.NONE)
    flops = {
        "model": model_flops,
        "model_causal": 3 * m * total(whole, "matmul_fwd_executed_global_flops"),
        "matmul": m * total(whole, "matmul_global_flops", mode),
        "recompute": recompute,
        "hardware": hw_flops,
        "total": hw_flops,
    }

    # per-GPU per-micro-batch work of the stages (time model input)
    stage = {
        "first_flops": total(first_parts, "compute_flops", mode),
        "last_flops": total(last_parts, "compute_flops", mode),
        "block_flops": blk.compute_flops[mode],
        "microbatches": m,
        "boundary_bytes": graphs.boundary.local_bytes,
        "offloaded_bytes": offloaded,
    }

    # communication per GPU per step: of each kind, the larger of the first and last stages
    # (they are the same stage when pp == 1)
    def stage_comm(parts) -> dict[str, sp.Expr]:
        out: dict[str, sp.Expr] = defaultdict(lambda: sp.Integer(0))
        for sec, mult in parts:
            for (kind, group), by_mode in sec.comm_per_microbatch.items():
                out[f"{kind.value}_{group_label(group)}"] += mult * m * by_mode[mode]
            for (kind, group), size in sec.comm_per_step.items():
                out[f"{kind.value}_{group_label(group)}"] += mult * size
        return out

    comm_first, comm_last = stage_comm(first_parts), stage_comm(last_parts)
    comm: dict[str, sp.Expr] = {
        name: _max(comm_first.get(name, 0), multi * comm_last.get(name, 0))
        for name in dict.fromkeys([*comm_first, *comm_last])
    }
    # pipeline: each micro-batch sends its activation forward and its gradient backward
    name = f"{CollKind.SEND_RECV.value}_pp"
    comm[name] = comm.get(name, 0) + multi * 2 * m * graphs.boundary.local_bytes
    if graphs.tied_head_weight is not None:
        name = f"{CollKind.ALL_REDUCE.value}_{EMBEDDING_GROUP}"
        comm[name] = embedding_sync_bytes(graphs, key.graph.grad_bytes)
    comm_bytes = dict(comm)
    comm_bytes["total"] = _sum(list(comm.values()))
    return TrainingCosts(
        params=params, memory_bytes=memory, flops=flops, comm_bytes=comm_bytes, stage=stage
    )


def training_costs(model: ModelSpec, plan: ParallelPlan, training: TrainingSpec) -> TrainingCosts:
    build_graphs(model, plan, training)
    return derive(cost_key(model, plan, training))
