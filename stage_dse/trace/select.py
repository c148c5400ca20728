"""Choosing result rows to trace and writing their sets: the selection shared by
``stage-dse-trace select`` and ``stage-dse-trace simulate``.

What lives here: :func:`config_from_row` (a result row back to its specs), :func:`select_rows`
(run, top-k, filter or hash selectors over a results folder), :func:`estimate_trace_bytes`
(a set's size before writing it) with :func:`check_size` and :func:`parse_bytes` (the
``--max-bytes`` limit), and :func:`select_and_write`. A bad selection raises a ``ConfigError``
naming the option.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from stage_dse.cost.bind import fp8_recipe_values
from stage_dse.errors import ConfigError
from stage_dse.results.schema import FP8_RECIPE_COLUMNS
from stage_dse.spec import (
    ClusterSpec,
    DType,
    Fp8Recipe,
    HardwareSpec,
    ModelSpec,
    ParallelPlan,
    TrainingSpec,
)
from stage_dse.trace.build import TraceConfig
from stage_dse.trace.write import write_trace_set

__all__ = [
    "TRACES_DIR",
    "check_size",
    "config_from_row",
    "estimate_trace_bytes",
    "parse_bytes",
    "select_and_write",
    "select_rows",
]

TRACES_DIR = "_traces"
"""Inside a results folder; the underscore keeps it out of pandas.read_parquet(folder)."""
DTYPE_OF_BYTES = {1: "fp8", 2: "bf16", 4: "fp32"}


def _gemm_dtype(row) -> str:
    """The GEMM input format of a row's ``gemm_bytes`` (2, 1 or NVFP4's 0.5625)."""
    return {1.0: "fp8", DType.NVFP4.bytes: "nvfp4"}.get(float(row["gemm_bytes"]), "bf16")


def _fp8_recipe(row) -> Fp8Recipe:
    """The FP8 scaling recipe whose 0/1 columns the row holds (rows before recipes: per-tensor;
    NVFP4 rows' block-scaling flag is their format's, not an FP8 recipe)."""
    flags = {c: int(_given(row, c, 0)) for c in FP8_RECIPE_COLUMNS}
    nvfp4 = _gemm_dtype(row) == "nvfp4"
    return next(r for r in Fp8Recipe if fp8_recipe_values(r, nvfp4) == flags)


def _given(row, column: str, default: float) -> float:
    """A column of a row, or ``default`` where the row predates it (absent or null)."""
    value = row.get(column)
    return default if value is None or pd.isna(value) else value


def config_from_row(row: pd.Series, granularity: str = "segment") -> TraceConfig:
    """The specs of one result row (every configuration column is in the row)."""
    model = ModelSpec(
        name=str(row["model"]),
        num_layers=int(row["layers"]),
        hidden_size=int(row["hidden"]),
        ffn_hidden_size=int(row["ffn"]),
        num_heads=int(row["heads"]),
        num_kv_heads=int(row["kv_heads"]),
        head_dim=int(row["head_dim"]),
        vocab_size=int(row["vocab"]),
        norm=str(row["norm"]),
        mlp=str(row["mlp"]),
        position=str(row["position"]),
        max_positions=int(row["positions"]),
        tied_embeddings=bool(row["tied_embeddings"]),
        bias=bool(row["bias"]),
        dropout=bool(row["dropout"]),
        mtp_layers=int(_given(row, "mtp_layers", 0)),
        parallel_block=bool(_given(row, "parallel_block", False)),
        **(
            {
                "num_experts": int(row["experts"]),
                "top_k": int(row["top_k"]),
                "moe_ffn_hidden_size": int(row["moe_ffn"]),
                "num_shared_experts": int(row["shared_experts"]),
                "first_dense_layers": int(row["dense_layers"]),
                "moe_layer_interval": int(row["moe_interval"]),
                "capacity_factor": float(row["capacity_factor"]),
            }
            if bool(row["moe"])
            else {}
        ),
        **(
            {
                "q_lora_rank": int(row["q_lora"]),
                "kv_lora_rank": int(row["kv_lora"]),
                "rope_head_dim": int(row["rope_dim"]),
                "v_head_dim": int(row["v_head_dim"]),
            }
            if bool(row["mla"])
            else {}
        ),
    )
    opt_bytes = int(row["optimizer_bytes_per_param"])
    training = TrainingSpec(
        seq_len=int(row["seq"]),
        global_batch_size=int(row["global_batch"]),
        params_dtype=DTYPE_OF_BYTES[int(row["param_bytes"])],
        grads_dtype=DTYPE_OF_BYTES[int(row["grad_bytes"])],
        optimizer="adam" if opt_bytes == 12 else "sgd_momentum",
        gemm_dtype=_gemm_dtype(row),
        fp8_recipe=_fp8_recipe(row),
    )
    plan = ParallelPlan(
        dp=int(row["dp"]),
        ep=int(row["ep"]),
        expert_tensor_parallel=bool(row["expert_tensor_parallel"]),
        ep_over_tp=bool(row.get("ep_over_tp", False)),
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        cp=int(row["cp"]),
        micro_batch_size=int(row["micro_batch"]),
        zero_stage=int(row["zero_stage"]),
        dp_replicate=_replicas(row),
        recompute=str(row["recompute"]),
        sequence_parallel=bool(row["sequence_parallel"]),
        attention=str(row["attention"]),
        schedule=str(row["schedule"]),
        virtual_stages=int(row["virtual_stages"]),
        stage_layers=str(row["stage_layers"]),
        rank_order=str(row["rank_order"]),
        overlap_grad_reduce=bool(row["overlap_grad_reduce"]),
        overlap_param_gather=bool(row["overlap_param_gather"]),
        tp_comm_overlap=bool(row["tp_comm_overlap"]),
        tp_dgrad_overlap=bool(row["tp_dgrad_overlap"]),
        ep_comm_overlap=bool(row["ep_comm_overlap"]),
        zero_sync_per_tensor=bool(row.get("zero_sync_per_tensor", False)),
        grad_sync_per_step=bool(row.get("grad_sync_per_step", False)),
        ep_dispatch_dedup=bool(row.get("ep_dispatch_dedup", False)),
        fused_elementwise=bool(row.get("fused_elementwise", True)),
        fused_activation=bool(row.get("fused_activation", True)),
        fused_projections=bool(row.get("fused_projections", True)),
        moe_weighted_activation=bool(row.get("moe_weighted_activation", False)),
        offload_layers=int(_given(row, "offload_layers", 0)),
        cuda_graphs=str(_given(row, "cuda_graphs", "none")),
        expert_gemm_loop=bool(_given(row, "expert_gemm_loop", False)),
        fsdp_master_shards=bool(_given(row, "fsdp_master_shards", False)),
    )
    hardware = HardwareSpec(
        name=str(row["hardware"]),
        peak_flops=float(row["peak_flops"]),
        peak_fp8_flops=float(row["peak_fp8_flops"]),
        peak_fp4_flops=float(_given(row, "peak_fp4_flops", 0.0)),
        sustained_clock=float(row["sustained_clock"]),
        hbm_bytes=float(row["usable_memory"]) + 1.0,
        hbm_bandwidth_bytes_per_s=float(row["hbm_bandwidth"]),
        memory_reserve_bytes=1.0,
        gemm_efficiency=float(row["gemm_efficiency"]),
        fp8_gemm_efficiency=float(row["fp8_gemm_efficiency"]),
        fp8_step_efficiency=float(_given(row, "fp8_step_efficiency", 1.0)),
        gemm_half_dim=float(row["gemm_half_dim"]),
        fp8_gemm_half_dim=float(row.get("fp8_gemm_half_dim", row["gemm_half_dim"])),
        fp4_gemm_efficiency=float(_given(row, "fp4_gemm_efficiency", 0.0)),  # 0: derived
        w4a16_moe_efficiency=float(_given(row, "w4a16_moe_efficiency", 0.0)),  # 0: derived
        fp4_gemm_half_dim=float(_given(row, "fp4_gemm_half_dim", 0.0)),
        attention_efficiency=float(row["attention_efficiency"]),
        attention_half_dim=float(_given(row, "attention_half_dim", 0.0)),
        memory_efficiency=float(row["memory_efficiency"]),
        kernel_launch_s=float(row["kernel_launch_s"]),
        overlap_slowdown=float(row["overlap_slowdown"]),
        gemm_floor_s=float(row["gemm_floor_s"]),
        attention_floor_s=float(row["attention_floor_s"]),
        elementwise_floor_s=float(row["elementwise_floor_s"]),
        moe_layer_latency_s=float(_given(row, "moe_layer_latency_s", 0.0)),
        host_op_s=float(_given(row, "host_op_s", 0.0)),
        host_bandwidth_bytes_per_s=float(_given(row, "host_bandwidth", 64e9)),
        rowwise_gemm_speed=float(_given(row, "rowwise_gemm_speed", 1.0)),
        mxfp8_gemm_speed=float(_given(row, "mxfp8_gemm_speed", 0.0)),
    )
    cluster = ClusterSpec(
        name=str(row["cluster"]),
        num_gpus=int(row["num_gpus"]),
        gpus_per_node=int(row["gpus_per_node"]),
        intra_bandwidth_bytes_per_s=float(row["intra_bandwidth"]),
        inter_bandwidth_bytes_per_s=float(row["inter_bandwidth"]),
        intra_latency_s=float(row["intra_latency"]),
        inter_latency_s=float(row["inter_latency"]),
        collective_base_latency_s=float(row["collective_base_latency"]),
        oneshot_latency_s=float(row["oneshot_latency"]),
        ll_intra_latency_s=float(row["ll_intra_latency"]),
        ll_inter_latency_s=float(row["ll_inter_latency"]),
        ll_base_latency_s=float(row["ll_base_latency"]),
        intra_efficiency=float(row["intra_efficiency"]),
        inter_efficiency=float(row["inter_efficiency"]),
        pod_gpus=int(row["pod_gpus"]),
        oversubscription=float(row["oversubscription"]),
    )
    return TraceConfig(model, training, plan, hardware, cluster, granularity)


def select_rows(
    results: str | Path,
    top: int | None = None,
    by: str = "step_s",
    where: str | None = None,
    hashes: list[str] | None = None,
    run: str | None = None,
) -> tuple[object, pd.DataFrame]:
    """(the folder's ResultStore, the selected rows): ``hashes`` if given, else the ``ok`` rows
    matching ``where``, else the ``top`` ok rows by ``by`` (1 by default); ``run`` keeps one
    run's rows first (``"latest"``: the newest)."""
    from stage_dse.results.store import ResultStore

    store = ResultStore(results)
    df = store.read()
    if len(df) == 0:
        raise ConfigError(f"no results in {results}")
    if run is not None:
        ids = df["run_id"].astype(str)
        wanted = ids.max() if run == "latest" else run
        if wanted not in set(ids):
            known = ", ".join(sorted(set(ids))[-5:])
            raise ConfigError(f"--run {run!r}: no rows of that run in {results} (latest: {known})")
        df = df[ids == wanted]
    ok = df[df["status"] == "ok"]
    if hashes:
        chosen = df[df["config_hash"].isin(hashes)]
        missing = set(hashes) - set(chosen["config_hash"])
        if missing:
            raise ConfigError(f"--hash: not in {results}: {', '.join(sorted(missing))}")
    elif where:
        try:
            chosen = ok.query(where)
        except Exception as exc:
            raise ConfigError(f"--where {where!r}: {exc}") from None
    else:
        if by not in df.columns:
            raise ConfigError(f"--by {by!r} is not a result column")
        if top is not None and top < 1:
            raise ConfigError(f"--top must be >= 1, got {top}")
        chosen = ok.sort_values(by).head(top or 1)
    if len(chosen) == 0:
        raise ConfigError(f"no rows of {results} match the selection")
    serving = chosen[chosen["workload"].astype(str) == "serving"]
    if len(serving):
        raise ConfigError(
            f"{len(serving)} selected rows are serving rows, which are traced one at a time: "
            "use stage-dse-trace config OUT workload=serving ... with the row's values"
        )
    return store, chosen


def check_size(estimate_bytes: float, sets: int, max_bytes: int, log=print) -> None:
    """Log the estimated size of ``sets`` trace sets; refuse it above ``max_bytes``."""
    word = "trace set" if sets == 1 else "trace sets"
    log(
        f"{sets} {word} selected, about {estimate_bytes / 2**30:.2f} GiB "
        f"(limit --max-bytes {max_bytes / 2**30:.2f} GiB)"
    )
    if estimate_bytes > max_bytes:
        raise ConfigError(
            f"the {sets} selected {word} would take about {estimate_bytes / 2**30:.1f} GiB, "
            f"above --max-bytes {max_bytes / 2**30:.1f} GiB: narrow the selection or raise "
            "--max-bytes"
        )


def select_and_write(
    results: str | Path,
    top: int | None = None,
    by: str = "step_s",
    where: str | None = None,
    hashes: list[str] | None = None,
    granularity: str = "segment",
    executor=None,
    log=print,
    run: str | None = None,
    max_bytes: int = 2**31,
) -> list[str]:
    """Write trace sets for the selected rows (:func:`select_rows`), filling each row's
    ``trace_dir`` and ``trace_replay_s`` as its set is finished; returns their hashes. Refuses
    a selection whose estimated size is above ``max_bytes``; Ctrl-C removes the unfinished set
    only."""
    store, chosen = select_rows(results, top, by, where, hashes, run)
    estimate = sum(estimate_trace_bytes(row) for _, row in chosen.iterrows())
    check_size(estimate, len(chosen), max_bytes, log)
    from stage_dse.trace.replay import replay_trace_dir

    done: list[str] = []
    for _, row in chosen.iterrows():
        h = str(row["config_hash"])
        out = Path(results) / TRACES_DIR / h
        try:
            cfg = config_from_row(row, granularity)
        except ConfigError as exc:
            raise ConfigError(f"row {h}: {exc}") from None
        try:
            ts = write_trace_set(cfg, out, executor=executor, config_hash=h)
            replay_s = replay_trace_dir(out).step_s
        except KeyboardInterrupt:
            shutil.rmtree(out, ignore_errors=True)
            log(
                f"interrupted: {len(done)} trace sets written and recorded; the unfinished "
                f"set {h} was removed"
            )
            raise
        # recorded as each set finishes, so an interruption keeps what was written
        store.set_column("trace_dir", {h: str(out.relative_to(results))})
        store.set_column("trace_replay_s", {h: replay_s})
        done.append(h)
        log(
            f"{h}: {ts.ranks} ranks, {ts.bytes / 2**20:.1f} MiB in {out}; "
            f"replayed step {replay_s:.4g} s (cost model {float(row['step_s']):.4g} s)"
        )
        for w in ts.warnings:
            log(f"  warning: {w}")
    return done


BYTES_PER_NODE = 104
"""Measured: 97-109 bytes per node (names, dependencies, attributes) over Llama-3 sets."""


def estimate_trace_bytes(row: Mapping, steps: int = 4) -> float:
    """Rough size of a row's trace set before writing it (within about 2x): ranks x
    (micro-batches x (layers per stage + 2) x nodes per layer and micro-batch + per-step nodes)
    x bytes per node.
    Nodes per layer and micro-batch, measured on Llama-3 sets: about 1 without model
    parallelism, and per parallelism that splits a layer's kernels with collectives: tensor
    parallel 9 (20 with sequence parallelism, 3 more with recompute), context parallel 7,
    expert parallel 8, ZeRO-3 4 (5 under hybrid sharding: the replicas' all-reduce). A serving
    row writes ``steps`` decode steps (one pass for a prefill)."""
    ranks = int(row["num_gpus"])
    layers = -(-int(row["layers"]) // int(row["pp"]))
    if str(row.get("workload", "training")) == "serving":
        micro = 1 if str(row.get("phase", "decode")) == "prefill" else steps
    else:
        micro = max(1, int(row["global_batch"]) // (int(row["dp"]) * int(row["micro_batch"])))
    per = 1.0
    if int(row["tp"]) > 1:
        per += 20 if bool(row.get("sequence_parallel", False)) else 9
        per += 3 if str(row.get("recompute", "none")) != "none" else 0
    per += 7 if int(row.get("cp", 1)) > 1 else 0
    per += 8 if int(row.get("ep", 1)) > 1 else 0
    zero, hybrid = int(row.get("zero_stage", 0)), _replicas(row) > 1
    per += (5 if hybrid else 4) if zero == 3 else 0
    # once per step: a gradient bucket per layer (and a parameter gather with ZeRO-1/2, and
    # the replicas' all-reduce under hybrid sharding), the optimizer
    step = (layers + 2) * ((3 if hybrid else 2) if zero in (1, 2) else 1) + 2
    return ranks * (micro * (layers + 2) * per + step) * BYTES_PER_NODE


def parse_bytes(text: str) -> int:
    """``2G``, ``500M``, ``1.5T`` or a plain number of bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(float(t))
    except (ValueError, OverflowError):
        raise ConfigError(f"--max-bytes {text!r}: give bytes, e.g. 2G or 500M") from None
    if value <= 0:
        raise ConfigError(f"--max-bytes {text!r}: give a positive size, e.g. 2G or 500M")
    return value


def _replicas(row) -> int:
    """Hybrid sharding's replicas of a row (1 where absent: rows written before it existed)."""
    value = row.get("dp_replicate")
    return 1 if value is None or value != value else int(value)
