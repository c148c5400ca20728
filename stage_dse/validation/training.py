"""Training cases of the corpus: their plans, evaluated together, against the published figures.

Each case becomes the plans its source allows: what the source states is fixed; every plan
choice it leaves ``unstated`` ranges over the record's ``candidates`` (or the defaults of
:data:`DEFAULT_CANDIDATES`). The rule for unstated choices is the one the authors of these
papers describe for themselves: **the fastest plan that fits in memory** among those
candidates. A framework profile (``conf/framework/``) sets what the framework does (fused or
materialized attention, which communication overlaps which compute); where it can recompute
part of each model chunk (``block_recompute``: Megatron-LM's block method), an unstated full
recompute is also tried on a quarter, half and three quarters of each chunk's layers.

All plans of all cases form one plan table, evaluated by one call of
:func:`stage_dse.cost.table.evaluate_table` (one compiled call per plan family). Every
published figure is turned into a step time (or a layer time) before comparing:

* ``iter_s``: the step time itself;
* ``tokens_per_s_per_gpu``: ``seq x global_batch / (gpus x value)``;
* ``tflops_per_gpu``: the source's flop count (:mod:`stage_dse.validation.conventions`) over
  ``gpus x value``; ``mfu_pct``: over ``gpus x peak x value / 100``;
* ``layer_fwd_ms`` / ``layer_bwd_ms``: one layer's forward / backward time.

The signed error is ``predicted / published - 1`` of that time: negative means the model is
too fast (optimistic). A case the model cannot express (a missing preset or feature, a layout
its rules refuse) is kept and reported with the reason.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from stage_dse.config import load_cluster, load_framework, load_hardware
from stage_dse.cost.table import evaluate_table, plan_row
from stage_dse.errors import ConfigError
from stage_dse.spec import DType, ModelSpec, ParallelPlan, TrainingSpec
from stage_dse.spec.framework import FrameworkSpec
from stage_dse.spec.hardware import even_domain_share
from stage_dse.spec.plan import (
    DEFAULT_RANK_ORDER,
    ONE_CHUNK_SCHEDULES,
    ep_fits_over_tp,
    parse_recompute,
)
from stage_dse.validation.conventions import flops_per_step
from stage_dse.validation.corpus import Case, CorpusError
from stage_dse.validation.resolve import (
    Unexpressible,
    case_model,
    check_expressible,
    result_base,
)

__all__ = ["DEFAULT_CANDIDATES", "TrainingSetup", "evaluate_training", "training_setup"]

PLAN_AXES = ("micro_batch", "virtual_stages", "recompute", "sequence_parallel", "zero", "tp",
             "pp", "cp", "ep", "attention")  # fmt: skip
"""Record fields that are plan choices (an unstated one ranges over candidates)."""

DEFAULT_CANDIDATES: dict[str, tuple] = {
    "micro_batch": (1, 2, 4, 8),
    "virtual_stages": (1, 2, 3, 4, 6, 8),
    "recompute": ("none", "selective", "full"),
    "sequence_parallel": (False, True),
    "zero": (0, 1, 2, 3),
}
"""Values an unstated plan choice takes when its record names none."""

ZERO_NAMES = {
    "fsdp_full_shard": 3,
    "fsdp_no_reshard": 2,
    "shard_grad_op": 2,
    "distributed_optimizer": 1,
}
"""Sharding names sources use -> ZeRO stage (FSDP without resharding after forward keeps the
gathered parameters for the step: stage 2's memory and one gather per step)."""


@dataclass
class TrainingSetup:
    """A case resolved into specs and the candidate plans the source allows."""

    model: ModelSpec
    hardware: object
    cluster: object
    training: TrainingSpec
    plans: list[ParallelPlan] = field(default_factory=list)
    rejected: str = ""
    """The first rule that refused a candidate (when none is valid: why)."""


def training_setup(case: Case) -> TrainingSetup:
    """Specs and candidate plans of a training case (``Unexpressible`` when the model has no
    way to state it; ``CorpusError`` when the record itself is wrong)."""
    f = case.fields
    label = f"{case.source.file}: run {case.id}"
    check_expressible(case)
    hw_name, cl_name = f["hardware"], f["cluster"]
    try:
        # the recipe's own switches where it states them (e.g. Megatron-Bridge's
        # overlap_moe_expert_parallel_comm), the profile's elsewhere
        framework = load_framework(f["framework"]).with_flags(**f.get("framework_flags", {}))
        if framework.compile_fuses_elementwise and f.get("torch_compile") is not None:
            # the run states torch.compile, which fuses this framework's element-wise ops
            framework = framework.with_flags(fused_elementwise=f["torch_compile"])
    except ConfigError as exc:
        raise CorpusError(f"{label}: framework: {exc}") from None
    model = case_model(case)
    try:
        hardware = load_hardware(hw_name, **f.get("hardware_overrides", {}))
        overrides = {**f.get("cluster_overrides", {}), "num_gpus": max(f["gpus"], 1)}
        if "gpus_per_node" in f:
            overrides["gpus_per_node"] = f["gpus_per_node"]
        domain = overrides.get("gpus_per_node", load_cluster(cl_name, num_gpus=1).gpus_per_node)
        even = 0 if "gpus_per_node" in f else even_domain_share(f["gpus"], domain)
        if even:  # placement unstated: equal parts of the fewest domains that hold the job
            overrides["gpus_per_node"] = domain = even
        if f["gpus"] > domain and f["gpus"] % domain:
            raise Unexpressible(
                f"gpus({f['gpus']}) is not a whole number of {cl_name}'s {domain}-GPU domains"
            )
        cluster = load_cluster(cl_name, **overrides)
    except ConfigError as exc:
        raise CorpusError(f"{label}: {exc}") from None
    if f.get("activation_cpu_offload") and not f.get("offload_layers"):
        raise Unexpressible("activation offload to host memory without a layer count")
    precision = f.get("precision", "bf16")
    if precision not in ("bf16", "fp16", "fp8", "nvfp4"):
        raise Unexpressible(
            f"precision {precision!r} (training GEMMs in bf16, fp16, fp8 or nvfp4 only)"
        )
    try:
        training = TrainingSpec(
            seq_len=f["seq_len"],
            global_batch_size=f["global_batch"],
            # the record's stated gradient precision, else the framework's, else 16-bit
            grads_dtype=f.get("grads") or framework.grads(DType.BF16),
            gemm_dtype=precision if precision in ("fp8", "nvfp4") else "bf16",
            fp8_recipe=f.get("fp8_recipe", "tensorwise"),
            optimizer_state_dtype=f.get("optimizer_states", DType.FP32),
            master_dtype=f.get("master", DType.FP32),
        )
    except ConfigError as exc:
        raise CorpusError(f"{label}: {exc}") from None
    for key in ("recompute", "zero"):
        value = f.get(key)
        if key == "recompute" and value is not None and not _is_recompute_label(value):
            raise Unexpressible(
                f"recompute {value!r} (none, selective, selective:<Megatron-Core modules>, full "
                "or op of every layer)"
            )
        if key == "zero" and isinstance(value, str) and value not in ZERO_NAMES:
            raise Unexpressible(f"sharding {value!r} (ZeRO 0-3, {', '.join(ZERO_NAMES)})")
    dp, group = f.get("dp"), f.get("shard_group")
    if group is not None and dp is not None and dp % group:
        raise Unexpressible(
            f"a shard group of {group} ranks that does not divide dp({dp}) (hybrid sharding "
            "replicates whole groups)"
        )
    axes = {}
    for name in PLAN_AXES:
        if name in case.candidates:
            axes[name] = case.candidates[name]
        elif name in case.unstated and name not in f:
            single = f.get("schedule") in ONE_CHUNK_SCHEDULES
            if name == "virtual_stages" and (f.get("pp", 1) == 1 or single):
                axes[name] = (1,)
            elif name == "virtual_stages" and f.get("schedule") == "interleaved":
                axes[name] = tuple(v for v in DEFAULT_CANDIDATES[name] if v > 1)
            elif name == "sequence_parallel" and f.get("tp", 1) == 1:
                axes[name] = (False,)
            elif name in DEFAULT_CANDIDATES:
                axes[name] = DEFAULT_CANDIDATES[name]
    setup = TrainingSetup(model, hardware, cluster, training)
    names = list(axes)
    # an unstated recompute that ranges over the defaults (not over the record's candidates)
    block = framework.block_recompute and axes.get("recompute") is DEFAULT_CANDIDATES["recompute"]
    for values in itertools.product(*(axes[n] for n in names)):
        choice = {**f, **dict(zip(names, values))}
        for variant in _block_recompute(choice, model.num_layers) if block else (choice,):
            try:
                plan = _plan(variant, framework, model)
                plan_row(model, training, plan, hardware, cluster)  # validates
            except (ConfigError, Unexpressible) as exc:
                setup.rejected = setup.rejected or str(exc)
                continue
            setup.plans.append(plan)
    return setup


def _block_recompute(choice: dict, layers: int) -> list[dict]:
    """An unstated full recompute, and block recompute of a quarter, half and three quarters
    of each model chunk's layers (``FrameworkSpec.block_recompute``)."""
    if choice["recompute"] != "full":
        return [choice]
    chunk = -(-layers // (choice.get("pp", 1) * choice.get("virtual_stages", 1)))
    counts = sorted({max(1, round(chunk * q)) for q in (0.25, 0.5, 0.75)} - {chunk})
    return [choice] + [{**choice, "recompute": f"full:{n}"} for n in counts]


def _plan(f: dict, framework: FrameworkSpec, model: ModelSpec) -> ParallelPlan:
    tp, pp, cp = f.get("tp", 1), f.get("pp", 1), f.get("cp", 1)
    gpus = f["gpus"]
    if gpus % (tp * pp * cp):
        raise ConfigError(f"tp({tp})*pp({pp})*cp({cp}) does not divide gpus({gpus})")
    dp = gpus // (tp * pp * cp)
    if f.get("dp", dp) != dp:
        raise ConfigError(f"dp({f['dp']}) != gpus({gpus}) / (tp*pp*cp) = {dp}")
    zero = f.get("zero", 0)
    zero = ZERO_NAMES.get(zero, zero) if isinstance(zero, str) else zero
    etp = f.get("etp")
    if etp not in (None, 1, tp):
        raise Unexpressible(f"expert tensor parallel etp({etp}) other than 1 or tp({tp})")
    ep = f.get("ep", 1)
    # experts not split by tensor parallelism: the expert groups span tp x data ranks, as
    # Megatron-Core lays them out whenever expert_tensor_parallel_size is 1, even where dp
    # alone could hold ep (megatron/core/parallel_state.py initialize_model_parallel: the
    # expert ranks come from the flattened tp x cp x dp ranks of a stage, expert data
    # parallel = world / (etp x ep x pp); "MoE parallel folding", Liu et al. 2025); with
    # cp > 1 the group holds whole context-parallel groups (ParallelPlan.ep_over_cp)
    fold = bool(model.is_moe and etp != tp and ep_fits_over_tp(ep, tp, dp, cp))
    if model.is_moe and etp == 1 and tp > 1 and ep > 1 and cp > 1 and not fold:
        raise Unexpressible(
            f"expert group of ep({ep}) over tp({tp}) x part of cp({cp}) (Megatron-Core's folding "
            "below tp x cp ranks; expert groups here hold whole context-parallel groups)"
        )
    v = f.get("virtual_stages", 1)
    flags = framework.plan_flags()
    if f.get("async_tp"):  # torchtitan's async TP: gathers / reduce-scatters pipelined with GEMMs
        flags["tp_comm_overlap"] = True
    return ParallelPlan(
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        expert_tensor_parallel=bool(model.is_moe and tp > 1 and etp == tp),
        ep_over_tp=fold,
        sequence_parallel=bool(f.get("sequence_parallel", False)),
        zero_stage=zero,
        micro_batch_size=f.get("micro_batch", 1),
        recompute=f.get("recompute", "none"),
        attention=f.get("attention", framework.attention),
        schedule="interleaved" if v > 1 else f.get("schedule", "1f1b"),
        virtual_stages=v,
        offload_layers=f.get("offload_layers", 0),
        cuda_graphs=f.get("cuda_graphs", "none"),
        stage_layers=str(f.get("stage_layers", "balanced")),
        rank_order=f.get("rank_order", DEFAULT_RANK_ORDER),
        # hybrid sharding: states sharded over shard_group ranks, replicated across groups
        dp_replicate=dp // f.get("shard_group", dp),
        **flags,
    )


def _is_recompute_label(value: object) -> bool:
    """Whether a record's recompute is a mode or a label refining one (``selective:<modules>``,
    ``full:<layers>``); whether the model has the modules, the plan's validation says."""
    try:
        parse_recompute(value)
    except ConfigError:
        return False
    return True


def published_seconds(case: Case, model: ModelSpec, hardware) -> float:
    """The published figure as a step time (or layer time), seconds."""
    f, v = case.fields, case.value
    kind = case.target_kind
    if kind == "iter_s":
        return v
    if kind in ("layer_fwd_ms", "layer_bwd_ms"):
        return v / 1e3
    if kind == "tokens_per_s_per_gpu":
        return f["seq_len"] * f["global_batch"] / (f["gpus"] * v)
    flops = flops_per_step(model, f["seq_len"], f["global_batch"], case.target["flops"])
    if kind == "tflops_per_gpu":
        return flops / (f["gpus"] * v * 1e12)
    peak = case.target.get("peak_tflops", hardware.peak_flops / 1e12) * 1e12
    return flops / (f["gpus"] * peak * v / 100)


TIME_COLUMN = {"layer_fwd_ms": "time_layer_fwd_s", "layer_bwd_ms": "time_layer_bwd_s"}


def plan_label(plan: ParallelPlan) -> str:
    parts = [f"dp{plan.dp}", f"tp{plan.tp}", f"pp{plan.pp}"]
    if plan.cp > 1:
        parts.append(f"cp{plan.cp}")
    if plan.ep > 1:
        over = [a for a, on in (("tp", plan.ep_over_tp), ("cp", plan.ep_over_cp)) if on]
        parts.append(f"ep{plan.ep}" + (f"(over {'+'.join(over)})" if over else ""))
    if plan.virtual_stages > 1:
        parts.append(f"v{plan.virtual_stages}")
    if plan.schedule.value in ("zb1p", "dualpipe"):
        parts.append(plan.schedule.value)
    parts.append(f"mb{plan.micro_batch_size}")
    parts.append(f"zero{plan.zero_stage}")
    if plan.hybrid_shard:
        parts.append(f"x{plan.dp_replicate} replicas")
    parts.append(plan.recompute_label)
    if plan.sequence_parallel:
        parts.append("sp")
    return " ".join(parts)


def build_table(cases: list[Case]) -> tuple[pd.DataFrame, dict[str, dict]]:
    """One plan table of every candidate plan of every case (column ``case``), and per case
    its setup or the reason it cannot be expressed."""
    rows, info = [], {}
    for case in cases:
        try:
            setup = training_setup(case)
        except Unexpressible as exc:
            info[case.id] = {"unexpressible": str(exc)}
            continue
        if not setup.plans:
            info[case.id] = {"unexpressible": f"no candidate plan is valid: {setup.rejected}"}
            continue
        published = published_seconds(case, setup.model, setup.hardware)
        info[case.id] = {"setup": setup, "published_s": published}
        for i, plan in enumerate(setup.plans):
            row = plan_row(setup.model, setup.training, plan, setup.hardware, setup.cluster)
            row["case"] = case.id
            row["candidate"] = i
            rows.append(row)
    return pd.DataFrame(rows), info


def choose(table: pd.DataFrame, costs: pd.DataFrame) -> pd.DataFrame:
    """Per case, the candidate the rule picks: the fastest that fits in memory (the fastest of
    all, flagged ``oom``, when none fits). Returns ``table``'s row index per case."""
    t = pd.DataFrame(
        {
            "case": table["case"].to_numpy(),
            "step": costs["time_step_s"].to_numpy(),
            "fits": costs["mem_headroom_bytes"].to_numpy() >= 0,
        },
        index=table.index,
    )
    t["rank"] = np.where(t["fits"], t["step"], t["step"] + 1e30)
    best = t.groupby("case", sort=False)["rank"].idxmin()
    return pd.DataFrame({"row": best, "oom": ~t.loc[best.to_numpy(), "fits"].to_numpy()})


def evaluate_training(
    cases: list[Case], timing: str = "roofline", table: pd.DataFrame | None = None, info=None
) -> pd.DataFrame:
    """One row per case: published and predicted figure, the time both imply, the signed error
    (%), the chosen plan, ``status`` (``ok``, ``oom``: no allowed plan fits in the model's
    memory, ``unexpressible``: see ``reason``)."""
    if table is None or info is None:
        table, info = build_table(cases)
    costs = pd.DataFrame()
    if len(table):
        # each preset's own table set (hardware.measured_gpu, e.g. the 500 W H100 on h100_sxm's)
        from stage_dse.kernels.tables import table_set

        gpus = {
            i["setup"].hardware.name: i["setup"].hardware for i in info.values() if "setup" in i
        }
        measured_gpu = {name: table_set(hw) for name, hw in gpus.items()}
        costs = evaluate_table(table, timing=timing, measured_gpu=measured_gpu)
    picked = choose(table, costs) if len(table) else pd.DataFrame(columns=["row", "oom"])
    out = []
    for case in cases:
        rec = result_base(case, timing)
        i = info[case.id]
        if "unexpressible" in i:
            out.append({**rec, "status": "unexpressible", "reason": i["unexpressible"]})
            continue
        row = picked.loc[case.id, "row"]
        setup = i["setup"]
        plan = setup.plans[int(table.at[row, "candidate"])]
        c = costs.loc[row]
        pred_s = float(c[TIME_COLUMN.get(case.target_kind, "time_step_s")])
        pub_s = i["published_s"]
        rate = case.target_kind not in ("iter_s", "layer_fwd_ms", "layer_bwd_ms")
        # a layer's time was measured on its own: the whole model's memory does not matter
        oom = bool(picked.loc[case.id, "oom"]) and case.target_kind not in TIME_COLUMN
        out.append(
            {
                **rec,
                "status": "oom" if oom else "ok",
                "reason": "no allowed plan fits in memory" if oom else "",
                "predicted": case.value * pub_s / pred_s
                if rate
                else pred_s * 1e3
                if case.target_kind.startswith("layer")
                else pred_s,
                "published_s": pub_s,
                "predicted_s": pred_s,
                "err_pct": 100 * (pred_s / pub_s - 1),
                "plan": plan_label(plan),
                "mem_gib": float(c["mem_total"]) / 2**30,
                "model": setup.model.name,
                "hardware": setup.hardware.name,
                "num_gpus": plan.num_gpus,
                "workload": f"seq{setup.training.seq_len} gbs{setup.training.global_batch_size}",
                "measured_share": float(c.get("measured_share", 0.0)),
            }
        )
    return pd.DataFrame(out)
