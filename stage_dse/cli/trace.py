"""``stage-dse-trace``: write, check and inspect Chakra trace sets.

Subcommands:

* ``select RESULTS [--top K --by COL | --where EXPR | --hash H ...] [--run ID] [--max-bytes N]``:
  one trace set per selected result row under ``RESULTS/_traces/<config_hash>/``, each row's
  ``trace_dir`` and ``trace_replay_s`` filled as its set is finished (each touched part file is
  rewritten atomically under its own name); refused when the estimated size is above
  ``--max-bytes``;
* ``simulate RESULTS [the selectors of select] [--backend ...] [--astra-bin DIR] [--local |
  --address A]``: the selected rows through network simulators on Ray (trace sets written
  where missing), one row per result row and backend in ``RESULTS/_sim/`` (see
  :mod:`stage_dse.trace.simulate`);
* ``config OUT [hydra overrides] [--max-bytes N]``: one trace set for a single configuration
  composed from the same config groups as ``stage-dse`` (every plan axis must have one value),
  refused when its estimated size is above ``--max-bytes``;
* ``check DIR``: decode and verify a set (exit 1 with the problems found);
* ``replay DIR``: critical-path replay of a set beside the cost model's step time;
* ``json FILE``: one node per line, for debugging.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from stage_dse.cli._common import OneLineParser, compose, one_line_errors
from stage_dse.errors import ConfigError
from stage_dse.spec import ParallelPlan
from stage_dse.trace.build import TraceConfig
from stage_dse.trace.check import check_trace_dir
from stage_dse.trace.encode import read_trace
from stage_dse.trace.select import (
    TRACES_DIR,
    check_size,
    config_from_row,
    estimate_trace_bytes,
    parse_bytes,
    select_and_write,
)
from stage_dse.trace.write import TraceSet, write_trace_set

__all__ = [
    "TRACES_DIR",
    "config_from_row",
    "estimate_trace_bytes",
    "main",
    "parse_bytes",
    "select_and_write",
]


def _spec_row(plan: ParallelPlan, layers: int, num_gpus: int, **extra) -> dict:
    """The columns :func:`estimate_trace_bytes` reads, from one configuration's specs."""
    return {
        "num_gpus": num_gpus,
        "layers": layers,
        "pp": plan.pp,
        "dp": plan.dp,
        "tp": plan.tp,
        "cp": plan.cp,
        "ep": plan.ep,
        "micro_batch": plan.micro_batch_size,
        "zero_stage": plan.zero_stage,
        "dp_replicate": plan.dp_replicate,
        "sequence_parallel": plan.sequence_parallel,
        "recompute": plan.recompute_label,
        **extra,
    }


def _serving_config_mode(cfg, out: str, steps: int, max_bytes: int, log=print):
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
        moe_routing=spec.moe_routing,
        moe_dispatch=spec.moe_dispatch,
    )
    cluster = spec.cluster.replace(num_gpus=plan.num_gpus)
    phase = str(cfg.serving.phase)
    row = _spec_row(plan, spec.model.num_layers, plan.num_gpus, workload="serving", phase=phase)
    check_size(estimate_trace_bytes(row, steps), 1, max_bytes, log)
    return write_serving_trace(
        spec.model, serving, plan, spec.hardware[0], cluster, out, steps, phase=phase
    )


def _config_mode(
    out: str,
    overrides: list[str],
    granularity: str,
    steps: int = 4,
    max_bytes: int = 2**31,
    log=print,
):
    """The trace set of one composed configuration, written to ``out`` after its estimated
    size passed ``max_bytes`` (a serving set is written here; a training one is returned as
    its :class:`TraceConfig` for the caller to write)."""
    from stage_dse.config.schema import check_top_level, to_sweep
    from stage_dse.cost.table import plan_row

    if steps < 1:
        raise ConfigError(f"--steps {steps}: give the number of decode steps to write, >= 1")
    cfg = compose(overrides)
    check_top_level(cfg)
    if cfg.workload == "serving":
        return _serving_config_mode(cfg, out, steps, max_bytes, log)
    spec = to_sweep(cfg)
    if len(spec.gpu_counts) != 1:
        raise ConfigError("num_gpus: give exactly one GPU count for a trace")
    sp_ = spec.space
    if len(sp_.frameworks) != 1:
        names = [f.name for f in sp_.frameworks]
        raise ConfigError(f"plan.framework: give exactly one framework for a trace, got {names}")
    framework = sp_.frameworks[0]
    one = {}
    for name in ("tp", "pp", "cp", "ep", "expert_tensor_parallel", "ep_over_tp", "micro_batch_size",
                 "zero_stage", "recompute", "sequence_parallel", "attention", "virtual_stages",
                 "stage_layers",
                 "rank_order"):  # fmt: skip
        values = getattr(sp_, name)
        if isinstance(values, str) or len(values) != 1:
            raise ConfigError(f"plan.{name}: give exactly one value for a trace, got {values!r}")
        one[name] = values[0]
    training = framework.step(spec.training)
    n = spec.gpu_counts[0]
    mp = one["tp"] * one["pp"] * one["cp"]
    if n % mp:
        raise ConfigError(f"tp*pp*cp({mp}) does not divide num_gpus({n})")
    v = one.pop("virtual_stages")
    if len(sp_.shard_group) != 1:
        raise ConfigError(
            f"plan.shard_group: give exactly one value for a trace, got {list(sp_.shard_group)!r}"
        )
    group = sp_.shard_group[0]
    dp = n // mp
    if group and (dp % group or group >= dp):
        raise ConfigError(
            f"plan.shard_group={group} must divide dp({dp}) into two or more groups "
            "(0: shard over all data-parallel ranks)"
        )
    plan = ParallelPlan(
        dp=dp,
        dp_replicate=dp // group if group else 1,
        schedule="interleaved" if v > 1 else "1f1b",
        virtual_stages=v,
        **framework.plan_flags(),
        **one,
    )
    cluster = spec.cluster.replace(num_gpus=n)
    plan_row(spec.models[0], training, plan, spec.hardware[0], cluster)  # validates
    row = _spec_row(plan, spec.models[0].num_layers, n, global_batch=training.global_batch_size)
    check_size(estimate_trace_bytes(row), 1, max_bytes, log)
    return TraceConfig(spec.models[0], training, plan, spec.hardware[0], cluster, granularity)


def _simulate(args) -> None:
    from stage_dse.runner.executors import LocalExecutor, RayExecutor
    from stage_dse.trace.simulate import simulate

    executor = LocalExecutor() if args.local else RayExecutor(address=args.address)
    try:
        simulate(
            args.results,
            args.top,
            args.by,
            args.where,
            args.hash,
            args.run,
            max_bytes=parse_bytes(args.max_bytes),
            backends=args.backend,
            astra_bin=args.astra_bin,
            timeout_s=args.timeout_s,
            compute=args.compute,
            executor=executor,
            granularity=args.granularity,
            retry_failed=args.retry_failed,
        )
    finally:
        executor.close()


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
    p_sim = sub.add_parser(
        "simulate", help="run the selected rows through network simulators (results in _sim/)"
    )
    p_sim.add_argument("results")
    p_sim.add_argument("--top", type=int, default=None)
    p_sim.add_argument("--by", default="step_s")
    p_sim.add_argument("--where", default=None, help="pandas query over result columns")
    p_sim.add_argument(
        "--run", default=None, help="only rows evaluated by this run id ('latest': the newest)"
    )
    p_sim.add_argument("--hash", nargs="+", default=None)
    p_sim.add_argument(
        "--max-bytes", default="2G", help="refuse trace sets to write estimated above this"
    )
    p_sim.add_argument("--granularity", default="segment", choices=["segment", "op"])
    p_sim.add_argument(
        "--backend",
        nargs="+",
        default=None,
        help="replay, astra_unaware, astra_aware (default: replay and each ASTRA-sim binary found)",
    )
    p_sim.add_argument(
        "--astra-bin",
        default=None,
        help="folder of the AstraSim_Analytical_Congestion_* binaries (or $STAGE_DSE_ASTRA_BIN)",
    )
    p_sim.add_argument(
        "--timeout-s", type=float, default=600.0, help="a simulator run longer than this fails"
    )
    p_sim.add_argument(
        "--compute",
        default="replay",
        choices=["replay", "roofline"],
        help="ASTRA-sim times COMP nodes from the trace's durations or by its roofline",
    )
    p_sim.add_argument("--retry-failed", action="store_true", help="run failed rows again")
    where = p_sim.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="run in this process, not on Ray")
    where.add_argument(
        "--address", default=None, help="an existing Ray cluster (auto, ray://host:port)"
    )
    p_cfg = sub.add_parser("config", help="trace one configuration given as Hydra overrides")
    p_cfg.add_argument("out")
    p_cfg.add_argument("overrides", nargs="*")
    p_cfg.add_argument("--granularity", default="segment", choices=["segment", "op"])
    p_cfg.add_argument("--steps", type=int, default=4, help="decode steps (workload=serving)")
    p_cfg.add_argument(
        "--max-bytes", default="2G", help="refuse a set estimated above this (default 2G)"
    )
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
    elif args.cmd == "simulate":
        _simulate(args)
    elif args.cmd == "config":
        cfg = _config_mode(
            args.out, args.overrides, args.granularity, args.steps, parse_bytes(args.max_bytes)
        )
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
