"""Step time of a training plan: roofline per op, alpha-beta collectives on network tiers,
pipeline schedule, and the overlaps frameworks implement.

What lives here: pure functions from the symbolic graphs (and a :class:`CostKey`) to named time
expressions in seconds. What does not: numbers (see :mod:`stage_dse.cost.compile`), I/O.

Model, in order of the terms of ``time_step_s``:

* **Compute.** Each op takes ``max(flops / (peak * clock * eff), bytes / (hbm_bw * mem_eff),
  floor)`` (``clock``: the sustained clock under the part's power limit, a fraction of the
  clock its datasheet peaks assume)
  plus a launch cost, where ``floor`` is the shortest measured kernel of its class (GEMM,
  attention, streaming; hardware presets cite the tables). GEMM efficiency is
  ``gemm_efficiency * d / (d + gemm_half_dim)`` with ``d`` the smallest of the GEMM's M, N, K
  on one GPU (tile and wave quantization make thin GEMMs slow);
  fused attention kernels use ``attention_efficiency``; everything else streams memory. Chains
  of element-wise kernels whose intermediate is neither saved nor reused are fused (their
  intermediate never reaches HBM), as Megatron-LM's fused bias-GeLU / bias-dropout-add /
  scale-mask-softmax kernels do. Recomputed ops are rerun inside backward. With FP8 GEMMs
  (``gemm_bytes`` = 1) the linear layers' GEMMs (forward, input and weight gradients) use the
  FP8 peak, each after a quantize kernel for its 16-bit input (forward: the activation; input
  gradient: the output gradient; the weight gradient reuses both FP8 copies, as Transformer
  Engine does): 3 bytes per element streamed, never below the streaming floor; attention stays
  16-bit; MFU and HFU are against the peak of the GEMM precision. GEMM inputs below 0.75
  bytes per element (NVFP4, 0.5625 with its block scales: serving's W4A4) run on the FP4 peak
  at ``fp4_gemm_efficiency`` after a quantize kernel writing that format
  (:func:`gemm_precision_weights`). Causal fused attention
  executes ``(T + 1) / 2T`` of its score tiles (:func:`stage_dse.graph.forward.causal_fraction`).
* **Host.** The host issues every op it does not replay from a CUDA graph, ``host_op_s``
  each (framework dispatch and launch: :func:`~stage_dse.cost.kernel_time.host_launches`;
  a grouped expert GEMM that loops over its experts once per local expert); a phase of a
  section (a layer's forward, its backward) lasts the longer of its kernels and the host's
  issue of them less the collectives it waits on. Per phase, not per step: a dropless MoE
  layer reads its tokens per expert back to the host (a device-host sync per layer, which
  Megatron-Core's GB200 DeepSeek-V3 report names as what keeps the routed experts out of
  CUDA graphs), so the host cannot run ahead across layers. Megatron-Core names the symptom
  ("gaps between GPU kernels where CPU cannot launch kernels fast enough", MoE guide) and the
  remedies: CUDA graphs (``plan.cuda_graphs``), less tensor parallelism, larger micro-batches.
* **Collectives** (Thakur et al. 2005; NCCL): a group of ``n`` GPUs splits into ``n_in`` members
  per scale-up domain times ``n_out`` domains, which follows from the mesh rank order and
  ``gpus_per_node``. Ring all-reduce moves ``2(n-1)/n`` of the buffer, all-gather and
  reduce-scatter ``(n-1)/n``; hierarchically, the scale-up tier carries the ``n_in`` part at
  NVLink speed and each GPU's NIC carries the ``n_out`` part of a ``1/n_in`` shard. All-to-all
  sends ``(n - n_in)/n`` of its buffer over the NIC. Latency (NCCL's model): an all-reduce
  pays its ring steps inside the domain and tree steps (log2) across domains; an all-gather or
  reduce-scatter is one ring through all ``n`` ranks, ``n - n_out`` steps over NVLink and
  ``n_out - 1`` over the network (large groups pay milliseconds); plus a fixed cost per
  collective. Two protocols, the faster wins (NCCL's own choice, ``src/graph/tuning.cc``): the
  bandwidth protocol (Simple) and the low-latency one (LL: flag-carrying stores, half the
  bandwidth, a fraction of the latency). Inside one domain a small all-reduce may go one-shot
  (each GPU reads its peers' buffers over NVLink and reduces locally, TensorRT-LLM / vLLM
  custom all-reduce). Groups spanning more than ``pod_gpus`` share the pods' uplinks, which
  carry ``1 / oversubscription`` of the pods' NIC bandwidth: a ring or pipeline leaves a pod
  once per group with members in it, so with ``m`` members per pod its scale-out bandwidth is
  divided by ``max(1, oversubscription / m)``; an all-to-all, whose every member sends across,
  by ``oversubscription``.
* **Exposure.** Tensor-parallel collectives and the expert-parallel all-to-alls sit on the
  critical path (tensor-parallel ones hide behind GEMMs with ``tp_comm_overlap``, all-to-alls
  behind another micro-batch's compute with ``ep_comm_overlap``, as DeepSeek-V3's DualPipe
  pairs a forward and a backward chunk); the
  context-parallel ring hides behind attention compute; pipeline send/recv is exposed, and so
  is the all-reduce of tied word-embedding gradients between the first and last stage once per
  step (``pp_comm_s`` holds both).
* **ZeRO-3 / FSDP schedule** (Rajbhandari et al. SC20 sec. 7.2.2; Zhao et al., "PyTorch FSDP",
  VLDB 2023, sec. 3.3-3.4): every micro-batch, each layer's parameters are all-gathered before
  its forward, gathered again before its backward (and its recompute), and its gradients
  reduce-scattered after its backward (parameters are resharded after forward), each as one
  flat buffer per layer (FSDP's FlatParameter; DeepSpeed and Megatron-LM bucket likewise, so
  a collective's latency is paid once per layer, not per tensor). With a
  prefetch depth of one layer, layer ``i+1``'s gather runs under layer ``i``'s compute and
  layer ``i+1``'s reduce-scatter under layer ``i``'s backward; the backward regather and
  reduce-scatter share the NIC, so their times add. What a layer's collectives take beyond its
  neighbour's compute is exposed, layer by layer and phase by phase (a sum over layers, not one
  max over the micro-batch); the first gather and the last reduce-scatter of each micro-batch
  are exposed whole. ZeRO-2 gathers its parameters once per step, so its reduce-scatters are
  the data-parallel communicator's only traffic: they run under whatever follows (the next
  micro-batch, other chunks in a pipeline); what exceeds a micro-batch's time is exposed, and
  only the last micro-batch's follow the layer-by-layer rule.
* **Pipeline** (Narayanan et al. SC21 sec. 2.2): ``(m + (pp-1)/v) * t_microbatch`` on the
  slowest stage, i.e. a bubble of ``(pp-1)/(v*m)``. Stages hold the layers
  ``plan.stage_layers`` gives them (:mod:`stage_dse.spec.stages`); the first (with the
  embeddings), the last (with the output layer and loss) and the fullest middle stage are
  timed, and the slowest sets the pace. DualPipe (DeepSeek-V3 report sec. 3.2.1, Table 2):
  rank ``i`` runs stages ``i`` and ``pp - 1 - i`` (half the micro-batches each, the ends
  pairing the first and last stages), the sends hide under the chunk pair's compute, and
  the bubble is ``(pp/2 - 1)(F&B + B - 3W)`` with ``F&B = F + B`` and ``W`` the
  weight-gradient GEMMs; each rank syncs and updates two stages' parameters. ZB-H1 (Qi et
  al. ICLR 2024): the weight-gradient GEMMs of the last micro-batches fill the 1F1B bubble,
  ``(pp - 1)(t_mb - 2W)``.
* **Data parallel**: with ``overlap_grad_reduce`` each section's gradient bucket is issued as
  the last micro-batch's backward leaves it and the buckets queue on one communicator: what
  outlasts the backward after the first bucket is exposed, and at least the last (the
  embedding's on the first stage) (:func:`_bucket_queue`). ZeRO-1/2's parameter all-gathers
  run under the next step's first forward with ``overlap_param_gather``, a layer ahead (Megatron-
  LM's forward pre-hook), the same chain as ZeRO-3's gathers. Gradients replicated over the
  tensor-parallel ranks (sequence-parallel norms, routers, experts) are all-reduced over them
  once per step after the data-parallel sync (Megatron-LM ``finalize_model_grads``), exposed.
* **Overlap slowdown**: wherever a collective runs beside compute (each case above), the
  compute runs slower while both run: the part of the collective that outlasts the compute is
  exposed, plus ``overlap_slowdown`` x the overlapped time (NCCL's kernels occupy SMs and HBM
  bandwidth; a hardware property, 0: perfect overlap).
* **Optimizer** step streams master weights, states and gradients through HBM.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from functools import lru_cache

import sympy as sp

from stage_dse.cost.derive import EMBEDDING_GROUP, CostKey, derive
from stage_dse.cost.expr import _max, _min, _sum, first_max_weights
from stage_dse.cost.kernel_time import (  # noqa: F401  (re-exported: one op's kernel time)
    ELEMENTWISE_KINDS,
    Kernel,
    KernelSet,
    _compute_time,
    _fp8_quantized_numel,
    _fusion_savings,
    _gemm_time,
    _other_time,
    _roofline_time,
    fp8_recipe_terms,
    gemm_kernel,
    gemm_mnk,
    gemm_precision_weights,
    host_launches,
    table_gemm,
    touched_experts,
)
from stage_dse.cost.network import (
    _coll_time,
    _per_tensor_time,
    collective_time,
    embedding_sync_time,
    group_tiers,
    pipeline_hop_time,
)
from stage_dse.cost.overlap import _bucket_queue, _hidden
from stage_dse.cost.recompute import recomputed_ops
from stage_dse.graph.backward import async_partners
from stage_dse.graph.core import Graph
from stage_dse.graph.ir import CollKind, Frequency, Op, OpKind, Phase, Role
from stage_dse.graph.layers import dense_layers_among, windowed_layers_among
from stage_dse.graph.symbols import DEGREE, S
from stage_dse.spec import MeshAxis, PipelineSchedule, Recompute
from stage_dse.spec.plan import DATA_PARALLEL_AXES

__all__ = [
    "Kernel",
    "collective_time",
    "derive_measured_time",
    "derive_time",
    "embedding_sync_time",
    "group_tiers",
    "pipeline_hop_time",
]


@dataclass(frozen=True)
class SectionTime:
    """Seconds per micro-batch of one section (per step where a name says so)."""

    fwd: sp.Expr
    bwd: sp.Expr
    """Backward compute including recomputed forward ops."""
    gemm: sp.Expr
    wgrad: sp.Expr
    """The weight-gradient GEMMs (in ``bwd``)."""
    attention: sp.Expr
    tp_comm: sp.Expr
    tp_comm_exposed: sp.Expr
    """Tensor-parallel collectives less what runs under their backward GEMM partner."""
    cp_comm: sp.Expr
    ep_comm: sp.Expr
    """Expert-parallel all-to-all (dispatch and combine): on the critical path."""
    zero_fwd_comm: sp.Expr
    """Per-micro-batch collectives over the data axes in forward (ZeRO-3 parameter gathers)."""
    zero_bwd_comm: sp.Expr
    """... in backward: ZeRO-3 regathers (recompute included) and ZeRO-2/3 reduce-scatters."""
    grad_sync_step: sp.Expr
    param_gather_step: sp.Expr
    tp_grad_sync_step: sp.Expr
    """Per-step gradient reductions over groups without the data axis (the tensor-parallel
    all-reduce of sequence-parallel and replicated parameters' gradients)."""
    optimizer_step: sp.Expr
    fwd_comm: sp.Expr
    bwd_comm: sp.Expr


ATTENTION_BACKWARD_FACTOR = sp.Rational(5, 2)
"""Measured fused-attention backward = this x the forward kernel's measured time: the
backward kernel's flops over the forward's (four GEMMs plus the recomputed q k^T, the graph's
rule in :mod:`stage_dse.graph.backward`), i.e. the backward kernel assumed to reach the
forward kernel's measured throughput. FlashAttention-2 (Dao 2023) reports its backward
kernel somewhat below its forward's throughput on A100, so this leans fast."""


def _local(t, i: int) -> sp.Expr:
    return t.axes[i].extent / sp.Mul(*[DEGREE[m] for m in t.layout[i]])


def _op_time(op: Op, saved: sp.Expr, kernels: KernelSet | None) -> sp.Expr:
    """Seconds of one compute op: its roofline, or with ``kernels`` its measured kernel's symbol."""
    if kernels is None:
        return _roofline_time(op, saved)
    if table_gemm(op):  # grouped expert GEMMs keep the roofline (kernel_time.batched)
        # tables: kernels measured alone at full clock; a power-limited part runs them at its
        # sustained clock and a step sustains a share of that (the roofline fallback on the
        # same footing; a table's FP8 or FP4 GEMM includes quantizing its activation operand)
        clock = S.sustained_clock * S.measured_efficiency
        speed, added = fp8_recipe_terms(op)
        share = kernels.time(gemm_kernel(op, clock, saved)) / op.fused_width
        return share / (clock * speed) + added
    if op.kind is OpKind.ATTENTION:
        backward = op.phase is Phase.BACKWARD
        q, k = op.inputs[1:3] if backward else op.inputs[:2]
        heads = sp.Mul(*[_local(q, i) for i in range(2, len(q.axes) - 1)])
        kv = sp.Mul(*[_local(k, i) for i in range(2, len(k.axes) - 1)])
        shape = (_local(q, 0), _local(q, 1), heads, kv, q.axes[-1].extent, _local(k, 1))
        scale = ATTENTION_BACKWARD_FACTOR if backward else sp.Integer(1)
        clock = S.sustained_clock * S.measured_efficiency
        kernel = Kernel("attention", shape, _other_time(op, saved) * clock * op.speed, scale)
        return kernels.time(kernel) / (clock * op.speed)  # op.speed: slower than the tables'
    return _roofline_time(op, saved)


def section_time(graph: Graph, key: CostKey, kernels: KernelSet | None = None) -> SectionTime:
    order = key.rank_order
    rerun = recomputed_ops(graph, key.recompute, key.recompute_modules)
    # block full recompute reruns some layers only: a layer's rerun costs count that share
    share = S.recompute_share if key.recompute is Recompute.FULL else sp.Integer(1)
    savings = _fusion_savings(graph)
    partners = async_partners(graph)
    ops = [(op, False) for op in graph.ops] + [(op, True) for op in rerun]
    acc: dict[str, list[sp.Expr]] = defaultdict(list)
    # data-parallel collectives move a layer's parameters or gradients as one flat buffer
    # (FSDP's FlatParameter, DeepSpeed's and Megatron-LM's buckets): one collective per kind
    buckets: dict[tuple, sp.Expr] = defaultdict(lambda: sp.Integer(0))
    for op, is_rerun in ops:
        # data-parallel collectives (gradient sync, ZeRO) include the DP axis (or DR, the
        # replicas of hybrid sharding); a CP-only group is the context-parallel ring
        data = bool(op.is_comm and op.group & DATA_PARALLEL_AXES)
        if op.is_comm and (data or op.frequency is Frequency.PER_STEP):
            if not data:
                # once per step after the data-parallel sync, not per micro-batch (Megatron-LM
                # finalize_model_grads: _allreduce_non_tensor_model_parallel_grads)
                name = "tp_grad_sync_step"
            elif op.frequency is Frequency.PER_STEP:
                name = "param_gather_step" if op.phase is Phase.OPTIMIZER else "grad_sync_step"
            elif op.phase is Phase.FORWARD and not is_rerun:
                name = "zero_fwd_comm"
            else:
                name = "zero_bwd_comm"
            if key.zero_sync_per_tensor and name in ("zero_fwd_comm", "zero_bwd_comm"):
                acc[name].append(_per_tensor_time(op, order, kernels))
                continue
            buckets[name, op.coll, op.group, is_rerun] += op.comm_bytes * (share if is_rerun else 1)
            continue
        if op.is_comm:
            # token dispatch and combine: top_k copies of each token, sent once per node
            # when the dispatcher deduplicates them (DeepEP)
            dedup = key.ep_dispatch_dedup and op.coll is CollKind.ALL_TO_ALL
            copies = S.top_k if dedup and MeshAxis.EP in op.group else None
            t = _coll_time(op.coll, op.group, op.comm_bytes, order, kernels, copies)
            if is_rerun:
                t = share * t
            if op.group == {MeshAxis.CP}:
                name = "cp_comm"
            elif MeshAxis.EP in op.group:
                name = "ep_comm"
            else:
                name = "tp_comm"
            acc[name].append(t)
            acc["host_bwd" if op.phase is Phase.BACKWARD or is_rerun else "host_fwd"].append(
                S.host_op_s * host_launches(op) * (share if is_rerun else 1)
            )
            exposed = t
            partner = partners.get(op) if key.tp_dgrad_overlap and not is_rerun else None
            if partner is not None:
                exposed = _hidden(t, _op_time(partner, savings.get(partner, 0), kernels))
            if name == "tp_comm":
                acc["tp_comm_exposed"].append(exposed)
            phase = "fwd_comm" if op.phase is Phase.FORWARD and not is_rerun else "bwd_comm"
            acc[phase].append(exposed)
            continue
        t = _op_time(op, savings.get(op, sp.Integer(0)), kernels)
        if is_rerun:
            t = share * t
        if op.kind is OpKind.OPTIMIZER:
            acc["optimizer_step"].append(t)
            continue
        phase = "fwd" if op.phase is Phase.FORWARD and not is_rerun else "bwd"
        acc[phase].append(t)
        acc[f"host_{phase}"].append(S.host_op_s * host_launches(op) * (share if is_rerun else 1))
        if op.kind is OpKind.EINSUM:
            acc["gemm"].append(t)
            if op.outputs[0].role is Role.GRAD:
                acc["wgrad"].append(t)
        if op.kind is OpKind.ATTENTION or (op.matmul and op.region.value != "none"):
            acc["attention"].append(t)
    for (name, coll, group, _), size in buckets.items():
        acc[name].append(_coll_time(coll, group, size, order, kernels))
    # the host issues a phase's ops while the GPU runs them: a phase whose kernels (and the
    # collectives they wait on) take less than issuing them waits for the host
    fwd_comm, bwd_comm = _sum(acc["fwd_comm"]), _sum(acc["bwd_comm"])
    return SectionTime(
        fwd=_max(_sum(acc["fwd"]), _sum(acc["host_fwd"]) - fwd_comm),
        bwd=_max(_sum(acc["bwd"]), _sum(acc["host_bwd"]) - bwd_comm),
        gemm=_sum(acc["gemm"]),
        wgrad=_sum(acc["wgrad"]),
        attention=_sum(acc["attention"]),
        tp_comm=_sum(acc["tp_comm"]),
        tp_comm_exposed=_sum(acc["tp_comm_exposed"]),
        cp_comm=_sum(acc["cp_comm"]),
        ep_comm=_sum(acc["ep_comm"]),
        zero_fwd_comm=_sum(acc["zero_fwd_comm"]),
        zero_bwd_comm=_sum(acc["zero_bwd_comm"]),
        grad_sync_step=_sum(acc["grad_sync_step"]),
        param_gather_step=_sum(acc["param_gather_step"]),
        tp_grad_sync_step=_sum(acc["tp_grad_sync_step"]),
        optimizer_step=_sum(acc["optimizer_step"]),
        fwd_comm=fwd_comm,
        bwd_comm=bwd_comm,
    )


Program = tuple[tuple[tuple[sp.Symbol, sp.Expr], ...], tuple[tuple[str, sp.Expr], ...]]


def derive_time(key: CostKey) -> Program:
    """Step-time expressions of one plan family as a small program.

    Returns ``(definitions, outputs)``: ``definitions`` are ``(symbol, expression)`` pairs, each
    over the model/plan/hardware symbols and earlier definition symbols; ``outputs`` are named
    expressions over the same. Keeping intermediate quantities (per-section times, per-stage
    micro-batch times) as symbols keeps every expression small; :mod:`stage_dse.cost.compile`
    evaluates definitions in order.
    """
    defs, out, _ = _derive_time(key, False)
    return defs, out


def derive_measured_time(key: CostKey) -> tuple[Program, tuple[tuple[Kernel, sp.Symbol], ...]]:
    """:func:`derive_time` with the linear GEMMs, fused attention and collectives of every
    section as input symbols (one per distinct kernel, :class:`Kernel`): their times come
    from measured tables, or from the kernel's roofline where a table does not reach."""
    defs, out, kernels = _derive_time(key, True)
    return (defs, out), kernels


@lru_cache(maxsize=512)
def _derive_time(key: CostKey, measured: bool):
    from stage_dse.graph.transformer import _build

    kernels = KernelSet() if measured else None

    graphs = _build(key.graph)
    costs = derive(key)
    defs: list[tuple[sp.Symbol, sp.Expr]] = []

    def define(name: str, expr: sp.Expr) -> sp.Symbol:
        sym = sp.Symbol(f"_{name}", real=True)
        defs.append((sym, expr))
        return sym

    sections = {}
    labels = ("emb", "dns", "blk", "head") if graphs.dense is not None else ("emb", "blk", "head")
    for label, graph in zip(labels, graphs.sections):
        st = section_time(graph, key, kernels)
        sections[label] = SectionTime(
            **{f: define(f"{label}_{f}", getattr(st, f)) for f in SectionTime.__dataclass_fields__}
        )
    if graphs.windowed is not None:
        st = section_time(graphs.windowed, key, kernels)
        sections["win"] = SectionTime(
            **{f: define(f"win_{f}", getattr(st, f)) for f in SectionTime.__dataclass_fields__}
        )
    emb, blk, head = sections["emb"], sections["blk"], sections["head"]
    dns, win = sections.get("dns"), sections.get("win")
    pp, v = S.pp, S.virtual_stages
    single = _max(0, 2 - pp)
    has_mid = _min(1, _max(0, pp - 2))
    mtp = S.mtp_layers if key.graph.mtp else sp.Integer(0)  # multi-token prediction modules
    # layers each timed stage runs (the modules count as layers of the stage holding them)
    stage_layers = {"first": S.first_layers + single * mtp, "last": S.last_layers + mtp}
    stage_layers["mid"] = S.mid_layers

    def layer_parts(layers: sp.Expr, where: str) -> list[tuple[SectionTime, sp.Expr]]:
        """Dense-MLP and MoE layers of a stage (stage_dse.graph.layers.dense_layers_among),
        and what the window changes in its sliding-window ones (windowed_layers_among)."""
        parts = [(blk, layers)]
        if dns is not None:
            dense = dense_layers_among(layers, where)
            parts = [(blk, layers - dense), (dns, dense)]
        if win is not None:
            windowed = windowed_layers_among(layers, where)
            parts += [(win, windowed), (blk, -windowed)]
        return parts

    m = S.global_batch / (S.dp * S.micro_batch)

    def fcover(sec: SectionTime) -> sp.Expr:
        return sec.fwd + sec.fwd_comm

    def bcover(sec: SectionTime) -> sp.Expr:
        return sec.bwd + sec.bwd_comm

    def stage(label: str, parts: list[tuple[SectionTime, sp.Expr]]) -> dict[str, sp.Expr]:
        def tot(attr: str) -> sp.Expr:
            return _sum([getattr(sec, attr) * k for sec, k in parts])

        fwd = define(f"{label}_fwd", tot("fwd"))
        bwd = define(f"{label}_bwd", tot("bwd"))
        compute = fwd + bwd
        tp = tot("tp_comm_exposed")
        if key.tp_comm_overlap:  # every collective split and pipelined with a GEMM
            tp = _min(tp, _hidden(tot("tp_comm"), tot("gemm")))
        ep = tot("ep_comm")
        if key.ep_comm_overlap:  # hidden under another micro-batch's compute (DualPipe)
            ep = _hidden(ep, compute)
        cp = _hidden(tot("cp_comm"), tot("attention"))  # the ring under attention
        # ZeRO-2/3: each layer's collectives overlap only the neighbouring layer's compute and
        # its exposed tensor-parallel traffic (another communicator), prefetch depth one, so
        # what exceeds it is exposed layer by layer; the first gather and the last reduce-
        # scatter have nothing to hide behind. A chain c_0 + sum_{i>=1} max(0, c_i - f_{i-1})
        # of equal layers is sum_i max(0, c_i - f_i) + min(c, f).
        ends = {"first": (sp.Integer(1), single), "last": (sp.Integer(0), sp.Integer(1))}
        e, h = ends.get(label, (sp.Integer(0), sp.Integer(0)))
        n = stage_layers[label]

        def gather_chain(field: str) -> sp.Expr:
            """Gathers issued a section ahead in forward order (embedding, layers, output
            layer): each runs under the previous section's compute, ``c_0 + sum_{i>=1}
            max(0, c_i - f_{i-1})``; the layers counted as equal (the block's)."""
            c_e, c_l, c_h = (getattr(x, field) for x in (emb, blk, head))
            f_e, f_l = fcover(emb), fcover(blk)
            return (
                e * (c_e + _hidden(c_l, f_e))
                + (1 - e) * c_l
                + _max(0, n - 1) * _hidden(c_l, f_l)
                + h * _hidden(c_h, f_l)
            )

        if key.zero_sync_per_tensor:  # every module fetch synchronizes: nothing overlaps
            zero = tot("zero_fwd_comm") + tot("zero_bwd_comm")
        else:
            zero = gather_chain("zero_fwd_comm") + (
                _sum([k * _hidden(sec.zero_bwd_comm, bcover(sec)) for sec, k in parts])
                + _min(blk.zero_bwd_comm, bcover(blk))
            )
            if key.graph.zero_stage == 2:
                # the reduce-scatters alone queue on the communicator, under the next
                # micro-batch's work; the last micro-batch's follow the chain (module doc)
                cover = compute + tp + ep + cp
                zero = ((m - 1) * _hidden(tot("zero_bwd_comm"), cover) + zero) / m
        # ZeRO-1/2 parameter gathers under the first micro-batch's forward, the same chain
        param_chain = gather_chain("param_gather_step")
        return {
            "compute": compute,
            "fwd": fwd,
            "bwd": bwd,
            "tp": define(f"{label}_tp", tp),
            "ep": define(f"{label}_ep", ep),
            "cp": define(f"{label}_cp", cp),
            "zero": define(f"{label}_zero", zero),
            "grad_sync": define(f"{label}_grad_sync", tot("grad_sync_step")),
            "param_gather": define(f"{label}_param_gather", tot("param_gather_step")),
            "param_gather_chain": define(f"{label}_param_gather_chain", param_chain),
            "tp_grad_sync": define(f"{label}_tp_grad_sync", tot("tp_grad_sync_step")),
            "bwd_cover": tot("bwd") + tot("bwd_comm"),
            "wgrad": tot("wgrad"),
            "optimizer": define(f"{label}_optimizer", tot("optimizer_step")),
        }

    # multi-token prediction (model.mtp_layers) on the last stage: a layer of the block's kind
    # and a second pass through the output layer (its weights: no second sync or update)
    shared = ("zero_fwd_comm", "zero_bwd_comm", "grad_sync_step", "param_gather_step")
    shared += ("tp_grad_sync_step", "optimizer_step")
    head_pass = replace(head, **dict.fromkeys(shared, sp.Integer(0)))
    mtp_parts = [(blk, mtp), (head_pass, mtp)] if key.graph.mtp else []
    # the layer split (stage_dse.spec.stages): first, last and the fullest middle stage
    first_parts = [*layer_parts(S.first_layers, "first"), (emb, 1), (head, single)]
    first_parts += [(sec, single * k) for sec, k in mtp_parts]
    last_parts = [*layer_parts(S.last_layers, "last"), (head, 1), *mtp_parts]
    stages = {
        "first": (stage("first", first_parts), stage_layers["first"], sp.Integer(1)),
        "last": (stage("last", last_parts), stage_layers["last"], 1 - single),
        "mid": (stage("mid", layer_parts(S.mid_layers, "mid")), stage_layers["mid"], has_mid),
    }
    # each micro-batch crosses a stage boundary forward and backward once per model chunk
    chunks = v if key.schedule is PipelineSchedule.INTERLEAVED else 1
    hop = pipeline_hop_time(costs.stage["boundary_bytes"], key)
    p2p = define("p2p", 2 * chunks * hop)
    dual = key.schedule is PipelineSchedule.DUALPIPE
    if dual:  # the sends of a chunk pair hide under its compute (DeepSeek-V3 sec. 3.2.1)
        p2p = define("p2p_exposed", _hidden(p2p, fcover(blk) + bcover(blk)))
    # tied embeddings: their gradients are summed over the embedding group after the last
    # backward, before the optimizer step (not overlapped, as in Megatron-LM)
    emb_bytes = costs.comm_bytes.get(f"{CollKind.ALL_REDUCE.value}_{EMBEDDING_GROUP}", 0)
    emb_sync = embedding_sync_time(emb_bytes, key.rank_order) if emb_bytes else sp.Integer(0)

    # activation offload (pp = 1): a micro-batch's offloaded layers go to host memory on one
    # copy stream during forward and come back during backward; a layer's copy is due before
    # the forward of the layer k later (Transformer Engine's cpu_offload schedule), so the
    # copies hide under the other layers' compute and what exceeds it is exposed, each way
    # (copy engines: no SMs taken)
    copy = costs.stage["offloaded_bytes"] / S.host_bandwidth
    spare = S.layers - 1
    offload = define(
        "offload", _max(0, copy - spare * fcover(blk)) + _max(0, copy - spare * bcover(blk))
    )

    def mb_time(st: dict[str, sp.Expr]) -> sp.Expr:
        return st["compute"] + st["tp"] + st["ep"] + st["cp"] + st["zero"] + p2p + offload

    # every stage runs every micro-batch: the slowest stage sets the pace
    t = {name: on * define(f"t_mb_{name}", mb_time(st)) for name, (st, _, on) in stages.items()}
    if dual:  # rank i runs stage i and stage pp - 1 - i, half the micro-batches each
        ends = (t["first"] + t["last"]) / 2
        w_ends, w_mid = first_max_weights([ends, t["mid"]])
        w_first = w_last = w_ends / 2
        t = {"ends": ends, "mid": t["mid"]}
    else:
        w_first, w_last, w_mid = first_max_weights([t["first"], t["last"], t["mid"]])

    def pick(name: str) -> sp.Expr:
        st = {k: s for k, (s, _, _) in stages.items()}
        return w_first * st["first"][name] + w_last * st["last"][name] + w_mid * st["mid"][name]

    t_mb = _max(*t.values())
    if dual:  # (pp/2 - 1)(F&B + B - 3W): the pair's compute F + B, W its weight gradients
        bubble = (pp / 2 - 1) * (pick("fwd") + 2 * pick("bwd") - 3 * pick("wgrad"))
    elif key.schedule is PipelineSchedule.ZB1P:  # weight-gradient steps fill the bubble
        bubble = (pp - 1) * (t_mb - 2 * pick("wgrad"))
    elif key.schedule is PipelineSchedule.INTERLEAVED:
        bubble = (pp - 1) / v * t_mb
    else:
        bubble = (pp - 1) * t_mb
    # data-parallel gradient buckets of each stage queue on one communicator behind the last
    # micro-batch's backward (_bucket_queue), the parameter gathers of ZeRO-1/2 under the next
    # step's first forward, a layer ahead (Megatron-LM's forward pre-hook); the tensor-parallel
    # reduction of replicated parameters' gradients follows the data-parallel sync; the step
    # waits for the slowest stage's
    heads = {"first": single, "last": sp.Integer(1), "mid": sp.Integer(0)}
    tails = {"first": sp.Integer(1), "last": sp.Integer(0), "mid": sp.Integer(0)}
    grad_syncs, param_gathers = [], []
    for name, (st, layers, on) in stages.items():
        g, p = st["grad_sync"], st["param_gather"]
        if key.overlap_grad_reduce:
            h, e = heads[name], tails[name]
            g = _bucket_queue(
                g,
                st["bwd_cover"],
                layers,
                (h * head.grad_sync_step, h * bcover(head)),
                (e * emb.grad_sync_step, e * bcover(emb)),
            )
        if key.overlap_param_gather:
            p = st["param_gather_chain"]
        grad_syncs.append(on * (g + st["tp_grad_sync"]))
        param_gathers.append(on * p)
    optimizers = [on * st["optimizer"] for st, _, on in stages.values()]
    if dual:  # each rank syncs and updates its two stages
        grad_syncs, param_gathers, optimizers = (
            [x[0] + x[1], 2 * x[2]] for x in (grad_syncs, param_gathers, optimizers)
        )
    grad_sync, param_gather = _max(*grad_syncs), _max(*param_gathers)
    out: dict[str, sp.Expr] = {
        "compute_s": m * pick("compute"),
        "tp_comm_s": m * pick("tp"),
        "ep_comm_s": m * pick("ep"),
        "cp_comm_s": m * pick("cp"),
        "zero_comm_s": m * pick("zero"),
        "pp_comm_s": m * p2p + emb_sync,
        "bubble_s": bubble,
        "offload_s": m * offload,
        "dp_comm_s": grad_sync + param_gather,
        "optimizer_s": _max(*optimizers),
    }
    step = define("step", _sum(out.values()))
    out["step_s"] = step
    gpus = S.dp * S.tp * S.pp * S.cp
    out["tokens_per_s"] = S.global_batch * S.seq / step
    # against the dense peak of the GEMMs' precision (the FP8 peak when they run in FP8)
    w16, w8, w4 = gemm_precision_weights()
    peak = w16 * S.peak_flops + w8 * S.peak_fp8_flops + w4 * S.peak_fp4_flops
    out["mfu"] = costs.flops["model"] / (step * gpus * peak)
    out["mfu_causal"] = costs.flops["model_causal"] / (step * gpus * peak)
    out["hfu"] = costs.flops["matmul"] / (step * gpus * peak)
    out["achieved_flops_per_gpu"] = costs.flops["matmul"] / (step * gpus)
    # one transformer layer, one micro-batch, with its exposed tensor/context-parallel comm
    # (what Korthikanti et al. Table 4 reports)
    out["layer_fwd_s"] = blk.fwd + blk.fwd_comm
    out["layer_bwd_s"] = blk.bwd + blk.bwd_comm
    found = tuple(kernels.symbols.items()) if kernels is not None else ()
    return tuple(defs), tuple(out.items()), found
