"""Binding specs to symbol values, and evaluating one plan.

What lives here: :func:`bind` (model, training step, plan -> symbol values),
:func:`bind_hardware` (hardware, cluster -> symbol values) and :func:`evaluate_plan`, a one-row
use of the compiled family (:mod:`stage_dse.cost.compile`). Per-config ``subs`` is never used.
"""

from __future__ import annotations

import math
from operator import attrgetter

import numpy as np

from stage_dse.cost.columns import named_outputs
from stage_dse.cost.compile import SYMBOL_NAMES, family_for
from stage_dse.cost.key import cost_key
from stage_dse.errors import ConfigError
from stage_dse.graph.symbols import HARDWARE_SYMBOLS
from stage_dse.spec import (
    ClusterSpec,
    HardwareSpec,
    ModelSpec,
    ParallelPlan,
    TrainingSpec,
    check_gemm_dtype,
    validate_plan,
)
from stage_dse.spec.stages import stage_values
from stage_dse.spec.training import Fp8Recipe

__all__ = ["bind", "bind_hardware", "evaluate_plan", "model_values", "moe_values", "plan_values"]


def model_values(model: ModelSpec, training: TrainingSpec) -> dict[str, float]:
    """Values of the model and training-step symbols (everything but the plan's)."""
    return {
        "seq": training.seq_len,
        "hidden": model.hidden_size,
        "ffn": model.ffn_hidden_size,
        "heads": model.num_heads,
        "kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "vocab": model.vocab_size,
        "layers": model.num_layers,
        "positions": model.max_positions or training.seq_len,
        **moe_values(model),
        "global_batch": training.global_batch_size,
        "gemm_bytes": training.gemm_dtype.bytes,
        "master_bytes": training.master_dtype.bytes,
        "expert_gemm_bytes": training.gemm_dtype.bytes,
        "quantized_dispatch": 0.0,
        **fp8_recipe_values(training.fp8_recipe, training.block_scaled),
        "context": training.seq_len,
        "prompt": training.seq_len,
        "output_tokens": 1,
        "context_attention_speed": 1.0,
    }


def fp8_recipe_values(recipe: Fp8Recipe, block_scaled: bool = False) -> dict[str, int]:
    """The scaling recipe's 0/1 symbols (all 0 for ``tensorwise``, the recipe of 16-bit
    GEMMs). ``fp8_mx``: block scales along each operand's reduction axis, MXFP8 or NVFP4 in a
    training step (``TrainingSpec.block_scaled``)."""
    return {
        "fp8_rowwise": int(recipe.rowwise),
        "fp8_wgrad_hp": int(recipe is Fp8Recipe.ROWWISE_GW_HP),
        "fp8_mx": int(recipe is Fp8Recipe.MXFP8 or block_scaled),
    }


def bind(model: ModelSpec, training: TrainingSpec, plan: ParallelPlan) -> dict[str, float]:
    """Values of the model, step and plan symbols for one concrete configuration."""
    return {**model_values(model, training), **plan_values(model.num_layers, plan)}


def plan_values(num_layers: int, plan: ParallelPlan) -> dict[str, float]:
    """Values of the plan's own symbols (degrees, micro-batch, the stages' layer counts)."""
    return {
        "micro_batch": plan.micro_batch_size,
        "dp": plan.dp,
        "dp_replicate": plan.dp_replicate,
        "tp": plan.tp,
        "pp": plan.pp,
        "cp": plan.cp,
        "ep": plan.ep,
        "ep_data": plan.ep_data,
        "virtual_stages": plan.virtual_stages,
        "offload_layers": plan.offload_layers,
        **cuda_graph_values(plan.cuda_graphs),
        "expert_gemm_loop": int(plan.expert_gemm_loop),
        "fsdp_master_shards": int(plan.fsdp_master_shards),
        "recompute_share": recompute_share(
            num_layers, plan.pp, plan.virtual_stages, plan.recompute_layers
        ),
        **stage_values(num_layers, plan.pp, plan.virtual_stages, plan.stage_layers),
    }


def cuda_graph_values(modules: tuple[str, ...]) -> dict[str, int]:
    """The 0/1 symbols of ``plan.cuda_graphs`` (``moe_preprocess`` captures the dispatch's
    metadata, which the graph counts with the router)."""
    return {
        "graph_attn": int("attn" in modules),
        "graph_mlp": int("mlp" in modules),
        "graph_router": int("moe_router" in modules or "moe_preprocess" in modules),
        "graph_full": int("full_iteration" in modules),
    }


def recompute_share(layers, pp, virtual_stages, recompute_layers):
    """Share of the layers Megatron-Core's block recompute covers: ``recompute_layers`` of
    each of the ``pp x virtual_stages`` model chunks, at most all layers (a chunk shorter than
    ``recompute_layers`` is counted full length); 1 where ``recompute_layers`` is 0 (every
    layer). One plan's numbers or arrays of them (the sweep grid's columns)."""
    if isinstance(recompute_layers, int):  # one plan: plain Python (the per-plan loop)
        covered = min(recompute_layers * pp * virtual_stages, layers)
        return covered / layers if recompute_layers else 1.0
    covered = np.minimum(np.asarray(recompute_layers) * pp * virtual_stages, layers)
    return np.where(np.asarray(recompute_layers) > 0, covered / layers, 1.0)


def moe_values(model: ModelSpec) -> dict[str, float]:
    """Mixture-of-experts, latent-attention, sparse-attention and sliding-window symbols
    (neutral values where a model's graph has none)."""
    return {
        "experts": model.num_experts or 1,
        "top_k": model.top_k or 1,
        "moe_ffn": model.moe_ffn_hidden_size or 1,
        "shared_experts": model.num_shared_experts,
        "capacity_factor": float(model.capacity_factor),
        "dense_layers": model.first_dense_layers,
        "moe_interval": model.moe_layer_interval,
        "mtp_layers": model.mtp_layers,
        "topk_tokens": model.sparse_attention_topk or 1,
        "index_heads": model.indexer_heads or 1,
        "index_dim": model.indexer_head_dim or 1,
        "window": model.sliding_window or model.attention_chunk_size or 1,
        "full_interval": model.full_attention_interval or model.num_layers + 1,
        "q_lora": model.q_lora_rank or 1,
        "kv_lora": model.kv_lora_rank or 1,
        "rope_dim": model.rope_head_dim or 1,
        "v_head_dim": model.v_head_dim or 1,
    }


def bind_hardware(hardware: HardwareSpec, cluster: ClusterSpec) -> dict[str, float]:
    """Values of the hardware and network symbols (base units)."""
    return {
        "peak_flops": hardware.peak_flops,
        "peak_fp8_flops": hardware.peak_fp8_flops,
        "peak_fp4_flops": hardware.peak_fp4_flops,
        "sustained_clock": hardware.sustained_clock,
        "measured_efficiency": hardware.measured_efficiency,
        "hbm_bandwidth": hardware.hbm_bandwidth_bytes_per_s,
        "host_bandwidth": hardware.host_bandwidth_bytes_per_s,
        "rowwise_gemm_speed": hardware.rowwise_gemm_speed,
        "mxfp8_gemm_speed": hardware.mxfp8_gemm_speed,
        "gemm_efficiency": hardware.gemm_efficiency,
        "fp8_gemm_efficiency": hardware.fp8_gemm_efficiency,
        "fp8_step_efficiency": hardware.fp8_step_efficiency,
        "fp4_gemm_efficiency": hardware.fp4_gemm_efficiency,
        "w4a16_moe_efficiency": hardware.w4a16_moe_efficiency,
        "gemm_half_dim": hardware.gemm_half_dim,
        "fp8_gemm_half_dim": hardware.fp8_gemm_half_dim,
        "fp4_gemm_half_dim": hardware.fp4_gemm_half_dim,
        "attention_efficiency": hardware.attention_efficiency,
        "attention_half_dim": hardware.attention_half_dim,
        "memory_efficiency": hardware.memory_efficiency,
        "kernel_launch_s": hardware.kernel_launch_s,
        "host_op_s": hardware.host_op_s,
        "overlap_slowdown": hardware.overlap_slowdown,
        "gemm_floor_s": hardware.gemm_floor_s,
        "attention_floor_s": hardware.attention_floor_s,
        "elementwise_floor_s": hardware.elementwise_floor_s,
        "moe_layer_latency_s": hardware.moe_layer_latency_s,
        "usable_memory": hardware.usable_bytes,
        "gpus_per_node": cluster.gpus_per_node,
        "intra_bandwidth": cluster.intra_bandwidth_bytes_per_s,
        "inter_bandwidth": cluster.inter_bandwidth_bytes_per_s,
        "intra_latency": cluster.intra_latency_s,
        "inter_latency": cluster.inter_latency_s,
        "collective_base_latency": cluster.collective_base_latency_s,
        "oneshot_latency": cluster.oneshot_latency_s,
        **_ll_values(cluster),
        "intra_efficiency": cluster.intra_efficiency,
        "inter_efficiency": cluster.inter_efficiency,
        "pod_gpus": cluster.pod_gpus or cluster.num_gpus,
        "oversubscription": cluster.oversubscription,
    }


def _ll_values(cluster: ClusterSpec) -> dict[str, float]:
    """The low-latency protocol's latencies; a cluster without one gets the bandwidth
    protocol's, so that its half-bandwidth rings never win."""
    if cluster.ll_intra_latency_s > 0:
        return {
            "ll_intra_latency": cluster.ll_intra_latency_s,
            "ll_inter_latency": cluster.ll_inter_latency_s or cluster.inter_latency_s,
            "ll_base_latency": cluster.ll_base_latency_s,
        }
    return {
        "ll_intra_latency": cluster.intra_latency_s,
        "ll_inter_latency": cluster.inter_latency_s,
        "ll_base_latency": cluster.collective_base_latency_s,
    }


def check_fits_cluster(plan: ParallelPlan, cluster: ClusterSpec) -> None:
    if plan.num_gpus > cluster.num_gpus:
        raise ConfigError(
            f"plan needs dp({plan.dp})*tp({plan.tp})*pp({plan.pp})*cp({plan.cp})"
            f"={plan.num_gpus} GPUs > cluster.num_gpus({cluster.num_gpus})"
        )


class _PlanContext:
    """What one (model, step, hardware, cluster) gives every plan evaluated on it: the input
    row without the plan's symbols, each plan structure's family key and compiled family.
    ``evaluate_plan`` in a loop over plans of one workload binds the workload once (it cost
    ~25 us a call, about as much as all the rest of a compiled call)."""

    KEYS_LIMIT = 4096

    def __init__(self, model, training, hardware, cluster) -> None:
        self.specs = (model, training, hardware, cluster)
        values = model_values(model, training)
        if hardware is not None and cluster is not None:
            check_gemm_dtype(training, hardware)
            values.update(bind_hardware(hardware, cluster))
        else:
            values.update(dict.fromkeys(HARDWARE_SYMBOLS, math.nan))
        values.update(plan_values(model.num_layers, _DEFAULT_PLAN))  # every plan symbol
        self.base = np.array([values[n] for n in SYMBOL_NAMES], dtype=np.float64)
        self.column = {n: j for j, n in enumerate(SYMBOL_NAMES)}
        self.where: dict[tuple, np.ndarray] = {}
        self.structure = attrgetter(*_fields_read(cost_key, model, training))
        self.keys: dict[tuple, object] = {}
        self.families: dict[tuple, object] = {}  # compiled ones only: they stay

    def row(self, plan: ParallelPlan) -> np.ndarray:
        values = plan_values(self.specs[0].num_layers, plan)
        names = tuple(values)
        where = self.where.get(names)
        if where is None:  # the symbols a plan sets: the same few names, met once
            where = self.where[names] = np.array([self.column[n] for n in names])
        x = self.base.copy()
        x[where] = tuple(values.values())
        return x[None, :]

    def key(self, plan: ParallelPlan):
        """The plan's family key, shared by every plan that agrees on the fields the key is
        made of (structure, not sizes)."""
        structure = self.structure(plan)
        key = self.keys.get(structure)
        if key is None:
            if len(self.keys) >= self.KEYS_LIMIT:
                self.keys.clear()
            key = self.keys[structure] = cost_key(self.specs[0], plan, self.specs[1])
        return key

    def family(self, plan: ParallelPlan):
        """The plan's roofline family (:func:`family_for`); a compiled one is kept here, an
        interpreted one asked for again each time (its rows count towards compiling it)."""
        structure = self.structure(plan)
        family = self.families.get(structure)
        if family is None:
            family = family_for(self.key(plan))
            if family.backend != "interpreted":
                if len(self.families) >= self.KEYS_LIMIT:
                    self.families.clear()
                self.families[structure] = family
        return family


def _fields_read(make_key, model: ModelSpec, training: TrainingSpec) -> tuple[str, ...]:
    """The plan fields ``make_key(model, plan, training)`` reads, found by giving it a plan
    that records what is read (the key's builders read their fields unconditionally), so
    the memo of :meth:`_PlanContext.key` follows the key's definition by construction."""

    class Reader:
        def __init__(self) -> None:
            self.names: list[str] = []

        def __getattr__(self, name: str):
            self.names.append(name)
            return getattr(_DEFAULT_PLAN, name)

    reader = Reader()
    make_key(model, reader, training)
    return tuple(dict.fromkeys(reader.names))


_DEFAULT_PLAN = ParallelPlan()


_CONTEXTS: dict[tuple[int, ...], _PlanContext] = {}


def _context(model, training, hardware, cluster) -> _PlanContext:
    """The context of these specs, by identity (the context holds them, so their ids stay
    theirs); a few recent ones are kept."""
    ids = (id(model), id(training), id(hardware), id(cluster))
    ctx = _CONTEXTS.get(ids)
    if ctx is None:
        if len(_CONTEXTS) >= 16:
            _CONTEXTS.clear()
        ctx = _CONTEXTS[ids] = _PlanContext(model, training, hardware, cluster)
    return ctx


def evaluate_plan(
    model: ModelSpec,
    training: TrainingSpec,
    plan: ParallelPlan,
    num_gpus: int | None = None,
    *,
    hardware: HardwareSpec | None = None,
    cluster: ClusterSpec | None = None,
    timing: str = "roofline",
) -> dict[str, float]:
    """Every cost of one validated plan as floats, named as the result columns are
    (``mem_total_bytes``, ``model_flops``, ``step_s``, ``mfu``, ``comm_dp_bytes``, ...), plus
    the detail outputs that have no column (``comm_<kind>_<group>`` per communicator,
    ``stage_*`` per pipeline stage). Without hardware and cluster, time outputs are NaN.
    ``timing="measured"``: kernels from the hardware's measured tables (``measured_share``)."""
    validate_plan(model, training, plan, num_gpus)
    if hardware is None or cluster is None:
        hardware = cluster = None
    else:
        check_fits_cluster(plan, cluster)
    ctx = _context(model, training, hardware, cluster)
    x = ctx.row(plan)
    if timing == "measured" and hardware is not None:
        from stage_dse.cost.measured import MeasuredFamily
        from stage_dse.kernels.tables import load_tables, table_set

        gpu = table_set(hardware)
        tables = load_tables(gpu) if gpu else None
        family = MeasuredFamily(ctx.key(plan), 1, tables)
    elif timing not in ("roofline", "measured"):
        raise ConfigError(f"timing={timing!r} is not one of: roofline, measured")
    else:
        family = ctx.family(plan)
    return named_outputs(family.names, family.row(x))
