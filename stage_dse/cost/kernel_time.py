"""The time of one op's kernel on one GPU (roofline: the slower of its flops at the tensor
cores' sustained rate and its bytes at HBM bandwidth, with shape-dependent GEMM efficiency,
floors and launch cost), and which element-wise ops run fused into their consumers. Pure
sympy over the symbols; :mod:`stage_dse.cost.time` composes these into step times."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

import sympy as sp

from stage_dse.cost.expr import _max, _min, _sum
from stage_dse.cost.recompute import is_linear
from stage_dse.graph.core import Graph
from stage_dse.graph.ir import Module, Op, OpKind, Phase, Role, degree
from stage_dse.graph.symbols import DEGREE, S
from stage_dse.graph.transformer import DIMS

ELEMENTWISE_KINDS = (OpKind.ELEMENTWISE, OpKind.BIAS, OpKind.NORM, OpKind.LOSS, OpKind.EMBEDDING)


# --------------------------------------------------------------------------- compute
def _local_extents(op: Op) -> dict:
    """Each axis of ``op`` at its extent on one GPU (over the mesh axes that split it)."""
    return {
        ax: ax.extent / sp.Mul(*[DEGREE[m] for m in ms])
        for ax, ms in zip(op.axes_iter, op.layout_iter)
    }


def gemm_mnk(op: Op, fused: bool = False) -> tuple[sp.Expr, sp.Expr, sp.Expr]:
    """(m, n, k) of an einsum on one GPU: the local extents of the axes only its left operand
    and the output have, only its right operand and the output have, and the contracted ones
    (forward ``tokens x out_features x in_features``; backward, whose left operand is the
    output gradient: the input gradient's k and the weight gradient's m are the forward's
    output features). ``fused``: those output features widened to the GEMM the projection
    runs in (:attr:`~stage_dse.graph.ir.Op.fused_width`)."""
    a, b = op.inputs
    (out,) = op.outputs
    local = _local_extents(op)
    in_a, in_b, in_o = set(a.axes), set(b.axes), set(out.axes)
    m = sp.Mul(*[local[ax] for ax in op.axes_iter if ax in in_a and ax in in_o and ax not in in_b])
    n = sp.Mul(*[local[ax] for ax in op.axes_iter if ax in in_b and ax in in_o and ax not in in_a])
    k = sp.Mul(*[local[ax] for ax in op.axes_iter if ax in in_a and ax in in_b and ax not in in_o])
    f = op.fused_width
    if fused and f != 1:
        if op.phase is not Phase.BACKWARD:
            n = n * f
        elif op.outputs[0].role is Role.GRAD:
            m = m * f
        else:
            k = k * f
    return m, n, k


def _fp8_quantized_numel(op: Op) -> sp.Expr:
    """Elements an FP8 GEMM quantizes first: forward GEMMs their activation operand, input-
    gradient GEMMs the incoming gradient; weight-gradient GEMMs reuse both (Transformer Engine
    keeps the FP8 copies of the forward input and of the output gradient)."""
    if op.phase is Phase.FORWARD:
        # a fused projection quantizes the input it shares once, for the whole fused GEMM
        shared = _sum(t.local_numel for t in op.inputs if t.role is not Role.WEIGHT)
        return shared / op.fused_width
    if op.outputs[0].role is Role.ACTIVATION_GRAD:
        return _sum(t.local_numel for t in op.inputs if t.role is Role.ACTIVATION_GRAD)
    return sp.Integer(0)


def _shared_bytes(op: Op) -> sp.Expr:
    """Bytes of the operand the projections of a fused GEMM share (zero for an op that is its
    own GEMM): the forward's input, the input gradient it writes once (where unfused GEMMs
    each write their part and sum them), the weight gradient's activation input. The fused
    GEMM moves it once, so each projection's share of it is ``1 / fused_width``."""
    f = op.fused_width
    if f == 1:
        return sp.Integer(0)
    if op.phase is not Phase.BACKWARD:
        shared = _sum(t.local_bytes for t in op.inputs if t.role is not Role.WEIGHT)
    elif op.outputs[0].role is Role.GRAD:
        shared = op.inputs[1].local_bytes  # (output gradient, the forward's input)
    else:
        shared = op.outputs[0].local_bytes
    return (1 - 1 / f) * shared


def _routed_expert(op: Op) -> bool:
    """A routed expert's op: it runs over the expert token slots (the capacity axis)."""
    return DIMS.capacity in set(op.axes_iter)


def _format_bytes(op: Op | None) -> sp.Expr:
    """The GEMM input format of ``op``'s pass: ``expert_gemm_bytes`` for a routed expert's
    grouped GEMM, ``gemm_bytes`` for the others."""
    routed = op is not None and _routed_expert(op)
    return S.expert_gemm_bytes if routed else S.gemm_bytes


def gemm_input_bytes(op: Op | None = None) -> sp.Expr:
    """Bytes per element of a linear GEMM's inputs: ``gemm_bytes`` (``expert_gemm_bytes`` for
    routed experts), but 16-bit for the weight gradient under ``fp8_recipe=rowwise_gw_hp``."""
    b = _format_bytes(op)
    if op is not None and op.outputs[0].role is Role.GRAD:
        return b + S.fp8_wgrad_hp * (2 - b)
    return b


def gemm_precision_weights(op: Op | None = None) -> tuple[sp.Expr, sp.Expr, sp.Expr]:
    """0/1 weights (16-bit, 8-bit, 4-bit) of the tensor cores a linear GEMM runs on, from its
    input bytes (:func:`gemm_input_bytes`: 2, 1 or below 0.75) in min/max arithmetic; exactly
    one of them is 1."""
    b = gemm_input_bytes(op)
    w16 = _max(0, _min(1, b - 1))
    w4 = _max(0, _min(1, 4 * (1 - b)))
    return w16, 1 - w16 - w4, w4


def _streaming_kernel(nbytes: sp.Expr) -> sp.Expr:
    """Seconds of a streaming kernel (quantize, rescale) moving ``nbytes`` through HBM: never
    below the element-wise floor, plus its launch."""
    bandwidth = S.hbm_bandwidth * S.memory_efficiency
    return _max(nbytes / bandwidth, S.elementwise_floor_s) + S.kernel_launch_s


def fp8_recipe_terms(op: Op) -> tuple[sp.Expr, sp.Expr]:
    """(kernel speed, seconds of added kernels) of a linear GEMM under the FP8 scaling recipe,
    against per-tensor scaling (:class:`~stage_dse.spec.training.Fp8Recipe`); (1, 0) for
    16-bit GEMMs and ``tensorwise``.

    Speed: MXFP8 GEMMs at ``mxfp8_gemm_speed``; row-wise forward GEMMs at
    ``rowwise_gemm_speed`` (the backward ones run the per-tensor kernel). Added bytes under
    block scales (MXFP8, and NVFP4 in a training step: ``fp8_mx``): the column-wise copy each
    quantize kernel writes too. Added kernels under
    row-wise scales: every backward FP8 GEMM rescales its 16-bit output (read and write); the
    input gradient quantizes the weight along its other axis; the weight gradient quantizes
    both operands along the token axis from their 16-bit copies."""
    _, w8, w4 = gemm_precision_weights(op)
    row, mx = S.fp8_rowwise, S.fp8_mx
    forward = op.phase is Phase.FORWARD
    speed = 1 - mx * (1 - S.mxfp8_gemm_speed) - (row * (1 - S.rowwise_gemm_speed) if forward else 0)
    bandwidth = S.hbm_bandwidth * S.memory_efficiency
    # block scales (MXFP8, NVFP4 in training): the quantize kernel writes a column-wise copy
    # beside the row-wise one
    copy = mx * _format_bytes(op) * _fp8_quantized_numel(op) / bandwidth
    if forward:
        return 1 - w8 * (1 - speed), (w8 + w4) * copy
    quantize = 2 + _format_bytes(op)  # read 16-bit, write FP8
    rescale = _streaming_kernel(4 * op.outputs[0].local_numel)
    if op.outputs[0].role is Role.GRAD:
        added = rescale + _sum(_streaming_kernel(quantize * t.local_numel) for t in op.inputs)
    else:
        weights = _sum(t.local_numel for t in op.inputs if t.role is Role.WEIGHT)
        added = rescale + _streaming_kernel(quantize * weights)
    return 1 - w8 * (1 - speed), (w8 + w4) * copy + w8 * row * added


def _compute_time(op: Op, saved_bytes: sp.Expr = 0, skew: float = 0.0) -> sp.Expr:
    """Seconds of one kernel: roofline, never below the kernel class's floor. ``saved_bytes``:
    HBM traffic a fused element-wise op does not make; such an op runs inside its consumer's
    kernel, so it pays no floor of its own. ``skew``: uneven routing
    (:func:`busiest_rank_load`)."""
    if op.kind is OpKind.EINSUM:
        gemm, quantize = _gemm_time(op, saved_bytes, skew)
        return gemm + quantize
    if op.name == MOE_DISPATCH and op.phase is Phase.FORWARD:
        return _other_time(op, saved_bytes) + S.moe_layer_latency_s
    return _other_time(op, saved_bytes)


def host_launches(op: Op) -> sp.Expr:
    """Ops the host issues for ``op`` each micro-batch, each costing it ``host_op_s``
    (dispatch through the framework and the kernel launches): none for a view or a part of
    the layer the plan captures in CUDA graphs (``graph_*`` symbols, ``plan.cuda_graphs``),
    none for a collective over one rank, one per local expert for a grouped expert GEMM that
    loops over its experts (``expert_gemm_loop``, Transformer Engine's ``GroupedLinear``),
    else the op's kernels. Megatron-Core's MoE guide names the symptom ("gaps between GPU
    kernels where CPU cannot launch kernels fast enough") and the remedies: CUDA graphs,
    smaller tensor parallelism, larger micro-batches."""
    if op.kind is OpKind.VIEW:
        return sp.Integer(0)
    if op.is_comm:
        count = _min(1, degree(op.group) - 1)
    else:
        count = sp.Integer(op.kernels)
        if op.kind is OpKind.EINSUM and _routed_expert(op):  # grouped expert GEMMs
            count = count * (1 + S.expert_gemm_loop * (_local_extents(op)[DIMS.experts] - 1))
    part = {
        Module.ATTN: S.graph_attn,
        Module.MLP: S.graph_mlp,
        Module.ROUTER: S.graph_router,
    }.get(op.module, sp.Integer(0))
    return count * (1 - S.graph_full) * (1 - part)


def touched_experts(op: Op) -> sp.Expr | None:
    """The share of a grouped expert GEMM's local experts that receive any token (None for
    other einsums). With ``lambda`` tokens per expert on average (the op's local token slots
    over the capacity factor) and routing spread evenly, an expert receives none with
    probability ``(1 - top_k / E)^T``, about ``exp(-lambda)``; a grouped GEMM runs tiles only
    for the experts that have tokens and reads only their weights. Near 1 at training and
    prefill sizes; at small decode batches it is what keeps a 128-expert layer from being
    charged 128 tiles and every expert's weights for a handful of tokens (uneven routing
    touches fewer experts still: this is the upper bound)."""
    if not _routed_expert(op):
        return None
    tokens = _local_extents(op)[DIMS.capacity] / S.capacity_factor
    return 1 - sp.exp(-tokens)


def busiest_rank_load(op: Op, skew: float) -> sp.Expr:
    """The routed rows of the busiest expert-parallel rank over the mean, ``1 + skew ln(ep)``
    (:data:`~stage_dse.spec.serving.ROUTING_SKEW`): every rank waits for it, so a grouped
    expert GEMM runs that rank's rows (its flops and its tiles' fill). 1 for other ops and for
    even routing."""
    if skew == 0 or DIMS.experts not in set(op.axes_iter):
        return sp.Integer(1)
    ep = DIMS.experts.extent / _local_extents(op)[DIMS.experts]
    return 1 + sp.Float(skew) * sp.log(ep)


def _token_and_weight_dims(op: Op) -> tuple[sp.Expr, sp.Expr]:
    """(the token dimension, the smaller weight dimension) of a GEMM: m and min(n, k), or for
    a weight gradient k and min(m, n)."""
    m, n, k = gemm_mnk(op, fused=True)
    return (k, _min(m, n)) if op.outputs[0].role is Role.GRAD else (m, _min(n, k))


def _narrow_weights(op: Op) -> sp.Expr:
    """How many times narrower a dense GEMM's stored weights are than its inputs' precision
    (``gemm_bytes``), at least 1: 4-bit weights under 16-bit math (W4A16, weight-only). The
    token dimension's half-saturation (``d / (d + h)``, fitted to GEMMs whose weights are as
    wide as their inputs) is where streaming the weights stops bounding the kernel: with
    weights ``r`` times narrower, ``r`` times fewer tokens do as much work per byte read, so
    the tokens count ``r`` times. Dense W4A16 kernels stream 4-bit weights near the ideal
    (Marlin, an FP16xINT4 kernel, "can deliver close to ideal (4x) speedups up to
    batchsizes of 16-32 tokens": IST-DASLab/marlin README; Frantar et al., arXiv:2408.11743);
    grouped expert GEMMs do not (AIConfigurator's W4A16 MXFP4 MoE tables on H100/H200 reach
    about half the weights' streaming rate) and keep the fitted law, as do weight
    gradients (no weight operand read) and GEMMs whose weights are at least as wide as the
    math (training, W8A8, W4A4)."""
    if op.outputs[0].role is Role.GRAD or touched_experts(op) is not None:
        return sp.Integer(1)
    width = _weight_bytes(op)
    return sp.Integer(1) if width is None else _max(1, S.gemm_bytes / width)


def _weight_bytes(op: Op) -> sp.Expr | None:
    """Bytes per stored value of a GEMM's weight operand (None: no weight operand, as in a
    weight gradient)."""
    widths = [t.dtype_bytes for t in op.inputs if t.role is Role.WEIGHT]
    return sp.sympify(widths[0]) if widths else None


@lru_cache(maxsize=1 << 16)
def _roofline_time(op: Op, saved_bytes: sp.Expr) -> sp.Expr:
    """:func:`_compute_time`, once per op of a training graph: the families of one graph (its
    recompute modes, schedules and overlap flags; the ZeRO stage is the graph's own) share its
    ops, and building these expressions is a large part of deriving a family (ops hash by
    identity; the graphs they belong to are cached)."""
    return _compute_time(op, saved_bytes)


def _four_bit_experts(op: Op, touched: sp.Expr | None) -> bool:
    """A grouped expert GEMM whose stored weights are 4-bit (MXFP4 or INT4 experts, W4A16 where
    the math is 16-bit)."""
    width = _weight_bytes(op) if touched is not None else None
    return width is not None and width.is_number and width < 0.75


def _gemm_time(
    op: Op, saved_bytes: sp.Expr = 0, skew: float = 0.0, recipe: bool = True
) -> tuple[sp.Expr, sp.Expr]:
    """(the GEMM kernel, the FP8 quantize kernels around it) of an einsum, in seconds
    (``recipe``: with the FP8 recipe's speed and added kernels, :func:`fp8_recipe_terms`). A
    grouped expert GEMM runs only its touched experts (:func:`touched_experts`): their
    weights are read, their tiles hold the tokens of the touched experts; under uneven
    routing (``skew``) its flops and rows per expert are the busiest rank's
    (:func:`busiest_rank_load`)."""
    bandwidth = S.hbm_bandwidth * S.memory_efficiency
    stream = (op.bytes - saved_bytes - _shared_bytes(op)) / bandwidth
    tokens, width = _token_and_weight_dims(op)
    touched = touched_experts(op)
    if touched is not None:
        weights = _sum(t.local_bytes for t in op.inputs if t.role is Role.WEIGHT)
        stream = op.bytes - saved_bytes - _shared_bytes(op) - (1 - touched) * weights
        stream = stream / bandwidth
        # forward: the token dimension over the touched experts only
        tokens = tokens / touched if op.phase is Phase.FORWARD else tokens
    # the busiest expert-parallel rank's rows: more flops, fuller tiles (a tile holds up to
    # gemm_half_dim-scale rows, so a few extra rows in a half-empty tile cost little)
    load = busiest_rank_load(op, skew)
    tokens = tokens * load * _narrow_weights(op)
    d = _min(tokens, width)
    shape = d / (d + S.gemm_half_dim)
    eff = S.gemm_efficiency * shape
    peak = S.peak_flops
    quantize = sp.Integer(0)
    if is_linear(op):  # the tensor cores of the GEMM inputs' precision (gemm_bytes)
        w16, w8, w4 = gemm_precision_weights(op)
        peak = w16 * S.peak_flops + w8 * S.peak_fp8_flops + w4 * S.peak_fp4_flops
        # the share of the tables' low-precision rate reached inside a training step (FP8 and
        # NVFP4 GEMMs alike; serving binds 1)
        low = w8 * S.fp8_gemm_efficiency + w4 * S.fp4_gemm_efficiency
        eff = w16 * S.gemm_efficiency + low * S.fp8_step_efficiency
        speed, added = fp8_recipe_terms(op) if recipe else (1, 0)
        eff = eff * speed
        # FP8 and FP4 GEMMs saturate at larger shapes (HardwareSpec): weight dimensions at
        # fp8_gemm_half_dim or fp4_gemm_half_dim, the token dimension at twice gemm_half_dim
        # (tokens per weight tile to fill a multiplied math rate; 159-296 in the FP8 tables
        # against ~128 for bf16, FP4 saturating in tokens as FP8 does on the same GPU)
        wide = tokens / (tokens + 2 * S.gemm_half_dim)
        fp8 = _min(wide, width / (width + S.fp8_gemm_half_dim))
        fp4 = _min(wide, width / (width + S.fp4_gemm_half_dim))
        eff = eff * ((1 - w8 - w4) * shape + w8 * fp8 + w4 * fp4)
        if _four_bit_experts(op, touched):
            # W4A16: dequantizing in the main loop caps the 16-bit rate at w4a16_moe_efficiency;
            # small shapes keep the latency law of the 16-bit kernels
            sixteen = S.gemm_efficiency * shape
            eff = eff + w16 * (_min(sixteen, S.w4a16_moe_efficiency) - sixteen)
        numel = _fp8_quantized_numel(op)
        if numel != 0:  # a quantize kernel first: read 16-bit, write gemm_bytes
            quantize = (1 - w16) * _streaming_kernel((2 + _format_bytes(op)) * numel)
        quantize = quantize + added
    flops = op.flops * load
    gemm = _max(flops / (peak * S.sustained_clock * eff), stream, S.gemm_floor_s)
    gemm = gemm + S.kernel_launch_s
    return gemm, quantize


def head_dim_speed(op: Op) -> sp.Expr:
    """An attention kernel's speed at its head dimension ``d`` against head dimension 128:
    ``d (128 + h) / (128 (d + h))`` below 128, 1 from 128 (``h``: ``attention_half_dim``,
    :class:`~stage_dse.spec.hardware.HardwareSpec`)."""
    d = op.inputs[0].axes[-1].extent  # queries (forward) or the output gradient: head_dim
    h = S.attention_half_dim
    return _min(1, d * (128 + h) / (128 * (d + h)))


def _other_time(op: Op, saved_bytes: sp.Expr = 0) -> sp.Expr:
    bandwidth = S.hbm_bandwidth * S.memory_efficiency
    stream = (op.bytes - saved_bytes) / bandwidth
    if op.kind is OpKind.ATTENTION:
        eff = S.attention_efficiency * op.speed * head_dim_speed(op)
        executed = op.flops * op.executed_fraction
        return (
            _max(executed / (S.peak_flops * S.sustained_clock * eff), stream, S.attention_floor_s)
            + S.kernel_launch_s
        )
    if op.kind in (*ELEMENTWISE_KINDS, OpKind.OPTIMIZER):
        if saved_bytes != 0:  # fused into its consumer
            return stream
        # an op run eagerly launches several kernels (stage_dse.graph.eager)
        return _max(stream, op.kernels * S.elementwise_floor_s) + op.kernels * S.kernel_launch_s
    return sp.Integer(0)


def _fusion_savings(graph: Graph) -> dict[Op, sp.Expr]:
    """HBM bytes each element-wise op does not move because it runs fused with its consumer.

    An element-wise output consumed by exactly one element-wise op and not kept for backward
    stays in registers: neither written nor read back (forward and backward alike). Eager
    PyTorch fuses nothing.
    """
    fusible = (OpKind.ELEMENTWISE, OpKind.BIAS)
    out: dict[Op, sp.Expr] = {}
    if not graph.fused_elementwise:
        return out
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        ops = [op for op in graph.ops if op.phase is phase]
        consumers: dict[object, list[Op]] = defaultdict(list)
        saved: set[object] = set()
        for op in ops:
            for t in op.inputs:
                consumers[t].append(op)
            saved.update(op.saved)
        for op in ops:
            if op.kind not in fusible:
                continue
            for t in op.outputs:
                users = consumers.get(t, [])
                # an op run as several eager kernels fuses with nothing
                one = op.kernels == 1 and users and users[0].kernels == 1
                if len(users) == 1 and users[0].kind in fusible and t not in saved and one:
                    out[op] = out.get(op, sp.Integer(0)) + 2 * t.local_bytes
    return out


MOE_DISPATCH = "moe_dispatch"
"""The permutation of a routed-expert layer's tokens to expert order; its forward op carries the
layer's chain latency (``moe_layer_latency_s``: fits of measured fused-MoE kernels, whose time
at a handful of tokens exceeds the floors of the kernels the model times by 10-38 us; the
backward's kernels run at training sizes, where the chain's latency is lost in their work)."""

MOE_FUSED = (
    "router_softmax",
    MOE_DISPATCH,
    "experts.gate_proj",
    "experts.up_proj",
    "experts.swiglu",
    "experts.down_proj",
    "moe_combine",
)
"""The ops of a routed-expert block that engines run as one fused MoE kernel (TensorRT-LLM's
``fused_moe``, vLLM's ``FusedMoE``, SGLang's likewise: top-k routing, the permutation to
expert order, both grouped GEMMs with the gated activation, the weighted un-permutation)."""


@dataclass(frozen=True)
class Kernel:
    """An op that ``timing=measured`` times from a table of measured kernels: which table,
    the op's shape on one GPU, its roofline time (used where the table does not reach) and
    the factor applied to the table's time."""

    table: str
    """``gemm``, ``attention``, or a collective kind (``all_reduce``, ``all_gather``, ...)."""
    shape: tuple[sp.Expr, ...]
    """gemm: (m, n, k, gemm bytes); attention: (batch, query sequence, query heads, key/value
    heads, head dim, key sequence); collective: (bytes per GPU, GPUs per domain, domains, the
    roofline seconds of its part inside one domain)."""
    roofline: sp.Expr
    scale: sp.Expr = sp.Integer(1)


class KernelSet:
    """The kernels of one family, each with the input symbol that carries its time."""

    def __init__(self) -> None:
        self.symbols: dict[Kernel, sp.Symbol] = {}

    def time(self, kernel: Kernel) -> sp.Symbol:
        sym = self.symbols.get(kernel)
        if sym is None:
            sym = self.symbols[kernel] = sp.Symbol(f"_kernel{len(self.symbols)}", real=True)
        return sym


def batched(op: Op) -> bool:
    """An einsum with an axis all three operands have: a grouped GEMM over experts or a
    batched one over heads (MLA's absorbed projections), one kernel whose weights differ per
    group. The GEMM tables hold single GEMMs (a lookup by ``(m, n, k)`` times one group's
    GEMM, not the group's), and a grouped kernel pays their latency floor once, not per
    group: these keep the roofline, which times the grouped op as one kernel."""
    a, b = op.inputs
    (out,) = op.outputs
    return bool(set(a.axes) & set(b.axes) & set(out.axes))


def table_gemm(op: Op) -> bool:
    """A linear GEMM the measured GEMM tables time (:func:`gemm_kernel`): not batched."""
    return op.kind is OpKind.EINSUM and is_linear(op) and not batched(op)


def gemm_kernel(op: Op, clock: sp.Expr, saved_bytes: sp.Expr = 0) -> Kernel:
    """The measured-table lookup of a linear GEMM: its shape and its per-tensor-scaled
    roofline (quantizing the activation operand included, as a table's FP8 GEMM includes it)
    at ``clock``, the footing of tables measured in isolation at full clock. The FP8 recipe's
    speed and added kernels apply on top (:func:`fp8_recipe_terms`). A projection fused into
    a wider GEMM (``op.fused_width``) looks up that GEMM; its op takes ``1 / fused_width`` of
    the time."""
    gemm, quantize = _gemm_time(op, saved_bytes, recipe=False)
    # a projection fused into a wider GEMM is that GEMM (its caller takes the op's share,
    # 1 / fused_width, of the table's time)
    shape = (*gemm_mnk(op, fused=True), gemm_input_bytes(op))
    return Kernel("gemm", shape, (gemm + quantize) * clock * op.fused_width)
