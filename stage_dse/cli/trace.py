"""``stage-dse-trace``: write, check and inspect Chakra trace sets.

Subcommands:

* ``select RESULTS [--top K --by COL | --where EXPR | --hash H ...] [--run ID] [--max-bytes N]``:
  one trace set per selected result row under ``RESULTS/_traces/<config_hash>/``, each row's
  ``trace_dir`` and ``trace_replay_s`` filled as its set is finished (each touched part file is
  rewritten atomically under its own name); refused when the estimated size is above
  ``--max-bytes``;
* ``config OUT [hydra overrides]``: one trace set for a single configuration composed from the
  same config groups as ``stage-dse`` (every plan axis must have one value);
* ``check DIR``: decode and verify a set (exit 1 with the problems found);
* ``replay DIR``: critical-path replay of a set beside the cost model's step time;
* ``json FILE``: one node per line, for debugging.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pandas as pd

from stage_dse.cli._common import OneLineParser, compose, one_line_errors
from stage_dse.errors import ConfigError
from stage_dse.spec import ClusterSpec, HardwareSpec, ModelSpec, ParallelPlan, TrainingSpec
from stage_dse.trace.build import TraceConfig
from stage_dse.trace.check import check_trace_dir
from stage_dse.trace.encode import read_trace
from stage_dse.trace.write import TraceSet, write_trace_set

__all__ = ["config_from_row", "main", "select_and_write"]

TRACES_DIR = "_traces"
"""Inside a results folder; the underscore keeps it out of pandas.read_parquet(folder)."""
DTYPE_OF_BYTES = {1: "fp8", 2: "bf16", 4: "fp32"}


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
        gemm_dtype="fp8" if int(row["gemm_bytes"]) == 1 else "bf16",
    )
    plan = ParallelPlan(
        dp=int(row["dp"]),
        ep=int(row["ep"]),
        expert_tensor_parallel=bool(row["expert_tensor_parallel"]),
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        cp=int(row["cp"]),
        micro_batch_size=int(row["micro_batch"]),
        zero_stage=int(row["zero_stage"]),
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
    )
    hardware = HardwareSpec(
        name=str(row["hardware"]),
        peak_flops=float(row["peak_flops"]),
        peak_fp8_flops=float(row["peak_fp8_flops"]),
        sustained_clock=float(row["sustained_clock"]),
        hbm_bytes=float(row["usable_memory"]) + 1.0,
        hbm_bandwidth_bytes_per_s=float(row["hbm_bandwidth"]),
        memory_reserve_bytes=1.0,
        gemm_efficiency=float(row["gemm_efficiency"]),
        fp8_gemm_efficiency=float(row["fp8_gemm_efficiency"]),
        gemm_half_dim=float(row["gemm_half_dim"]),
        attention_efficiency=float(row["attention_efficiency"]),
        memory_efficiency=float(row["memory_efficiency"]),
        kernel_launch_s=float(row["kernel_launch_s"]),
        overlap_slowdown=float(row["overlap_slowdown"]),
        gemm_floor_s=float(row["gemm_floor_s"]),
        attention_floor_s=float(row["attention_floor_s"]),
        elementwise_floor_s=float(row["elementwise_floor_s"]),
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
    """Write trace sets for the selected rows, filling each row's ``trace_dir`` and
    ``trace_replay_s`` as its set is finished; returns their hashes. Refuses a selection whose
    estimated size is above ``max_bytes``; Ctrl-C removes the unfinished set only."""
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
    estimate = int(sum(estimate_trace_bytes(row) for _, row in chosen.iterrows()))
    log(
        f"{len(chosen)} trace sets selected, about {estimate / 2**30:.2f} GiB "
        f"(limit --max-bytes {max_bytes / 2**30:.2f} GiB)"
    )
    if estimate > max_bytes:
        raise ConfigError(
            f"the {len(chosen)} selected trace sets would take about {estimate / 2**30:.1f} GiB, "
            f"above --max-bytes {max_bytes / 2**30:.1f} GiB: narrow the selection or raise "
            "--max-bytes"
        )
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


def estimate_trace_bytes(row: pd.Series) -> float:
    """Rough size of a row's trace set before writing it (within about 2x): ranks x
    (micro-batches x (layers per stage + 2) x nodes per layer and micro-batch + per-step nodes)
    x bytes per node.
    Nodes per layer and micro-batch, measured on Llama-3 sets: about 1 without model
    parallelism, and per parallelism that splits a layer's kernels with collectives: tensor
    parallel 9 (20 with sequence parallelism, 3 more with recompute), context parallel 7,
    expert parallel 8, ZeRO-3 4."""
    ranks = int(row["num_gpus"])
    layers = -(-int(row["layers"]) // int(row["pp"]))
    if str(row.get("workload", "training")) == "serving":
        micro = 4  # decode steps written by default
    else:
        micro = max(1, int(row["global_batch"]) // (int(row["dp"]) * int(row["micro_batch"])))
    per = 1.0
    if int(row["tp"]) > 1:
        per += 20 if bool(row.get("sequence_parallel", False)) else 9
        per += 3 if str(row.get("recompute", "none")) != "none" else 0
    per += 7 if int(row.get("cp", 1)) > 1 else 0
    per += 8 if int(row.get("ep", 1)) > 1 else 0
    per += 4 if int(row.get("zero_stage", 0)) == 3 else 0
    # once per step: a gradient bucket per layer (and a parameter gather with ZeRO-1/2), the
    # optimizer
    step = (layers + 2) * (2 if int(row.get("zero_stage", 0)) in (1, 2) else 1) + 2
    return ranks * (micro * (layers + 2) * per + step) * BYTES_PER_NODE


def parse_bytes(text: str) -> int:
    """``2G``, ``500M``, ``1.5T`` or a plain number of bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(float(t))
    except ValueError:
        raise ConfigError(f"--max-bytes {text!r}: give bytes, e.g. 2G or 500M") from None


def _serving_config_mode(cfg, out: str, steps: int):
    from stage_dse.config.schema import to_serving_sweep
    from stage_dse.spec.serving import ServingSpec, serving_plan
    from stage_dse.trace.serving import write_serving_trace

    spec = to_serving_sweep(cfg)
    one = {}
    for name, values in (
        ("tp", spec.tp),
        ("pp", spec.pp),
        ("ep", spec.ep),
        ("batch_size", spec.batch_sizes),
        ("prompt_len", spec.prompt_lens),
    ):
        if isinstance(values, str) or len(values) != 1:
            raise ConfigError(f"serving.{name}: give exactly one value for a trace, got {values!r}")
        one[name] = values[0]
    plan = serving_plan(spec.model, one["tp"], one["pp"], one["batch_size"], one["ep"])
    serving = ServingSpec(
        prompt_len=one["prompt_len"],
        output_tokens=spec.output_tokens,
        batch_size=one["batch_size"],
        kv_dtype=spec.kv_dtype,
        weights_dtype=spec.weights_dtype,
    )
    cluster = spec.cluster.replace(num_gpus=plan.num_gpus)
    phase = str(cfg.serving.phase)
    return write_serving_trace(
        spec.model, serving, plan, spec.hardware[0], cluster, out, steps, phase=phase
    )


def _config_mode(out: str, overrides: list[str], granularity: str, steps: int = 4):
    from stage_dse.config.schema import check_top_level, to_sweep
    from stage_dse.cost.table import plan_row

    cfg = compose(overrides)
    check_top_level(cfg)
    if cfg.workload == "serving":
        return _serving_config_mode(cfg, out, steps)
    spec = to_sweep(cfg)
    if len(spec.gpu_counts) != 1:
        raise ConfigError("num_gpus: give exactly one GPU count for a trace")
    sp_ = spec.space
    one = {}
    for name in ("tp", "pp", "cp", "ep", "expert_tensor_parallel", "micro_batch_size",
                 "zero_stage", "recompute", "sequence_parallel", "attention", "virtual_stages",
                 "stage_layers",
                 "rank_order"):  # fmt: skip
        values = getattr(sp_, name)
        if isinstance(values, str) or len(values) != 1:
            raise ConfigError(f"plan.{name}: give exactly one value for a trace, got {values!r}")
        one[name] = values[0]
    n = spec.gpu_counts[0]
    mp = one["tp"] * one["pp"] * one["cp"]
    if n % mp:
        raise ConfigError(f"tp*pp*cp({mp}) does not divide num_gpus({n})")
    v = one.pop("virtual_stages")
    plan = ParallelPlan(
        dp=n // mp,
        schedule="interleaved" if v > 1 else "1f1b",
        virtual_stages=v,
        overlap_grad_reduce=sp_.overlap_grad_reduce,
        overlap_param_gather=sp_.overlap_param_gather,
        tp_comm_overlap=sp_.tp_comm_overlap,
        tp_dgrad_overlap=sp_.tp_dgrad_overlap,
        ep_comm_overlap=sp_.ep_comm_overlap,
        **one,
    )
    cluster = spec.cluster.replace(num_gpus=n)
    plan_row(spec.models[0], spec.training, plan, spec.hardware[0], cluster)  # validates
    return TraceConfig(spec.models[0], spec.training, plan, spec.hardware[0], cluster, granularity)


@one_line_errors("stage-dse-trace")
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="stage-dse-trace", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_sel = sub.add_parser("select", help="trace the selected rows of a results folder")
    p_sel.add_argument("results")
    p_sel.add_argument("--top", type=int, default=None)
    p_sel.add_argument("--by", default="step_s")
    p_sel.add_argument("--where", default=None, help="pandas query over result columns")
    p_sel.add_argument(
        "--run", default=None, help="only rows evaluated by this run id ('latest': the newest)"
    )
    p_sel.add_argument(
        "--max-bytes", default="2G", help="refuse selections estimated above this (default 2G)"
    )
    p_sel.add_argument("--hash", nargs="+", default=None)
    p_sel.add_argument("--granularity", default="segment", choices=["segment", "op"])
    p_sel.add_argument("--ray", action="store_true", help="write rank ranges as Ray tasks")
    p_cfg = sub.add_parser("config", help="trace one configuration given as Hydra overrides")
    p_cfg.add_argument("out")
    p_cfg.add_argument("overrides", nargs="*")
    p_cfg.add_argument("--granularity", default="segment", choices=["segment", "op"])
    p_cfg.add_argument("--steps", type=int, default=4, help="decode steps (workload=serving)")
    p_chk = sub.add_parser("check", help="verify a trace set")
    p_chk.add_argument("dir")
    p_rep = sub.add_parser(
        "replay", help="critical-path replay of a trace set beside the cost model's step time"
    )
    p_rep.add_argument("dir")
    p_rep.add_argument(
        "--all-ranks", action="store_true", help="simulate every rank, not one per stage"
    )
    p_js = sub.add_parser("json", help="print one rank file as JSON, one node per line")
    p_js.add_argument("file")
    # config: options may come before or after the overrides (argparse alone stops taking
    # positionals after the first option)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.cmd != "config" or any(x.startswith("-") for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if args.cmd == "select":
        executor = None
        if args.ray:
            from stage_dse.runner.executors import RayExecutor

            executor = RayExecutor()
        try:
            select_and_write(
                args.results,
                args.top,
                args.by,
                args.where,
                args.hash,
                args.granularity,
                executor,
                run=args.run,
                max_bytes=parse_bytes(args.max_bytes),
            )
        finally:
            if executor is not None:
                executor.close()
    elif args.cmd == "config":
        cfg = _config_mode(args.out, args.overrides, args.granularity, args.steps)
        ts = cfg if isinstance(cfg, TraceSet) else write_trace_set(cfg, args.out)
        print(f"{ts.ranks} ranks, {ts.bytes / 2**20:.1f} MiB in {ts.path}")
        for w in ts.warnings:
            print(f"warning: {w}")
    elif args.cmd == "check":
        if not (Path(args.dir) / "comm_groups.json").is_file():
            raise ConfigError(f"{args.dir} is not a trace set (no comm_groups.json there)")
        problems = check_trace_dir(args.dir)
        if problems:
            for p in problems[:20]:
                print(p)
            if len(problems) > 20:
                print(f"... and {len(problems) - 20} more")
            return 1
        manifest = json.loads((Path(args.dir) / "manifest.json").read_text())
        print(f"ok: {manifest['ranks']} ranks, {manifest['total_nodes']} nodes")
    elif args.cmd == "replay":
        from stage_dse.trace.replay import replay_trace_dir

        if not Path(args.dir).is_dir():
            raise ConfigError(f"{args.dir} is not a folder (give a trace set folder)")
        r = replay_trace_dir(args.dir, all_ranks=args.all_ranks)
        line = f"replay_step_s={r.step_s:.6g} simulated_ranks={r.simulated_ranks} nodes={r.nodes}"
        if r.cost_step_s:
            line += f" cost_step_s={r.cost_step_s:.6g} ratio={r.step_s / r.cost_step_s:.4f}"
        print(line)
    elif args.cmd == "json":
        from google.protobuf.json_format import MessageToDict

        if not Path(args.file).is_file():
            raise ConfigError(f"no trace file {args.file}")
        meta, nodes = read_trace(args.file)
        try:
            print(json.dumps(MessageToDict(meta)))
            for node in nodes:
                # every field, node id 0 and empty deps included: readers need not know
                # proto3's defaults
                d = MessageToDict(node, always_print_fields_with_no_presence=True)
                print(json.dumps(d))
        except BrokenPipeError:  # e.g. piped into head: stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
