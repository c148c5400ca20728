"""Which activations a layer keeps for backward and which forward ops rerun, per recompute mode.

What lives here: the recompute rules over one section's graph (none, Korthikanti et al.'s
selective and full recompute, PyTorch's per-op selective checkpointing), and which kept tensors
linear GEMMs cache in their input precision. :mod:`stage_dse.cost.derive` sums their bytes and
flops; :mod:`stage_dse.cost.time` and the trace builder rerun the same ops. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

import sympy as sp

from stage_dse.cost.expr import _sum
from stage_dse.graph.core import Graph
from stage_dse.graph.ir import CollKind, Op, OpKind, Phase, Region, Role, Scope, Tensor
from stage_dse.graph.symbols import S
from stage_dse.spec import Recompute

__all__ = ["gemm_cached", "is_linear", "kept_activations", "kept_bytes", "recomputed_ops"]


def kept_activations(
    graph: Graph, recompute: Recompute, modules: tuple[str, ...] = ()
) -> list[Tensor]:
    """Activation tensors kept from forward to backward in one section, de-duplicated
    (``modules``: the Megatron-Core modules selective recompute reruns; empty, the attention
    core)."""
    forward = [op for op in graph.ops if op.phase is Phase.FORWARD]
    if recompute is Recompute.FULL and graph.block_input is not None and _is_block(graph):
        return [graph.block_input]
    if recompute is Recompute.OP and graph.block_input is not None and _is_block(graph):
        saved = [t for op in _op_checkpointed(graph) for t in op.outputs]
        return list(dict.fromkeys([graph.block_input, *saved]))
    saved_by_region: dict[Tensor, None] = {}
    saved_elsewhere: set[Tensor] = set()
    for op in forward:
        for t in op.saved:
            src = graph.gathered_source(t)
            if src.role is not Role.ACTIVATION:
                continue
            if op.region is Region.ATTENTION_CORE:
                saved_by_region.setdefault(src, None)
            else:
                saved_elsewhere.add(src)
    kept: dict[Tensor, None] = dict.fromkeys(saved_by_region)
    kept.update(dict.fromkeys(t for t in _ordered_saved(graph) if t in saved_elsewhere))
    if recompute is Recompute.SELECTIVE and _is_block(graph):
        dropped: set[Tensor] = set()
        if not modules or "core_attn" in modules:
            dropped.update(_region_dropped(graph, saved_by_region, saved_elsewhere))
        for name in modules:
            if name != "core_attn":
                dropped.update(_module_dropped(graph, name))
        return [t for t in kept if t not in dropped]
    return list(kept)


def is_linear(op: Op) -> bool:
    """A linear layer's GEMM: forward (a weight operand), input gradient (a weight operand) or
    weight gradient (a weight-gradient output). These run in FP8 when ``gemm_bytes`` is 1."""
    return op.kind is OpKind.EINSUM and (
        any(t.role is Role.WEIGHT for t in op.inputs)
        or any(t.role is Role.GRAD for t in op.outputs)
    )


def gemm_cached(graph: Graph) -> set[Tensor]:
    """Activations kept for backward only by linear GEMMs: they are kept as the GEMMs' inputs,
    in the GEMM input precision (``gemm_bytes``: one byte under FP8)."""
    linear: set[Tensor] = set()
    other: set[Tensor] = set()
    for op in graph.ops:
        if op.phase is Phase.FORWARD:
            for t in op.saved:
                (linear if is_linear(op) else other).add(graph.gathered_source(t))
    return linear - other


def kept_bytes(graph: Graph, tensors: Iterable[Tensor]) -> sp.Expr:
    """Bytes of kept activations (those only linear GEMMs keep at ``gemm_bytes`` each; twice
    that under row-wise FP8 scales, which keep the 16-bit tensor to quantize it along the
    other axis in backward; MX scales keep only the column-wise copy the weight gradient
    reads, as Transformer Engine's ``Linear`` drops the row-wise one after forward)."""
    gemm_only = gemm_cached(graph)
    kept = S.gemm_bytes * (1 + S.fp8_rowwise)
    return _sum([t.local_numel * kept if t in gemm_only else t.local_bytes for t in tensors])


def _ordered_saved(graph: Graph) -> list[Tensor]:
    out: dict[Tensor, None] = {}
    for op in graph.ops:
        if op.phase is Phase.FORWARD:
            for t in op.saved:
                out.setdefault(graph.gathered_source(t), None)
    return list(out)


def _is_block(graph: Graph) -> bool:
    return any(op.scope is Scope.BLOCK for op in graph.ops)


def _region_dropped(
    graph: Graph, saved_by_region: dict[Tensor, None], saved_elsewhere: set[Tensor]
) -> list[Tensor]:
    """Tensors that exist only inside the attention core: made there, used only there."""
    out = []
    for t in saved_by_region:
        if t in saved_elsewhere:
            continue
        prod = graph.producer.get(t)
        if prod is not None and prod.region is not Region.ATTENTION_CORE:
            continue
        out.append(t)
    return out


_NORMS = ("input_norm", "post_attention_norm")
_MLA_UP = ("q_b_proj", "q_rope", "k_b_proj", "v_b_proj", "k_rope", "k_concat")
_DENSE_MLP = ("fc1", "gate_proj", "up_proj", "gelu", "swiglu", "fc2")
_MOE = ("router", "router_softmax", "moe_dispatch", "moe_combine", "moe_shared_sum")
_WITHOUT_OUTPUT = ("layernorm", "moe_act", "mla_up_proj")
"""Modules Megatron-Core reruns with ``CheckpointWithoutOutput``: their outputs are dropped
too, and rebuilt before the op that saved them runs its backward; the others are checkpointed
(their outputs stay where a later op keeps them)."""


def _base(op: Op) -> str:
    """An op's layer-level name: a collective's tensor, without a bias suffix."""
    return op.name.split(":")[-1].split("+")[0]


def _module_ops(graph: Graph, module: str) -> list[Op]:
    """The forward ops of one Megatron-Core recompute module in a section (collectives inside
    it included: a checkpointed module's forward reruns them)."""
    out = []
    for op in graph.ops:
        if op.phase is not Phase.FORWARD or op.kind is OpKind.VIEW:
            continue
        base = _base(op)
        if module == "layernorm":
            hit = op.kind is OpKind.NORM and base in _NORMS
        elif module == "moe_act":
            hit = base.startswith("experts.") and op.kind is OpKind.ELEMENTWISE
        elif module == "mla_up_proj":
            hit = not op.is_comm and base in _MLA_UP
        elif module == "mlp":
            # the dense MLP's linears, activation and their tensor-parallel collectives (the
            # sequence-parallel gather of its input runs inside its first linear)
            hit = base in _DENSE_MLP or (
                op.is_comm and base == "post_attention_norm" and not _has_moe(graph)
            )
        elif module == "shared_experts":
            hit = base.startswith("shared_experts.")
        elif module == "moe":
            hit = (
                base in _MOE
                or base.startswith(("experts.", "shared_experts."))
                or (op.is_comm and base == "post_attention_norm" and _has_moe(graph))
            )
        else:
            raise ValueError(f"unknown recompute module {module!r}")
        if hit:
            out.append(op)
    return out


def _has_moe(graph: Graph) -> bool:
    return any(_base(op) == "moe_dispatch" for op in graph.ops)


def _module_dropped(graph: Graph, module: str) -> list[Tensor]:
    """Kept tensors a recompute module rebuilds in backward: every one its ops make (a
    without-output module), or those only its own ops keep (a checkpointed one)."""
    ops = set(_module_ops(graph, module))
    made = {t for op in ops for t in op.outputs}
    savers: dict[Tensor, set[Op]] = {}
    for op in graph.ops:
        if op.phase is Phase.FORWARD:
            for t in op.saved:
                savers.setdefault(graph.gathered_source(t), set()).add(op)
    without_output = module in _WITHOUT_OUTPUT
    return [t for t, by in savers.items() if t in made and (without_output or by <= ops)]


def _op_checkpointed(graph: Graph) -> list[Op]:
    """Forward ops whose outputs per-op selective checkpointing keeps (:attr:`Recompute.OP`):
    fused attention, reduce-scatters and every other linear matmul, counted in forward order
    from the first (torchtitan saves the output unless the matmul count is even)."""
    kept, linear = [], 0
    for op in graph.ops:
        if op.phase is not Phase.FORWARD:
            continue
        if op.kind is OpKind.ATTENTION or (op.is_comm and op.coll is CollKind.REDUCE_SCATTER):
            kept.append(op)
        elif op.kind is OpKind.EINSUM and is_linear(op):
            linear += 1
            if linear % 2:
                kept.append(op)
    return kept


def recomputed_ops(graph: Graph, recompute: Recompute, modules: tuple[str, ...] = ()) -> list[Op]:
    """Forward ops rerun in backward, in forward order."""
    forward = [op for op in graph.ops if op.phase is Phase.FORWARD]
    if not _is_block(graph) or recompute is Recompute.NONE:
        return []
    if recompute is Recompute.SELECTIVE and modules:
        rerun: set[Op] = set()
        for name in modules:
            rerun.update(
                _core_rerun(graph, forward) if name == "core_attn" else _module_ops(graph, name)
            )
        return [op for op in forward if op in rerun]
    if recompute is Recompute.FULL:
        return forward
    if recompute is Recompute.OP:  # everything but what is kept (views cost nothing)
        keep = set(_op_checkpointed(graph))
        return [op for op in forward if op not in keep and op.kind is not OpKind.VIEW]
    return _core_rerun(graph, forward)


def _core_rerun(graph: Graph, forward: list[Op]) -> list[Op]:
    """The attention-core ops selective recompute reruns: every one on the path to a dropped
    tensor (scores feed the softmax, ...)."""
    kept = set(kept_activations(graph, Recompute.NONE))
    dropped = kept - set(kept_activations(graph, Recompute.SELECTIVE))
    needed = set(dropped)
    rerun = []
    for op in reversed(forward):
        if op.region is not Region.ATTENTION_CORE:
            continue
        made = set(op.outputs) | {t for t in op.saved if graph.producer.get(t) is None}
        if made & needed:
            rerun.append(op)
            needed.update(op.inputs)
    return rerun[::-1]
