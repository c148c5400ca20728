"""The kernels of a serving pass that measured tables time (``timing=measured``): each
becomes an input symbol of :func:`stage_dse.cost.serving.measured_serving_program`, with its
shape on one GPU and the roofline seconds kept where no table reaches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy as sp

from stage_dse.cost.expr import _sum
from stage_dse.cost.kernel_time import (
    MOE_FUSED,
    Kernel,
    _compute_time,
    _gemm_time,
    _other_time,
    gemm_kernel,
    gemm_mnk,
    table_gemm,
)
from stage_dse.cost.network import domain_collective_time, group_tiers
from stage_dse.cost.time import _local
from stage_dse.graph.ir import CollKind, OpKind
from stage_dse.graph.symbols import S
from stage_dse.spec.serving import MOE_ROUTINGS, ROUTING_SKEW

if TYPE_CHECKING:
    from stage_dse.cost.serving import ServingKey

__all__ = ["Measure", "PassKernels"]


class PassKernels:
    """The measured kernels of both passes, each with the input symbol of its time."""

    def __init__(self) -> None:
        self.symbols: dict[tuple[str, Kernel], sp.Symbol] = {}

    def time(self, mode: str, kernel: Kernel) -> sp.Symbol:
        sym = self.symbols.get((mode, kernel))
        if sym is None:
            sym = sp.Symbol(f"_kernel{len(self.symbols)}", real=True)
            self.symbols[mode, kernel] = sym
        return sym


class Measure:
    """The kernels of one serving pass that measured tables time (:mod:`stage_dse.kernels`),
    each registered as an input symbol with its shape on one GPU and its roofline seconds
    (kept where no table reaches):

    * linear GEMMs, prefill and decode alike, by their own (m, n, k): decode GEMMs at
      ``m`` = the running batch (grouped expert GEMMs and MLA's batched absorbed projections
      keep the roofline: :func:`~stage_dse.cost.kernel_time.batched`);
    * attention over the KV cache: prefill by (batch, prompt), decode by (batch, KV length),
      per (heads, kv heads, head dim, cache bytes); DeepSeek-style latent attention on the
      MLA tables (prefill decompressed, decode absorbed over the cached latents);
    * all-reduce, all-gather, reduce-scatter and all-to-all inside one NVLink domain (an
      all-reduce at the faster of NCCL's and the engine's own kernel);
    * a mixture-of-experts layer's routed experts as the one fused kernel engines run
      (:data:`MOE_FUSED`: routing, permutation, grouped GEMMs and activation, weighted
      un-permutation) by the tokens of the expert-parallel group, its layout and the
      experts' format; the router GEMM, shared experts and all-to-alls stay separate.

    Kernel tables hold times at the full clock: a power-limited part runs the measured
    kernels at its sustained clock, as in training. Norms, element-wise kernels, embeddings,
    cache writes, the FP8 quantize kernels and pipeline sends keep the roofline."""

    NCCL = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

    def __init__(self, kernels: PassKernels, mode: str, key: ServingKey) -> None:
        self.kernels, self.mode = kernels, mode
        self.mla = key.graph.mla
        self.kv_bytes = sp.Integer(key.kv_bytes)
        self.routing = sp.Integer(MOE_ROUTINGS.index(key.moe_routing))
        self.skew = ROUTING_SKEW[key.moe_routing]
        self.fused: dict[str, sp.Expr] = {}

    def start(self, ops) -> None:
        """Before a graph's ops: the kernels engines fuse, each timed as one, its time carried
        by its first op and the others costing nothing apart: linear GEMMs that read the same
        input with the same split of their outputs as one GEMM of their summed widths
        (:meth:`_projections`), and a routed-expert block (:data:`MOE_FUSED`, all of it) as the
        fused MoE kernel."""
        self.fused = {}
        self._projections(ops)
        block = {op.name: op for op in ops if op.name in MOE_FUSED}
        if len(block) < len(MOE_FUSED):
            return
        gate = block["experts.gate_proj"]
        x, w = gate.inputs
        experts, hidden, width = (a.extent for a in w.axes)
        moe_ep = experts / _local(w, 0)
        moe_tp = width / _local(w, 2)
        # the group's tokens: the GPU's token slots are top_k x capacity x group tokens / ep
        tokens = _local(w, 0) * _local(x, 1) * moe_ep / (S.top_k * S.capacity_factor)
        clock = S.sustained_clock
        roofline = _sum(_compute_time(op, skew=self.skew) for op in block.values()) * clock
        shape = (tokens, hidden, width, S.top_k, experts, moe_tp, moe_ep, w.dtype_bytes)
        kernel = Kernel("moe", (*shape, S.expert_gemm_bytes, self.routing), roofline)
        self.fused.update({name: sp.Integer(0) for name in block})
        self.fused["experts.gate_proj"] = self._time(kernel) / clock

    def _time(self, kernel: Kernel) -> sp.Symbol:
        return self.kernels.time(self.mode, kernel)

    def _projections(self, ops) -> None:
        """Query, key and value projections of one input run as one GEMM (vLLM's and SGLang's
        ``QKVParallelLinear``, TensorRT-LLM's fused QKV weight), gate and up projections of a
        SwiGLU MLP likewise (``MergedColumnParallelLinear``, TensorRT-LLM's fused gate-up),
        DeepSeek's query and latent down-projections too (SGLang's
        ``fused_qkv_a_proj_with_mqa``): the GEMM tables' latency floor is paid once, and a
        narrow key/value GEMM (512 columns on a rank) runs inside a wide one. Grouped: linear
        forward GEMMs with the same input tensor, the same (m, k) and the same output split
        (a replicated router beside tensor-parallel shared experts stays apart)."""
        groups: dict[tuple, list] = {}
        for op in ops:
            if not table_gemm(op):
                continue
            x, w = op.inputs
            m, _, k = gemm_mnk(op)
            groups.setdefault((x.name, m, k, w.layout[-1], w.dtype_bytes), []).append(op)
        clock = S.sustained_clock
        for group in groups.values():
            if len(group) < 2:
                continue
            m, _, k = gemm_mnk(group[0])
            n = _sum(gemm_mnk(op)[1] for op in group)
            # one quantize of the shared input (an FP8 GEMM's activation operand), which a
            # table's time includes (TensorRT-LLM's Linear quantizes its input)
            # (a fused projection's own quantize is its 1 / fused_width share of it)
            quantize = _gemm_time(group[0])[1] * group[0].fused_width
            roofline = (_sum(_gemm_time(op)[0] for op in group) + quantize) * clock
            kernel = Kernel("gemm", (m, n, k, S.gemm_bytes), roofline)
            self.fused.update({op.name: sp.Integer(0) for op in group})
            self.fused[group[0].name] = self._time(kernel) / clock

    def compute(self, op) -> sp.Expr:
        clock = S.sustained_clock
        if op.name in self.fused:
            return self.fused[op.name]
        if table_gemm(op):
            return self._time(gemm_kernel(op, clock)) / (clock * op.fused_width)
        if op.kind is OpKind.ATTENTION:
            if len(op.inputs) < 3:  # DSA's index scores (no values): no table
                return _compute_time(op)
            if op.executed_fraction.free_symbols & {S.window, S.topk_tokens}:
                return _compute_time(op)  # banded prefill: the tables hold full causal runs
            return self._time(self._attention(op)) / clock
        return _compute_time(op)

    def _attention(self, op) -> Kernel:
        q, k, v = op.inputs[:3]
        batch, prompt, cached = _local(q, 0), _local(q, 1), _local(k, 1)
        roofline = _other_time(op) * S.sustained_clock
        prefill = self.mode == "prefill"
        if self.mla:  # prefill: query/key and value head dims; decode: latent and its values
            layout = (_local(q, 2), q.axes[-1].extent, v.axes[-1].extent, self.kv_bytes)
            table = "context_mla" if prefill else "generation_mla"
        else:
            heads = sp.Mul(*[_local(q, i) for i in range(2, len(q.axes) - 1)])
            kv = sp.Mul(*[_local(k, i) for i in range(2, len(k.axes) - 1)])
            layout = (heads, kv, q.axes[-1].extent, self.kv_bytes)
            table = "context_attention" if prefill else "generation_attention"
        # the physical floor (operands at the peak HBM bandwidth): some measured points lie
        # below it (A100's decode table), and the table is never taken below it
        floor = op.bytes / S.hbm_bandwidth
        return Kernel(table, (batch, prompt if prefill else cached, floor, *layout), roofline)

    def collective(self, op, order, seconds: sp.Expr, coll: CollKind, size: sp.Expr) -> sp.Expr:
        """``op`` run as the collective ``coll`` of ``size`` bytes per GPU (the exchange an
        engine runs for it: :func:`stage_dse.cost.serving._exchange`)."""
        if coll.value not in self.NCCL:
            return seconds
        n_in, n_out, _ = group_tiers(frozenset(op.group), order)
        intra = domain_collective_time(coll, n_in, size)
        kind = "engine_all_reduce" if coll is CollKind.ALL_REDUCE else coll.value
        return self._time(Kernel(kind, (size, n_in, n_out, intra), seconds))
