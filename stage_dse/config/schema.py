"""Structured-config schemas registered in Hydra's ConfigStore, and their conversion to specs.

This module is the only place that sees a ``DictConfig``. The YAML files under ``conf/`` (and
the experiments under ``sweeps/``) are validated against these dataclasses by Hydra (types),
then :func:`to_sweep` turns the composed config into domain specs (values and relations),
raising :class:`stage_dse.errors.ConfigError` with the field name on bad input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from stage_dse.config.presets import (
    cluster_from_dict,
    hardware_from_dict,
    load_engine,
    load_hardware,
)
from stage_dse.config.space import (
    budget_gpu_counts,
    check_explicit_degrees,
    to_search_space,
    training_step,
)
from stage_dse.config.space import spec_from as _spec
from stage_dse.errors import ConfigError
from stage_dse.spec import (
    ModelSpec,
    OptunaSpec,
    ServingJob,
    ServingSweepSpec,
    SweepSpec,
)
from stage_dse.spec._validate import MAX_GPUS

__all__ = [
    "Config",
    "register_schemas",
    "to_optuna",
    "to_search_space",
    "to_serving_job",
    "to_serving_sweep",
    "to_sweep",
]


@dataclass
class ModelConf:
    name: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_heads: int = MISSING
    vocab_size: int = MISSING
    num_kv_heads: int = 0
    head_dim: int = 0
    norm: str = "layernorm"
    mlp: str = "gelu"
    position: str = "learned"
    max_positions: int = 0
    tied_embeddings: bool = True
    bias: bool = True
    dropout: bool = True
    num_experts: int = 0
    top_k: int = 0
    moe_ffn_hidden_size: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    moe_layer_interval: int = 1
    capacity_factor: float = 1.0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    full_attention_interval: int = 0
    attention_chunk_size: int = 0
    sparse_attention_topk: int = 0
    indexer_heads: int = 0
    indexer_head_dim: int = 0
    mtp_layers: int = 0
    parallel_block: bool = False


@dataclass
class HardwareConf:
    name: str = MISSING
    peak_bf16_tflops: float = MISSING
    peak_fp8_tflops: float = 0.0
    """Dense FP8 tensor-core peak (0: none)."""
    peak_fp4_tflops: float = 0.0
    """Dense FP4 tensor-core peak (0: none; 4-bit weights run weight-only there, W4A16)."""
    sustained_clock: float = 1.0
    """Sustained tensor-core clock under the power limit, fraction of the datasheet's."""
    measured_efficiency: float = 1.0
    """timing=measured, training: share of an isolated measured kernel's throughput in a step."""
    hbm_gib: float = MISSING
    hbm_tb_s: float = MISSING
    memory_reserve_gib: float = 2.0
    gemm_efficiency: float = 0.75
    fp8_gemm_efficiency: float = 0.0
    """Large FP8 GEMMs' fraction of the FP8 peak (0: 0.8 x gemm_efficiency)."""
    fp8_step_efficiency: float = 1.0
    """Training: share of fp8_gemm_efficiency FP8 GEMMs reach inside a step (serving keeps 1)."""
    fp4_gemm_efficiency: float = 0.0
    """Large FP4 GEMMs' fraction of the FP4 peak (0: 0.6 x gemm_efficiency)."""
    w4a16_moe_efficiency: float = 0.0
    """Large W4A16 grouped expert GEMMs' fraction of the bf16 peak (0: gemm_efficiency)."""
    gemm_half_dim: float = 128.0
    fp8_gemm_half_dim: float = 0.0
    """Smallest FP8 GEMM dimension at which FP8 GEMM efficiency halves (0: gemm_half_dim)."""
    fp4_gemm_half_dim: float = 0.0
    """The same for FP4 GEMMs (0: fp8_gemm_half_dim)."""
    attention_efficiency: float = 0.6
    attention_half_dim: float = 0.0
    """Head dimension at which softmax costs attention its tensor-core work (0: none)."""
    fp8_attention_speedup: float = 1.0
    """Prefill attention on an FP8 KV cache over the 16-bit kernel, where an engine runs it in
    FP8 (conf/engine/trtllm.yaml); 1: no faster."""
    memory_efficiency: float = 0.8
    kernel_launch_us: float = 0.0
    host_op_us: float = 40.0
    overlap_slowdown: float = 0.0
    gemm_floor_us: float = 0.0
    attention_floor_us: float = 0.0
    elementwise_floor_us: float = 0.0
    moe_layer_latency_us: float = 0.0
    """Routed-expert layer latency beyond its kernels' floors, us (measured fused-MoE tables)."""
    host_gb_s: float = 64.0
    """GPU-host link per GPU and direction, GB/s (activation offload; PCIe Gen5 x16: 64)."""
    rowwise_gemm_speed: float = 1.0
    """Row-wise-scaled FP8 GEMM throughput over the per-tensor one (fp8_recipe=rowwise)."""
    mxfp8_gemm_speed: float = 0.0
    """MXFP8 GEMM throughput over per-tensor FP8 (0: no block-scaled tensor cores)."""
    measured_gpu: str = ""
    """timing=measured: table set of measured kernels (empty: by preset name; none: no tables)."""


@dataclass
class ClusterConf:
    name: str = MISSING
    num_gpus: int = MISSING
    gpus_per_node: int = MISSING
    intra_gb_s: float = MISSING
    inter_gbit_s: float = MISSING
    intra_latency_us: float = 3.0
    inter_latency_us: float = 14.0
    collective_base_latency_us: float = 0.0
    oneshot_latency_us: float = 0.0
    ll_intra_latency_us: float = 0.0
    ll_inter_latency_us: float = 0.0
    ll_base_latency_us: float = 0.0
    intra_efficiency: float = 0.8
    inter_efficiency: float = 0.9
    pod_gpus: int = 0
    oversubscription: float = 1.0


@dataclass
class TrainingConf:
    seq_len: int = 4096
    global_batch_size: int = 256
    params_dtype: str = "bf16"
    grads_dtype: str | None = None
    """Gradient buffers and their reduction; null: the framework's (fp32 under Megatron-Core,
    torchtitan, Composer), bf16 where the framework does not fix it."""
    master_dtype: str = "fp32"
    optimizer: str = "adam"
    optimizer_state_dtype: str = "fp32"
    gemm_dtype: str = "bf16"
    """bf16, fp8 or nvfp4 (FP4 tensor cores, NVFP4 block scales): precision of the linear
    layers' GEMMs and of the activations they keep."""
    fp8_recipe: str = "tensorwise"
    """FP8 scaling: tensorwise, rowwise, rowwise_gw_hp or mxfp8 (only with gemm_dtype=fp8)."""


@dataclass
class PlanConf:
    """Search space over plans; degrees take a list or ``auto`` (every divisor)."""

    tp: Any = "auto"
    pp: Any = "auto"
    cp: Any = field(default_factory=lambda: [1])
    ep: Any = field(default_factory=lambda: [1])
    """Expert-parallel sizes (MoE models): a list or ``auto`` (divisors of the expert count).
    With ``cp`` > 1 an expert group holds whole context-parallel groups (ep a multiple of cp)."""
    expert_tensor_parallel: list[bool] = field(default_factory=lambda: [False])
    ep_over_tp: list[bool] = field(default_factory=lambda: [False])
    """Expert-parallel groups that span the tensor-parallel ranks too (ep may exceed dp)."""
    micro_batch_size: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    zero_stage: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    shard_group: list[int] = field(default_factory=lambda: [0])
    """Data-parallel ranks a ZeRO/FSDP sharding group spans, replicas across groups (hybrid
    sharding, e.g. 8: shard inside a node); 0: all data-parallel ranks."""
    recompute: list[str] = field(default_factory=lambda: ["none", "selective", "full"])
    sequence_parallel: list[bool] = field(default_factory=lambda: [False, True])
    attention: list[str] = field(default_factory=lambda: ["flash"])
    virtual_stages: list[int] = field(default_factory=lambda: [1])
    schedule: list[str] = field(default_factory=lambda: ["1f1b"])
    """Pipeline schedules: 1f1b (interleaved where virtual_stages > 1), zb1p (zero bubble) and
    dualpipe (DeepSeek-V3; even pp); the last two with virtual_stages 1."""
    stage_layers: list[Any] = field(default_factory=lambda: ["balanced"])
    """Layer splits over pipeline stages: balanced, ceil, or lists of layers per virtual stage."""
    rank_order: list[str] = field(default_factory=lambda: ["tp-cp-ep-dp-pp"])
    offload_layers: list[int] = field(default_factory=lambda: [0])
    """Layers whose activations are offloaded to host memory (0: none; pp = 1, no recompute)."""
    cuda_graphs: list[str] = field(default_factory=lambda: ["none"])
    """What plans capture in CUDA graphs: none, modules joined by '+' (attn, mlp, moe_router,
    moe_preprocess) or full_iteration; the rest is issued op by op from the host."""
    framework: Any = field(default_factory=lambda: ["megatron_core"])
    """Framework profiles (``conf/framework/``) every plan is evaluated under: a name or a
    list of names, one row per plan and framework."""
    overlap_grad_reduce: bool | None = None
    """This and the flags below force a framework behaviour for every framework of the sweep
    (null: each framework's own; the row's framework is then named with the change)."""
    overlap_param_gather: bool | None = None
    tp_comm_overlap: bool | None = None
    tp_dgrad_overlap: bool | None = None
    ep_comm_overlap: bool | None = None


@dataclass
class SearchConf:
    kind: str = "grid"
    """grid: every valid plan; optuna: sample the space (see the optuna preset)."""
    n_trials: int = 1000
    batch_size: int = 64
    sampler: str = "tpe"
    objectives: list[str] = field(default_factory=lambda: ["step_s"])
    seed: int = 0
    gpus: list[int] = field(default_factory=list)
    """Optuna: GPU counts to choose from (default: num_gpus)."""
    hardware: list[str] = field(default_factory=list)
    """Optuna: hardware presets to choose from (default: the hardware group)."""
    hbm_gib: list[float] = field(default_factory=list)
    """Optuna co-design axis: HBM capacity per GPU (empty: the hardware's)."""
    inter_gbit_s: list[float] = field(default_factory=list)
    """Optuna co-design axis: scale-out bandwidth per GPU (empty: the cluster's)."""


@dataclass
class RunnerConf:
    kind: str = "auto"
    address: str | None = None
    """None: start an embedded local Ray; "host:port", "auto" or "ray://host:port": join a
    cluster (token authentication: RAY_AUTH_MODE=token in the environment)."""
    connect_timeout_s: float = 10.0
    """Joining a cluster fails with one line when it has not answered within this time."""
    num_cpus: int | None = None
    batch_size: int = 20000
    progress: bool = True


@dataclass
class SlaConf:
    """Latency targets of a serving deployment (null: no target)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


@dataclass
class ServingConf:
    """Serving sweep (``workload=serving``): tp/pp per replica, batches, prompt lengths."""

    tp: Any = "auto"
    pp: list[int] = field(default_factory=lambda: [1])
    ep: list[int] = field(default_factory=lambda: [1])
    """Expert parallelism (MoE): attention data-parallel over the ep ranks, experts split."""
    batch_size: list[int] = field(default_factory=lambda: [1, 8, 32, 128])
    prompt_len: list[int] = field(default_factory=lambda: [2048])
    output_tokens: int = 256
    kv_dtype: str = "bf16"
    weights_dtype: str = "bf16"
    moe_routing: str = "power_law_1.01"
    """Mixture-of-experts models: how tokens spread over experts (balanced, power_law_1.01,
    power_law_1.2); the busiest expert-parallel rank sets each layer's expert time."""
    moe_dispatch: str = "allgather"
    """Mixture-of-experts models: how expert-parallel ranks exchange tokens (allgather: every
    token to every rank, engines' default; alltoall: to the ranks holding its experts, DeepEP)."""
    hardware: list[str] = field(default_factory=list)
    """Hardware presets to compare (default: the hardware group)."""
    phase: str = "decode"
    """The pass ``stage-dse-trace config`` writes: ``decode`` (steps) or ``prefill``."""
    mode: str = "static"
    """static (batch prefilled then decoded) or continuous (iteration-level batching with
    chunked prefill; batch_size lists the most running requests of a replica, over its pp
    batches in flight)."""
    prefill_budget: list[int] = field(default_factory=list)
    """Continuous batching: prompt tokens per engine step (empty: the engine's default on each
    GPU, e.g. vLLM's 8,192 on an H100 and 2,048 on an A100; 2,048 with no engine)."""
    arrival_rate: float = 0.0
    """Continuous batching: requests/s per replica (0: saturated, no queueing)."""
    draft_tokens: int = 0
    """Continuous batching: speculative decoding, tokens drafted per step (MTP: 1)."""
    acceptance: float = 0.0
    """Continuous batching: acceptance rate of a drafted token, in [0, 1)."""
    sla: SlaConf = field(default_factory=lambda: SlaConf())
    target_requests_per_s: float = 0.0
    """mode=recommend: the request rate to serve."""
    request_mix: list[Any] = field(default_factory=list)
    """Continuous batching: [[prompt, output_tokens, weight], ...] request classes."""
    prefill_hardware: str = ""
    """mode=recommend: the GPU of the disaggregated prefill pool (default: the hardware's)."""
    kv_link: str = "nic"
    """mode=recommend: nic or nvlink, the link the KV cache crosses from prefill to decode."""
    engine: str = "none"
    """The inference engine profile (conf/engine/: none, trtllm, vllm, sglang): its costs per
    iteration and per running request."""
    clients: int = 0
    """Continuous batching: a closed loop of N users per replica (0: open loop or saturated)."""
    burst: int = 0
    """Continuous batching: N requests sent at once to each replica (0: none)."""
    output_lengths: str = "fixed"
    """Continuous batching: fixed, or exponential (output lengths spread with the mean
    output_tokens, as replies sampled from a chat dataset are)."""
    max_total_tokens: int = 0
    """Continuous batching, exponential output lengths: prompt plus output at most this (0: no
    cap; vLLM's ShareGPT sampler keeps pairs within 2048)."""


@dataclass
class BudgetConf:
    memory_gib: float | None = None
    max_gpus: int | None = None
    rank_by: str = "step_s"
    """step_s (fastest) or gpu_seconds (cheapest: GPUs x step time)."""


@dataclass
class Config:
    model: ModelConf = MISSING
    hardware: HardwareConf = MISSING
    cluster: ClusterConf = MISSING
    training: TrainingConf = field(default_factory=TrainingConf)
    plan: PlanConf = field(default_factory=PlanConf)
    search: SearchConf = field(default_factory=SearchConf)
    runner: RunnerConf = field(default_factory=RunnerConf)
    budget: BudgetConf = field(default_factory=BudgetConf)
    serving: ServingConf = field(default_factory=ServingConf)
    workload: str = "training"
    """training (plan search over a training step) or serving (prefill/decode of a model)."""
    sweep_name: str = "default"
    results_dir: str = "results"
    replace_stale: bool = False
    """Delete result parts written by another hash scheme or cost model and evaluate their
    configurations again (default: refuse to resume over them)."""
    num_gpus: Any = field(default_factory=lambda: [64])
    """GPU counts to sweep: a list, or one count (``-m num_gpus=64,128``: a job per count)."""
    top_k: int = 10
    mode: str = "sweep"
    """sweep: evaluate and rank; budget: cheapest/fastest plans within budget.* limits."""
    timing: str = "roofline"
    """roofline (analytic kernels) or measured (kernel tables of aiconfigurator-core where a
    shape lies inside them, roofline elsewhere; needs the ``measured`` extra)."""


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="stage_dse_schema", node=Config)
    for group, node in (
        ("model", ModelConf),
        ("hardware", HardwareConf),
        ("cluster", ClusterConf),
        ("training", TrainingConf),
        ("plan", PlanConf),
        ("search", SearchConf),
        ("runner", RunnerConf),
    ):
        cs.store(group=group, name=f"{group}_schema", node=node)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def check_top_level(cfg: DictConfig) -> None:
    """Refuse keys the schema does not know (``+foo=1`` would otherwise be ignored silently)."""
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(k for k in cfg if k not in known and k != "hydra")
    if unknown:
        raise ConfigError(
            f"{unknown[0]} is not an option (top-level options: {', '.join(sorted(known))})"
        )


def to_sweep(cfg: DictConfig) -> SweepSpec:
    """The training sweep of one Hydra job, with the model-level plan checks done."""
    c = _plain(cfg)
    model = _spec("model", ModelSpec, c["model"])
    training, grads = training_step(c["training"])
    hardware = hardware_from_dict(c["hardware"])
    num_gpus = c["num_gpus"]
    if not isinstance(num_gpus, list | tuple):
        num_gpus = [num_gpus]  # one count, e.g. a job of -m num_gpus=64,128
    for n in num_gpus:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ConfigError(f"num_gpus values must be integers > 0, got {n!r}")
        if n > MAX_GPUS:
            raise ConfigError(f"num_gpus={n} is beyond {MAX_GPUS:,}, past physical sense")
    space = to_search_space(c["plan"])
    if grads is not None:  # a stated gradient precision holds under every framework
        space = dataclasses.replace(
            space, frameworks=[dataclasses.replace(f, grads_dtype=grads) for f in space.frameworks]
        )
    check_explicit_degrees(space, model, training)
    cluster_data = dict(c["cluster"])
    cluster_data["num_gpus"] = max(num_gpus) if num_gpus else cluster_data["num_gpus"]
    cluster = cluster_from_dict(cluster_data)
    budget = c["budget"]
    mem = budget.get("memory_gib")
    if c["mode"] not in ("sweep", "budget"):
        raise ConfigError(f"mode={c['mode']!r} is not one of: sweep, budget, recommend")
    if c["mode"] == "budget":
        if budget.get("max_gpus") is not None:
            if budget["max_gpus"] <= 0:
                raise ConfigError(f"budget.max_gpus must be > 0, got {budget['max_gpus']}")
            num_gpus = budget_gpu_counts(budget["max_gpus"], cluster.gpus_per_node)
            cluster = cluster.replace(num_gpus=max(num_gpus))
        if budget.get("rank_by") not in ("step_s", "gpu_seconds"):
            raise ConfigError(
                f"budget.rank_by={budget.get('rank_by')!r} is not one of: step_s, gpu_seconds"
            )
    spec = SweepSpec(
        name=c["sweep_name"],
        models=(model,),
        training=training,
        hardware=(hardware,),
        cluster=cluster,
        gpu_counts=tuple(num_gpus),
        space=space,
        memory_limit_bytes=None if mem is None else float(mem) * 2.0**30,
        timing=c.get("timing", "roofline"),
    )
    if spec.timing == "measured":
        from stage_dse.kernels.tables import load_tables, table_set

        gpu = table_set(hardware)
        if gpu is not None:
            load_tables(gpu)  # the extra and the table set checked before any work
    return spec


def to_optuna(cfg: DictConfig) -> OptunaSpec:
    """The Optuna settings of one Hydra job (``search.kind=optuna``), hardware presets loaded."""
    s = _plain(cfg)["search"]
    return OptunaSpec(
        n_trials=s["n_trials"],
        batch_size=s["batch_size"],
        sampler=s["sampler"],
        objectives=tuple(s["objectives"]),
        seed=s["seed"],
        gpus=tuple(s["gpus"]),
        hardware=tuple(load_hardware(name) for name in s["hardware"]),
        hbm_gib=tuple(float(x) for x in s["hbm_gib"]),
        inter_gbit_s=tuple(float(x) for x in s["inter_gbit_s"]),
    )


def to_serving_sweep(cfg: DictConfig) -> ServingSweepSpec:
    """The serving sweep of one Hydra job (``workload=serving``)."""
    c = _plain(cfg)
    model = _spec("model", ModelSpec, c["model"])
    sv = c["serving"]
    hardware = [hardware_from_dict(c["hardware"])]
    hardware += [load_hardware(name) for name in sv["hardware"] if name != hardware[0].name]
    cluster = cluster_from_dict(c["cluster"])
    tp = sv["tp"]
    if isinstance(tp, int) and not isinstance(tp, bool):
        tp = [tp]
    elif isinstance(tp, str) and tp != "auto":
        raise ConfigError(f"serving.tp={tp!r}: give an integer, a list of integers or 'auto'")
    for name in ("pp", "ep", "batch_size", "prompt_len", "prefill_budget"):
        values = sv[name] if isinstance(sv[name], list) else [sv[name]]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"serving.{name} values must be integers > 0, got {v!r}")
    mode = sv.get("mode", "static")
    if mode not in ("static", "continuous"):
        raise ConfigError(f"serving.mode={mode!r} is not one of: static, continuous")
    budgets = (
        sv["prefill_budget"] if isinstance(sv["prefill_budget"], list) else [sv["prefill_budget"]]
    )
    if isinstance(sv["draft_tokens"], bool) or not int(sv["draft_tokens"]) >= 0:
        raise ConfigError(f"serving.draft_tokens must be an integer >= 0, got {sv['draft_tokens']}")
    if not 0 <= float(sv["acceptance"]) < 1:
        raise ConfigError(f"serving.acceptance must be in [0, 1), got {sv['acceptance']}")
    mix = tuple(tuple(item) for item in sv.get("request_mix") or ())
    for item in mix:
        if len(item) != 3 or not (item[0] >= 1 and item[1] >= 1 and item[2] > 0):
            raise ConfigError(
                f"serving.request_mix: give [[prompt, output_tokens, weight], ...] with lengths "
                f">= 1 and weights > 0, got {list(item)}"
            )
    if mix and mode != "continuous" and c.get("mode") != "recommend":
        raise ConfigError("serving.request_mix needs serving.mode=continuous")
    if not float(sv["arrival_rate"]) >= 0:
        raise ConfigError(f"serving.arrival_rate must be >= 0, got {sv['arrival_rate']}")
    for key in ("clients", "burst"):
        v = sv.get(key, 0)
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise ConfigError(f"serving.{key} must be an integer >= 0, got {v!r}")
    loads = [k for k in ("arrival_rate", "clients", "burst") if float(sv.get(k, 0) or 0) > 0]
    if len(loads) > 1:
        raise ConfigError(
            f"serving: give one load, not {' and '.join(loads)} (set the others to 0)"
        )
    if loads and mode != "continuous":
        raise ConfigError(f"serving.{loads[0]} needs serving.mode=continuous")
    spread = str(sv.get("output_lengths", "fixed"))
    if spread not in ("fixed", "exponential"):
        raise ConfigError(f"serving.output_lengths must be fixed or exponential, got {spread!r}")
    if spread != "fixed" and mode != "continuous":
        raise ConfigError("serving.output_lengths=exponential needs serving.mode=continuous")
    cap = sv.get("max_total_tokens", 0)
    if not (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0):
        raise ConfigError(f"serving.max_total_tokens must be an integer >= 0, got {cap!r}")
    engine = load_engine(str(sv.get("engine", "none")))
    if not budgets:  # not stated: the engine's default token budget on each GPU
        budgets = [0] if engine.name != "none" else [2048]
    # serving rows never share a folder with training rows: the default name gets a suffix
    name = c["sweep_name"] if c["sweep_name"] != "default" else "default_serving"
    return ServingSweepSpec(
        name=name,
        model=model,
        hardware=tuple(hardware),
        cluster=cluster,
        tp=tp,
        pp=tuple(sv["pp"] if isinstance(sv["pp"], list) else [sv["pp"]]),
        ep=tuple(sv["ep"] if isinstance(sv["ep"], list) else [sv["ep"]]),
        batch_sizes=tuple(sv["batch_size"]),
        prompt_lens=tuple(sv["prompt_len"]),
        output_tokens=sv["output_tokens"],
        kv_dtype=sv["kv_dtype"],
        weights_dtype=sv["weights_dtype"],
        moe_routing=str(sv.get("moe_routing", "power_law_1.01")),
        moe_dispatch=str(sv.get("moe_dispatch", "allgather")),
        mode=mode,
        prefill_budgets=tuple(budgets),
        arrival_rate=float(sv["arrival_rate"]),
        draft_tokens=int(sv["draft_tokens"]),
        acceptance=float(sv["acceptance"]),
        request_mix=mix,
        engine=engine,
        clients=int(sv.get("clients", 0)),
        burst=int(sv.get("burst", 0)),
        output_lengths=spread,
        max_total_tokens=int(cap),
    )


def to_serving_job(cfg: DictConfig) -> ServingJob:
    """A serving job (``workload=serving`` or ``mode=recommend``): the sweep and every option
    asked of it. ``serving.batch_size`` caps a recommendation's running requests only when
    stated (the static sweep's default states none: the engine's cap holds)."""
    c = _plain(cfg)
    sv, sla = c["serving"], c["serving"]["sla"]
    sweep = to_serving_sweep(cfg)
    stated = list(sweep.batch_sizes) != ServingConf().batch_size
    return ServingJob(
        sweep=sweep,
        mode="recommend" if c["mode"] == "recommend" else "sweep",
        timing=c.get("timing", "roofline"),
        ttft_sla_ms=sla["ttft_ms"],
        tpot_sla_ms=sla["tpot_ms"],
        target_requests_per_s=sv["target_requests_per_s"],
        top_k=c["top_k"],
        max_running=max(sweep.batch_sizes) if stated else None,
        prefill_hardware=load_hardware(sv["prefill_hardware"]) if sv["prefill_hardware"] else None,
        kv_link=sv["kv_link"],
    )
