"""Per-rank Chakra execution traces instantiated from the symbolic graph of one configuration.

What lives here: :class:`TraceConfig` (one configuration, validated as the cost model
validates it) and :func:`build_trace_set`, which builds the graph, takes the schedule
(:mod:`stage_dse.trace.schedule`: layer split, micro-batch order, pipeline links) and emits
each stage's program as a template (:mod:`stage_dse.trace.program`); files are written by
:mod:`stage_dse.trace.write`. :func:`analytic_flops` is the cost layer's total the trace's COMP
flops must add up to.

Modelling choices, visible in ``manifest.json``:

* data-parallel gradients accumulate over micro-batches and are synchronized once per step,
  layer by layer right after that layer's backward of the last micro-batch (bucketed overlap as
  in Megatron-LM and PyTorch DDP); ZeRO-2/3 reduce-scatter every micro-batch;
* with tied embeddings and pp > 1, the first and last stage all-reduce the word-embedding
  gradient over their embedding group after the last backward, before the optimizer step;
* micro-batches follow 1F1B, or the interleaved schedule with ``virtual_stages`` model chunks
  per stage (chunk ``c`` of stage ``s`` is virtual stage ``c * pp + s``; activations wrap from
  the last stage to the first between chunks);
* send/recv tags are ``2 * (micro_batch * chunks + sender's chunk) + direction``:
  deterministic, unique per peer pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from stage_dse.cost.recompute import recomputed_ops
from stage_dse.errors import ConfigError
from stage_dse.graph.backward import async_partners
from stage_dse.graph.ir import CollKind, Frequency, OpKind, Phase
from stage_dse.spec import (
    ClusterSpec,
    HardwareSpec,
    ModelSpec,
    ParallelPlan,
    TrainingSpec,
    check_gemm_dtype,
    validate_plan,
)
from stage_dse.spec.plan import DATA_PARALLEL_AXES
from stage_dse.spec.stages import stage_layer_counts
from stage_dse.trace.mesh import EMBEDDING, Mesh
from stage_dse.trace.numbers import SECTION_NAMES, SetNumbers, set_numbers
from stage_dse.trace.program import (
    Program,
    StageTemplate,
    consumed_ops,
    emit_ops,
    group_size,
)
from stage_dse.trace.schedule import (
    pipeline_links,
    schedule_order,
    stage_sections,
)

__all__ = ["TraceConfig", "analytic_flops", "build_trace_set", "numbers_boundary"]


@dataclass(frozen=True)
class TraceConfig:
    model: ModelSpec
    training: TrainingSpec
    plan: ParallelPlan
    hardware: HardwareSpec
    cluster: ClusterSpec
    granularity: str = "segment"

    def __post_init__(self) -> None:
        validate_plan(self.model, self.training, self.plan)
        check_gemm_dtype(self.training, self.hardware)
        if self.plan.num_gpus > self.cluster.num_gpus:
            raise ConfigError(
                f"plan needs {self.plan.num_gpus} GPUs > cluster.num_gpus({self.cluster.num_gpus})"
            )
        if self.granularity not in ("segment", "op"):
            raise ConfigError(f"granularity={self.granularity!r} is not one of: segment, op")
        if self.plan.offload_layers:
            raise ConfigError(
                f"plan.offload_layers={self.plan.offload_layers}: traces carry no host copies "
                "yet; trace the plan with offload_layers=0 (its step time is in the row)"
            )
        if self.model.mtp_layers:
            raise ConfigError(
                f"model.mtp_layers={self.model.mtp_layers}: traces carry no multi-token "
                "prediction modules yet; trace the model with mtp_layers=0 (its step time is "
                "in the row)"
            )
        if self.plan.schedule.value in ("zb1p", "dualpipe"):
            raise ConfigError(
                f"plan.schedule={self.plan.schedule.value}: traces carry the 1F1B and "
                "interleaved schedules only; trace the plan with schedule=1f1b (its step time "
                "under this schedule is in the row)"
            )


def build_trace_set(cfg: TraceConfig) -> tuple[Mesh, list[StageTemplate], dict]:
    """Stage templates, the mesh with its groups, and the manifest facts of one config."""
    model, training, plan = cfg.model, cfg.training, cfg.plan
    nums = set_numbers(cfg)
    graphs, numbers = nums.graphs, nums.ops
    key = nums.family.key
    consumed = {g: consumed_ops(g) for g in graphs.sections}
    m = plan.num_microbatches(training)
    pp, v = plan.pp, plan.virtual_stages
    layers = [sum(c) for c in stage_layer_counts(model.num_layers, pp, v, plan.stage_layers)]
    boundary_bytes = int(nums.named["boundary_bytes"])
    hop = max(1, round(nums.named["hop_s"] * 1e6))
    fwd = {g: [op for op in g.ops if op.phase is Phase.FORWARD] for g in graphs.sections}
    bwd = {g: [op for op in g.ops if op.phase is Phase.BACKWARD] for g in graphs.sections}
    partners = {g: async_partners(g) if plan.tp_dgrad_overlap else {} for g in graphs.sections}
    rerun = {g: recomputed_ops(g, key.recompute, key.recompute_modules) for g in graphs.sections}
    # data-parallel collectives move one flat buffer per layer and kind, as the cost model
    # times them (FSDP's FlatParameter, DeepSpeed's and Megatron-LM's buckets)
    step_sync = {
        g: data_buckets(
            nums,
            [
                op
                for op in g.ops
                if op.phase is Phase.BACKWARD and op.frequency is Frequency.PER_STEP
            ],
        )
        for g in graphs.sections
    }
    param_gather = {
        g: data_buckets(nums, [op for op in g.ops if op.phase is Phase.OPTIMIZER])
        for g in graphs.sections
    }
    # ZeRO-1/2 with overlap_param_gather: each layer's updated parameters are gathered under
    # the step's first forward, a layer ahead (Megatron-LM: the forward pre-hook waits for its
    # bucket's all-gather and dispatches the next one, DistributedDataParallel
    # ._make_forward_pre_hook, _ParamAndGradBucketGroup.finish_param_sync); the trace is the
    # steady state, so they open the step instead of closing it
    gather_early = plan.overlap_param_gather
    # ZeRO-2/3 per micro-batch: gathers before forward, regathers (recompute included) before
    # backward, reduce-scatters after backward; compute no longer waits on per-tensor gathers
    zero_fwd = {g: data_buckets(nums, fwd[g], only=_per_mb_data) for g in graphs.sections}
    zero_regather = {
        g: data_buckets(
            nums,
            [*rerun[g], *bwd[g]],
            only=lambda op: _per_mb_data(op) and op.coll is not CollKind.REDUCE_SCATTER,
            label="regather",
        )
        for g in graphs.sections
    }
    zero_rs = {
        g: data_buckets(
            nums, bwd[g], only=lambda op: _per_mb_data(op) and op.coll is CollKind.REDUCE_SCATTER
        )
        for g in graphs.sections
    }
    fwd = {g: [op for op in ops if not _per_mb_data(op)] for g, ops in fwd.items()}
    bwd = {g: [op for op in ops if not _per_mb_data(op)] for g, ops in bwd.items()}
    rerun = {g: [op for op in ops if not _per_mb_data(op)] for g, ops in rerun.items()}
    embedding_sync = _embedding_sync(nums) if pp > 1 else None
    mesh = Mesh(plan)
    templates = []
    for s in range(pp):
        prog = Program(cfg, numbers)
        chunks = stage_sections(graphs, model, s, pp, v, plan.stage_layers)
        backwards_done = [0] * v
        forwards_done = [0] * v
        last_rs: list[int] = []
        for phase, mb, c in schedule_order(s, pp, m, v):
            sections = chunks[c]
            link = pipeline_links(s, pp, v, mb, c)
            if phase == "F":
                if not link.first_virtual:
                    name = f"recv_activation:mb{mb}:c{c}"
                    prog.p2p(False, link.prev_delta, boundary_bytes, link.from_prev_tag, name, hop)
                instances = [g for g, count in sections for _ in range(count)]
                first_mb = forwards_done[c] == 0
                forwards_done[c] += 1

                def gathers(g, first_mb=first_mb):
                    early = param_gather[g] if first_mb and gather_early else []
                    return [*early, *zero_fwd[g]]

                # prefetch depth one: layer i+1's gather is issued when layer i starts
                ahead = issue(prog, gathers(instances[0])) if instances else []
                for j, g in enumerate(instances):
                    nxt = gathers(instances[j + 1]) if j + 1 < len(instances) else []
                    if ahead or nxt:  # a layer boundary only where a gather joins or leaves
                        prog.flush()
                    prog.pending_comm.extend(ahead)
                    ahead = issue(prog, nxt)
                    emit_ops(prog, fwd[g], consumed[g])
                prog.flush()
                if not link.last_virtual:
                    name = f"send_activation:mb{mb}:c{c}"
                    prog.p2p(True, link.next_delta, boundary_bytes, link.own_tag, name, hop)
            else:
                backwards_done[c] += 1
                last_mb = backwards_done[c] == m
                if not link.last_virtual:
                    name = f"recv_gradient:mb{mb}:c{c}"
                    prog.p2p(False, link.next_delta, boundary_bytes, link.from_next_tag, name, hop)
                instances = [g for g, count in reversed(sections) for _ in range(count)]
                ahead = issue(prog, zero_regather[instances[0]]) if instances else []
                rerun_here = _block_rerun(instances, rerun, plan.recompute_layers)
                for j, g in enumerate(instances):
                    nxt = zero_regather[instances[j + 1]] if j + 1 < len(instances) else []
                    if ahead or nxt:
                        prog.flush()
                    prog.pending_comm.extend(ahead)
                    ahead = issue(prog, nxt)
                    if rerun_here[j]:
                        emit_ops(prog, rerun[g], consumed[g])
                    emit_ops(prog, bwd[g], consumed[g], partners=partners[g])
                    if zero_rs[g]:  # the optimizer waits for the last of them (issue order)
                        prog.flush()
                        last_rs = issue(prog, zero_rs[g], after=last_rs)
                    if last_mb:  # bucketed gradient sync of this layer, once per step
                        prog.flush()
                        issue(prog, step_sync[g], per_step=True)
                prog.flush()
                if not link.first_virtual:
                    name = f"send_gradient:mb{mb}:c{c}"
                    prog.p2p(True, link.prev_delta, boundary_bytes, link.own_tag + 1, name, hop)
        if embedding_sync is not None and s in (0, pp - 1):
            # tied embeddings: both copies' gradients summed over the embedding group
            prog.collective_node(
                "all_reduce:word_embeddings.grad",
                CollKind.ALL_REDUCE,
                EMBEDDING,
                *embedding_sync,
                blocking=False,
                per_step=True,
            )
        all_sections = [sc for sections in chunks for sc in sections]
        # gradients of parameters replicated over groups without the data axis (sequence-
        # parallel norms, routers, experts over tensor-parallel ranks): one coalesced
        # all-reduce per group after the data-parallel sync (Megatron-LM finalize_model_grads:
        # finish_grad_sync, then _allreduce_non_tensor_model_parallel_grads)
        replicated = [
            op
            for g, count in all_sections
            for _ in range(count)
            for op in g.ops
            if op.is_comm and op.frequency is Frequency.PER_STEP and op.phase is Phase.BACKWARD
        ]
        after_sync = list(prog.step_comm)
        for b in data_buckets(nums, replicated, data_axis=False, label="after_sync"):
            prog.collective_node(
                b.name, b.coll, b.group, b.size_bytes, b.micros, False, True, after=after_sync
            )
        # optimizer step waits for every gradient synchronization, then ZeRO-1/2 gathers
        prog.pending_comm = list(prog.step_comm) + last_rs
        for g, count in all_sections:
            for _ in range(count):
                for op in g.ops:
                    if op.kind is OpKind.OPTIMIZER:
                        prog.compute(op)
        prog.flush("optimizer_step")
        for g, count in all_sections if not gather_early else ():
            for _ in range(count):
                issue(prog, param_gather[g])
        templates.append(prog.template(s))
    kinds = set().union(*(t.kinds for t in templates))
    mesh.register(kinds)
    manifest = {
        "microbatches": m,
        "stage_layers": layers,
        "model_chunks": v,
        "boundary_bytes": boundary_bytes,
        "granularity": cfg.granularity,
        "schedule": "1f1b" if v == 1 else f"interleaved 1f1b, {v} chunks per stage",
        "gradient_sync": "once per step, per layer after its last backward (bucketed); "
        "ZeRO-2/3 reduce-scatter per micro-batch; gradients replicated over the tensor-"
        "parallel group all-reduced over it after the data-parallel sync",
        "param_gather": (
            "ZeRO-1/2 parameters gathered under the step's first forward, a layer ahead"
            if gather_early
            else "ZeRO-1/2 parameters gathered after the optimizer step"
        ),
        "embedding_sync": (
            "tied word-embedding gradients all-reduced between the first and last stage "
            "before the optimizer step"
            if embedding_sync is not None
            else "none"
        ),
        "send_recv_tags": "2 * (micro_batch * chunks + sender chunk) + (0 activation, 1 gradient)",
    }
    return mesh, templates, manifest


def _embedding_sync(nums: SetNumbers) -> tuple[int, int] | None:
    """(bytes, microseconds) of the tied-embedding gradient all-reduce; None when untied."""
    if nums.graphs.tied_head_weight is None:
        return None
    size_bytes = nums.named["embedding_sync_bytes"]
    micros = nums.named["embedding_sync_s"] * 1e6
    return round(size_bytes), max(1, round(micros))


@dataclass(frozen=True)
class Bucket:
    """One flat data-parallel collective: a layer's buffers of one kind over one group."""

    name: str
    coll: CollKind
    group: frozenset
    size_bytes: int
    """As the trace writes it (all-gather: each rank's input)."""
    micros: int
    output_bytes: int
    """What the collective leaves on each rank (all-gather: the gathered buffer)."""


def _block_rerun(instances: list, rerun: dict, recompute_layers: int) -> list[bool]:
    """Which of a chunk's section instances (in backward order) rerun their forward: all, or
    under block recompute the first ``recompute_layers`` layers of the chunk in forward
    order (the last ones backward meets)."""
    layer_at = [bool(rerun[g]) for g in instances]
    if not recompute_layers:
        return layer_at
    out, seen = [False] * len(instances), 0
    for j in reversed(range(len(instances))):  # forward order
        if layer_at[j] and seen < recompute_layers:
            out[j] = True
        seen += layer_at[j]
    return out


def _per_mb_data(op) -> bool:
    return (
        op.is_comm
        and bool(op.group & DATA_PARALLEL_AXES)
        and op.frequency is Frequency.PER_MICROBATCH
    )


def data_buckets(
    nums: SetNumbers, ops, only=None, label: str = "", data_axis: bool = True
) -> list[Bucket]:
    """The data-parallel collectives among ``ops`` (those whose group holds DP or DR; with
    ``data_axis=False`` those whose group does not) as one flat buffer per (kind, group),
    timed as the cost model times the same bucket."""
    sizes: dict[tuple, float] = {}
    first: dict[tuple, str] = {}
    for op in ops:
        data = bool(op.group & DATA_PARALLEL_AXES)
        if not (op.is_comm and data == data_axis) or (only and not only(op)):
            continue
        k = (op.coll, op.group)
        sizes[k] = sizes.get(k, 0.0) + nums.comm_bytes(op)
        first.setdefault(k, op.name.split(":", 1)[-1])
    out = []
    for (coll, group), b in sizes.items():
        n = group_size(nums.plan, group)
        if n == 1:
            continue  # a one-rank group moves nothing
        t = nums.bucket_seconds(coll, group, b)
        trace_bytes = b / n if coll is CollKind.ALL_GATHER else b
        name = f"{coll.value}:{label + ':' if label else ''}{first[(coll, group)]}..(flat)"
        out.append(
            Bucket(name, coll, group, max(1, round(trace_bytes)), max(1, round(t * 1e6)), round(b))
        )
    return out


def issue(prog, buckets: list[Bucket], per_step: bool = False, after: list[int] = ()) -> list[int]:
    """Issue ``buckets`` now, none blocking the next compute; returns their node ids."""
    nids = []
    for b in buckets:
        nids.append(
            prog.collective_node(
                b.name, b.coll, b.group, b.size_bytes, b.micros, False, per_step, after=list(after)
            )
        )
        if b.coll is CollKind.ALL_GATHER:
            prog.gathered += b.output_bytes
    return nids


def numbers_boundary(cfg: TraceConfig, graphs=None) -> int:
    """Bytes of the activation that crosses a stage boundary (per micro-batch)."""
    return int(set_numbers(cfg).named["boundary_bytes"])


def analytic_flops(cfg: TraceConfig, nums: SetNumbers | None = None) -> int:
    """Sum over all GPUs of their per-step flops, from the cost layer's per-section totals."""
    nums = nums or set_numbers(cfg)
    named = nums.named
    m = cfg.plan.num_microbatches(cfg.training)
    ranks_per_stage = cfg.plan.num_gpus // cfg.plan.pp
    if cfg.plan.recompute_layers:  # block recompute: the layers the schedule reruns, counted
        return round(_block_recompute_flops(cfg, nums, m) * ranks_per_stage)

    def per_layer(section: str) -> float:
        return named[f"{section}_compute_flops"] * m + named[f"{section}_optimizer_flops"]

    emb = per_layer("embed")
    head = per_layer("head")
    block = per_layer("block")
    has_dense = "dense_compute_flops" in named
    dense = per_layer("dense") if has_dense else 0.0
    n_dense = cfg.model.num_dense_layers if has_dense else 0
    n_block = cfg.model.num_layers - n_dense
    # every stage's ranks run their layers; summed over stages that is every layer once
    total = emb + head + n_dense * dense + n_block * block
    return round(total * ranks_per_stage)


def _block_recompute_flops(cfg: TraceConfig, nums: SetNumbers, m: int) -> float:
    """One replica's step flops under block recompute: every section instance's flops without
    recompute, plus the rerun of the layers :func:`_block_rerun` picks in each model chunk."""
    graphs, named, plan = nums.graphs, nums.named, cfg.plan
    key = nums.family.key
    name = {g: s for s in SECTION_NAMES if (g := getattr(graphs, s)) is not None}
    rerun = {g: recomputed_ops(g, key.recompute, key.recompute_modules) for g in name}
    total = 0.0
    for stage in range(plan.pp):
        chunks = stage_sections(
            graphs, cfg.model, stage, plan.pp, plan.virtual_stages, plan.stage_layers
        )
        for sections in chunks:
            instances = [g for g, count in reversed(sections) for _ in range(count)]
            for g, again in zip(instances, _block_rerun(instances, rerun, plan.recompute_layers)):
                s = name[g]
                total += named[f"{s}_base_flops"] * m + named[f"{s}_optimizer_flops"]
                total += named[f"{s}_rerun_flops"] * m if again else 0.0
    return total
