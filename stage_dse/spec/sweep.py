"""What a sweep covers, as domain specs: plan search spaces, training and serving sweeps, and
Optuna search settings.

These are built from configuration by :mod:`stage_dse.config` and handed to the search and
runner layers, which read no configuration files themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from stage_dse.errors import ConfigError
from stage_dse.spec._validate import MAX_GPUS, one_of, positive_int, positive_number
from stage_dse.spec.engine import EngineSpec
from stage_dse.spec.framework import FrameworkSpec
from stage_dse.spec.hardware import ClusterSpec, HardwareSpec
from stage_dse.spec.model import ModelSpec
from stage_dse.spec.plan import (
    ONE_CHUNK_SCHEDULES,
    USER_AXES,
    AttentionKernel,
    cuda_graphs_label,
    parse_cuda_graphs,
    parse_recompute,
)
from stage_dse.spec.stages import normalize_stage_layers
from stage_dse.spec.training import TrainingSpec, check_gemm_dtype

__all__ = [
    "OBJECTIVES",
    "OptunaSpec",
    "SearchSpace",
    "ServingJob",
    "ServingSweepSpec",
    "SweepSpec",
    "divisors",
]

Axis = Sequence[int] | str
GIB = 2.0**30
OBJECTIVES = ("step_s", "gpu_seconds", "num_gpus", "mem_total_bytes")
"""Result columns an Optuna search can minimize (``gpu_seconds`` = step_s x num_gpus)."""
SAMPLERS = ("tpe", "nsga2", "random")


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending, by trial division up to its square root."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Values each plan axis may take. Degrees accept ``"auto"``: every divisor of the GPU count."""

    tp: Axis = "auto"
    pp: Axis = "auto"
    cp: Axis = (1,)
    ep: Axis = (1,)
    """Expert-parallel sizes (MoE models); ``"auto"``: every divisor of the expert count."""
    expert_tensor_parallel: Sequence[bool] = (False,)
    ep_over_tp: Sequence[bool] = (False,)
    """Expert groups over the tensor-parallel ranks too (``ParallelPlan.ep_over_tp``)."""
    micro_batch_size: Sequence[int] = (1, 2, 4, 8)
    zero_stage: Sequence[int] = (0, 1, 2, 3)
    shard_group: Sequence[int] = (0,)
    """Data-parallel ranks a ZeRO/FSDP sharding group spans (hybrid sharding: the
    ``dp / shard_group`` groups are replicas, ``ParallelPlan.dp_replicate``); 0: all of them.
    A size above 0 applies to plans with ZeRO whose ``dp`` it divides into two or more groups."""
    recompute: Sequence[str] = ("none", "selective", "full")  # also "op"
    sequence_parallel: Sequence[bool] = (False, True)
    attention: Sequence[str] = ("flash",)
    virtual_stages: Sequence[int] = (1,)
    """1 means the 1F1B schedule; v > 1 the interleaved schedule with v chunks."""
    schedule: Sequence[str] = ("1f1b",)
    """Pipeline schedules (:class:`~stage_dse.spec.plan.PipelineSchedule`): ``1f1b`` (the
    interleaved one where ``virtual_stages > 1``), ``zb1p`` and ``dualpipe``, the last two
    with one chunk per stage (DualPipe: an even ``pp`` and number of micro-batches)."""
    stage_layers: Sequence[str] = ("balanced",)
    """Layer splits over pipeline stages (:mod:`stage_dse.spec.stages`): ``balanced``,
    ``ceil`` or explicit lists of layers per virtual stage."""
    rank_order: Sequence[str] = ("tp-cp-ep-dp-pp",)
    offload_layers: Sequence[int] = (0,)
    """Layers whose activations go to host memory (``ParallelPlan.offload_layers``); above 0
    only with pp = 1 and no recompute, below the layer count."""
    cuda_graphs: Sequence[str] = ("none",)
    """What each plan captures in CUDA graphs (``ParallelPlan.cuda_graphs``): ``none``,
    modules joined by ``+`` (``attn+moe_router+moe_preprocess``) or ``full_iteration``."""
    frameworks: Sequence[FrameworkSpec] = (FrameworkSpec(),)
    """The frameworks every plan is evaluated under (:mod:`stage_dse.spec.framework`): one
    row per plan and framework; each sets its plan flags (overlaps, per-tensor ZeRO-3) and
    gradient precision."""

    def __post_init__(self) -> None:
        if not self.frameworks:
            raise ConfigError("plan.framework must list at least one framework profile")
        for fw in self.frameworks:
            if not isinstance(fw, FrameworkSpec):
                raise ConfigError(f"plan.framework: {fw!r} is not a framework profile")
        names = [fw.name for fw in self.frameworks]
        if len(set(names)) != len(names):
            raise ConfigError(f"plan.framework lists {names}: each profile at most once")
        object.__setattr__(self, "frameworks", tuple(self.frameworks))
        for name in ("tp", "pp", "cp", "ep"):
            v = getattr(self, name)
            if isinstance(v, str):
                if v != "auto":
                    raise ConfigError(f"plan.{name}={v!r}: give a list of integers or 'auto'")
            else:
                _positive_list(name, v)
        for name in ("micro_batch_size", "virtual_stages"):
            _positive_list(name, getattr(self, name))
        if not self.offload_layers:
            raise ConfigError("plan.offload_layers must list at least one value")
        for k in self.offload_layers:
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ConfigError(f"plan.offload_layers values must be integers >= 0, got {k!r}")
        if not self.schedule or any(s not in ONE_CHUNK_SCHEDULES for s in self.schedule):
            raise ConfigError(
                f"plan.schedule={list(self.schedule)!r}: list one or more of "
                f"{', '.join(ONE_CHUNK_SCHEDULES)} (interleaved: 1f1b with virtual_stages > 1)"
            )
        if not self.cuda_graphs:
            raise ConfigError("plan.cuda_graphs must list at least one choice (none: eager)")
        graphs = (cuda_graphs_label(parse_cuda_graphs(g)) for g in self.cuda_graphs)
        object.__setattr__(self, "cuda_graphs", tuple(dict.fromkeys(graphs)))
        if not self.stage_layers:
            raise ConfigError("plan.stage_layers must list at least one split")
        splits = tuple(dict.fromkeys(normalize_stage_layers(s) for s in self.stage_layers))
        object.__setattr__(self, "stage_layers", splits)
        for z in self.zero_stage:
            if z not in (0, 1, 2, 3):
                raise ConfigError(f"plan.zero_stage={z!r} is not one of: 0, 1, 2, 3")
        if not self.shard_group:
            raise ConfigError("plan.shard_group must list at least one size (0: all dp ranks)")
        for g in self.shard_group:
            if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                raise ConfigError(
                    f"plan.shard_group values must be integers >= 0 (0: shard over all dp "
                    f"ranks), got {g!r}"
                )
        object.__setattr__(self, "shard_group", tuple(sorted(set(self.shard_group))))
        labels = []
        for r in self.recompute:
            if not isinstance(r, str):
                raise ConfigError(f"plan.recompute={r!r} is not one of: none, selective, full, op")
            try:
                labels.append(parse_recompute(r).label)
            except ConfigError as exc:
                raise ConfigError(
                    f"{exc} (plan.recompute values: none, selective, full, op, "
                    "selective:<module>+<module> or full:<layers per chunk>)"
                ) from None
        object.__setattr__(self, "recompute", tuple(dict.fromkeys(labels)))
        for a in self.attention:
            if a not in {m.value for m in AttentionKernel}:
                raise ConfigError(
                    f"plan.attention={a!r} is not one of: "
                    + ", ".join(m.value for m in AttentionKernel)
                )
        for order in self.rank_order:
            parts = str(order).split("-")
            if sorted(parts) != sorted(m.value for m in USER_AXES):
                raise ConfigError(
                    f"plan.rank_order={order} must name each of tp, cp, ep, dp, pp exactly once"
                )

    def degrees(self, name: str, num_gpus: int) -> list[int]:
        v = getattr(self, name)
        return divisors(num_gpus) if isinstance(v, str) else sorted(set(v))


def _positive_list(name: str, values: Sequence[int]) -> None:
    if not values:
        raise ConfigError(f"plan.{name} must list at least one value")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
            raise ConfigError(f"plan.{name} values must be integers > 0, got {x!r}")


@dataclass(frozen=True, kw_only=True)
class SweepSpec:
    """One inner sweep: models x hardware x GPU counts x plan space, on one cluster design."""

    name: str
    models: tuple[ModelSpec, ...]
    training: TrainingSpec
    hardware: tuple[HardwareSpec, ...]
    cluster: ClusterSpec
    gpu_counts: tuple[int, ...]
    space: SearchSpace
    memory_limit_bytes: float | None = None
    """Budget mode: usable memory per GPU replaces the hardware's."""
    timing: str = "roofline"
    """``roofline``, or ``measured`` (kernels from measured tables, :mod:`stage_dse.kernels`)."""

    def __post_init__(self) -> None:
        if self.timing not in ("roofline", "measured"):
            raise ConfigError(f"timing={self.timing!r} is not one of: roofline, measured")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"sweep_name={self.name!r} must be a plain folder name")
        if not self.gpu_counts:
            raise ConfigError("num_gpus must list at least one GPU count")
        for n in self.gpu_counts:
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ConfigError(f"num_gpus values must be integers > 0, got {n!r}")
            positive_int("sweep", "num_gpus", n, MAX_GPUS)
            per_node = self.cluster.gpus_per_node
            if n > per_node and n % per_node:
                raise ConfigError(
                    f"num_gpus({n}) is not a multiple of cluster.gpus_per_node({per_node})"
                )
        for hw in self.hardware:
            check_gemm_dtype(self.training, hw)
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ConfigError(
                f"budget.memory_gib must be > 0, got {self.memory_limit_bytes / GIB:g}"
            )


@dataclass(frozen=True, kw_only=True)
class OptunaSpec:
    """Settings of an Optuna search over a sweep's space (``search.kind=optuna``)."""

    n_trials: int = 1000
    batch_size: int = 64
    """Trials asked, screened and evaluated together: each batch is one round of results the
    sampler learns from (1,000 trials in batches of 64 are 16 rounds)."""
    sampler: str = "tpe"
    objectives: tuple[str, ...] = ("step_s",)
    seed: int = 0
    gpus: tuple[int, ...] = ()
    """GPU counts to choose from (empty: the sweep's)."""
    hardware: tuple[HardwareSpec, ...] = ()
    """Further hardware to choose from, beside the sweep's."""
    hbm_gib: tuple[float, ...] = ()
    """Co-design axis: HBM capacity per GPU in GiB, as sampled (empty: the hardware's)."""
    inter_gbit_s: tuple[float, ...] = ()
    """Co-design axis: scale-out bandwidth per GPU in Gbit/s (empty: the cluster's)."""

    def __post_init__(self) -> None:
        for name in self.objectives:
            if name not in OBJECTIVES:
                raise ConfigError(
                    f"search.objectives: {name!r} is not one of: {', '.join(OBJECTIVES)}"
                )
        if self.n_trials <= 0 or self.batch_size <= 0:
            raise ConfigError("search.n_trials and search.batch_size must be > 0")
        one_of("search", "sampler", self.sampler, SAMPLERS)


@dataclass(frozen=True, kw_only=True)
class ServingSweepSpec:
    name: str
    model: ModelSpec
    hardware: tuple[HardwareSpec, ...]
    cluster: ClusterSpec
    tp: Sequence[int] | str = "auto"
    pp: Sequence[int] = (1,)
    ep: Sequence[int] = (1,)
    """Expert-parallel sizes (MoE models): attention runs data-parallel over the ep ranks."""
    batch_sizes: Sequence[int] = (1, 8, 32, 128)
    prompt_lens: Sequence[int] = (2048,)
    output_tokens: int = 256
    kv_dtype: str = "bf16"
    weights_dtype: str = "bf16"
    moe_routing: str = "power_law_1.01"
    """Mixture-of-experts models: ``ServingSpec.moe_routing``."""
    moe_dispatch: str = "allgather"
    """Mixture-of-experts models: ``ServingSpec.moe_dispatch``."""
    mode: str = "static"
    """``static`` (a batch prefilled, then decoded together) or ``continuous`` (iteration-level
    batching with chunked prefill: ``batch_sizes`` are the most running requests)."""
    prefill_budgets: Sequence[int] = (2048,)
    """Continuous batching: prompt tokens per engine step (the chunk); 0: the engine's default
    on each GPU (``EngineSpec.for_hardware``)."""
    arrival_rate: float = 0.0
    """Continuous batching: requests/s offered to each replica (0: saturated)."""
    draft_tokens: int = 0
    """Continuous batching: tokens drafted per decode step (speculative decoding / MTP)."""
    acceptance: float = 0.0
    """Continuous batching: probability that a drafted token is accepted."""
    request_mix: tuple[tuple[int, int, float], ...] = ()
    """Continuous batching: request classes ``(prompt, output_tokens, weight)`` replacing
    ``prompt_lens`` and ``output_tokens`` (empty: every request has those lengths)."""
    engine: EngineSpec = field(default_factory=EngineSpec)
    """The inference engine's per-iteration costs (:mod:`stage_dse.spec.engine`)."""
    clients: int = 0
    """Continuous batching: a closed loop of this many users per replica (0: none)."""
    burst: int = 0
    """Continuous batching: this many requests sent at once to each replica (0: none)."""
    output_lengths: str = "fixed"
    """Continuous batching: ``fixed`` (every request decodes ``output_tokens``) or
    ``exponential`` (spread with that mean, see
    :func:`stage_dse.cost.requests.output_length_classes`)."""
    max_total_tokens: int = 0
    """Continuous batching: exponential output lengths keep prompt plus output within this
    (0: no cap; 2,048 is vLLM's ShareGPT sampler's)."""


@dataclass(frozen=True, kw_only=True)
class ServingJob:
    """One serving job: the sweep's space and everything asked of it, handed whole to
    :func:`stage_dse.runner.serving_job.run_serving_job`.

    ``mode="sweep"`` evaluates and stores every configuration of ``sweep``, ranks the top
    ``top_k``, takes the front within the latency targets when one is given and, when both
    targets and ``target_requests_per_s`` are given, recommends deployments too;
    ``mode="recommend"`` only recommends (both targets and a rate are then required)."""

    sweep: ServingSweepSpec
    mode: str = "sweep"
    timing: str = "roofline"
    """``roofline`` or ``measured`` (kernel tables where they reach), for every row."""
    ttft_sla_ms: float | None = None
    """Time to first token target (None: no target)."""
    tpot_sla_ms: float | None = None
    """Time per output token target (None: no target)."""
    target_requests_per_s: float = 0.0
    """Recommend: the request rate to serve (0: no recommendation after a sweep)."""
    top_k: int = 10
    max_running: int | None = None
    """Recommend: running requests per attention rank at most (None: the engine's cap);
    set when ``serving.batch_size`` was stated."""
    prefill_hardware: HardwareSpec | None = None
    """Recommend: the GPU of the disaggregated prefill pool (None: each hardware's own)."""
    kv_link: str = "nic"
    """Recommend: ``nic`` or ``nvlink``, the link the KV cache crosses to the decode pool."""

    def __post_init__(self) -> None:
        if self.mode not in ("sweep", "recommend"):
            raise ConfigError(f"mode={self.mode!r}: a serving job is a sweep or a recommend")
        if self.timing not in ("roofline", "measured"):
            raise ConfigError(f"timing={self.timing!r} is not one of: roofline, measured")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name.replace("_ms", "_sla_ms"))
            if value is not None:
                positive_number("serving.sla", name, value)
        top_k = self.top_k
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(
                f"top_k must be an integer >= 1 (rows of the top table), got {top_k!r}"
            )
        if not self.target_requests_per_s >= 0:
            raise ConfigError(
                f"serving.target_requests_per_s must be >= 0, got {self.target_requests_per_s}"
            )
        if self.mode == "recommend":
            if not (self.ttft_sla_ms and self.tpot_sla_ms):
                raise ConfigError(
                    "mode=recommend needs serving.sla.ttft_ms and serving.sla.tpot_ms"
                )
            if not self.target_requests_per_s > 0:
                raise ConfigError(
                    "mode=recommend needs serving.target_requests_per_s > 0, got "
                    f"{self.target_requests_per_s}"
                )

    @property
    def recommends(self) -> bool:
        """Whether the job answers with deployments: ``mode="recommend"``, or a sweep given
        both latency targets and a request rate."""
        return bool(
            self.mode == "recommend"
            or (self.target_requests_per_s and self.ttft_sla_ms and self.tpot_sla_ms)
        )
