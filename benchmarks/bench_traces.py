"""Trace-writing benchmark: the writer's fixed cost per set, and sets of 64 to 131,072 ranks.

Part 1, fixed cost: small Llama-3-8B sets (4 layers, seq 2048, global batch 64; the model of
``benchmarks/bench_simulate.py``) of 8-64 ranks over eight plan families, two sets per family,
written in this process. Printed per set: the writer's CPU seconds outside the rank files
(``setup``: graph and templates, numbers, checks, groups, manifest), the whole set's, and
whether it was the first set of its family in this process; then the median and maximum.
``--profile`` prints cProfile's 25 costliest functions over these sets. A fresh process
then writes one set twice: with an empty compile cache, then with the one the first left.

Part 2, large sets: Llama-3-70B style sets at 64 and 4,096 ranks written in this process, at
32,768 ranks and one Llama-3-405B set at 131,072 ranks (TP 8, PP 16, DP 1024, seq 8192) as Ray
tasks over rank ranges (Ray is started first; its start-up is not counted). CPU seconds are
split into user and system time; for Ray sets, ``tree_cpu_s`` is every process of the run (this
one, Ray's workers, raylet and GCS), read from /proc. ``--compare-local`` also writes each Ray
set in this process, alternately, ``--repeat`` times, and prints the Ray / in-process ratio of
CPU per rank (medians). Sets are written under ``--out`` (default: the system temporary
folder), measured, then deleted. Creating a file costs the kernel far more on some file
systems than writing it (about 1 ms of system time per file on this machine's ext4, 10 us
on tmpfs), so system time per rank says as much about the folder as about the writer.

Each set is then replayed (:mod:`stage_dse.trace.replay`): one rank per stage, and every rank
for the 64-rank set.

Part 3, ``--stage DIR`` (a checkout of STAGE, github.com/astra-sim/symbolic_tensor_graph, run
as its README says; it needs numpy, sympy, pandas and protobuf, and imports graphviz only to
draw graphs, so a stand-in is put on its path when graphviz is missing): STAGE's ``main.py``
and this package each write one set of 4,096 ranks (DP 64, TP 8, PP 8, tensor + sequence
parallel, no weight sharding) of the same dimensions (Llama-3-70B: hidden 8192, FFN 28672, 64
heads, 8 KV heads, vocabulary 128256) with 8 layers, sequence 1024, global batch 64 in one
micro-batch per data-parallel rank, as whole processes (imports included) into folders under
``--out``, alternately ``--repeat`` times; printed: CPU seconds (user + system, from
``getrusage`` of the child) per rank of each and STAGE's / ours (medians).

Run: ``python benchmarks/bench_traces.py [--skip-largest] [--compare-local] [--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_simulate import tree_cpu_s

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.runner.executors import RayExecutor
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.trace import TraceConfig, write_trace_set
from stage_dse.trace.replay import replay_trace_dir

H100 = load_hardware("h100_sxm")
SMALL_STEP = TrainingSpec(seq_len=2048, global_batch_size=64)
FAMILIES = [  # (first plan, a second plan of the same family)
    (dict(dp=8), dict(dp=16)),
    (dict(tp=2, dp=4), dict(tp=2, dp=8)),
    (dict(tp=2, pp=2, dp=2), dict(tp=2, pp=2, dp=4)),
    (dict(tp=4, pp=2, dp=2, sequence_parallel=True, zero_stage=1), dict(tp=4, pp=2, dp=4)),
    (dict(dp=16, zero_stage=2), dict(dp=32, zero_stage=2)),
    (dict(tp=2, pp=2, dp=4, zero_stage=3, recompute="full"), dict(tp=2, pp=2, dp=8)),
    (dict(tp=8, dp=8, zero_stage=1), dict(tp=8, dp=4, zero_stage=1)),
    (dict(tp=2, pp=4, dp=2, zero_stage=1, recompute="selective"), dict(tp=2, pp=4, dp=4)),
]
LARGE = [
    (
        "llama3_70b",
        ParallelPlan(dp=1, tp=8, pp=8, sequence_parallel=True, zero_stage=1),
        64,
        False,
    ),
    (
        "llama3_70b",
        ParallelPlan(dp=64, tp=8, pp=8, sequence_parallel=True, zero_stage=1),
        1024,
        False,
    ),
    (
        "llama3_70b",
        ParallelPlan(dp=512, tp=8, pp=8, sequence_parallel=True, zero_stage=1),
        1024,
        True,
    ),
    (
        "llama3_405b",
        ParallelPlan(dp=1024, tp=8, pp=16, sequence_parallel=True, zero_stage=1, recompute="full"),
        2048,
        True,
    ),
]


def _setup(ts) -> float:
    """The set's fixed cost (NaN from a version of the writer that does not report it)."""
    return getattr(ts, "setup_cpu_s", float("nan"))


def small_cfg(plan: dict, first: dict | None = None) -> TraceConfig:
    """A plan of the small model; ``first``: the family's first plan, whose structure it keeps."""
    fields = {**first, **plan} if first else plan
    p = ParallelPlan(micro_batch_size=1, **fields)
    return TraceConfig(
        model=load_model("llama3_8b").replace(num_layers=4),
        training=SMALL_STEP,
        plan=p,
        hardware=H100,
        cluster=load_cluster("dgx_h100", num_gpus=max(8, p.num_gpus)),
    )


def fixed_cost(out: Path, profile: bool) -> None:
    prof = cProfile.Profile() if profile else None
    setups, totals = [], []
    for first, second in FAMILIES:
        for k, cfg in enumerate((small_cfg(first), small_cfg(second, first))):
            folder = Path(tempfile.mkdtemp(dir=out))
            if prof:
                prof.enable()
            c0 = time.process_time()
            ts = write_trace_set(cfg, folder)
            total = time.process_time() - c0
            if prof:
                prof.disable()
            shutil.rmtree(folder)
            setups.append(_setup(ts))
            totals.append(total)
            p = cfg.plan
            print(
                f"  set tp={p.tp} pp={p.pp} dp={p.dp} zero={p.zero_stage} ranks={ts.ranks} "
                f"nodes/rank={sum(ts.nodes_per_stage[0].values())} "
                f"{'first of family' if k == 0 else 'family met'}: setup_cpu_s="
                f"{_setup(ts):.3f} set_cpu_s={total:.3f}"
            )
    print(
        f"fixed cost: sets={len(setups)} setup_cpu_s median={statistics.median(setups):.3f} "
        f"max={max(setups):.3f}; whole set median={statistics.median(totals):.3f} "
        f"max={max(totals):.3f} (goal: setup under 0.2)"
    )
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    cold_process(out)


COLD = """
import sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
from bench_traces import _setup, small_cfg
from stage_dse.trace import write_trace_set
cfg = small_cfg(dict(tp=2, pp=2, dp=2, zero_stage=1))
for label in ("cold cache", "same process, family met"):
    c0 = time.process_time()
    ts = write_trace_set(cfg, Path({out!r}) / label.replace(" ", "_"))
    print(f"  new process, {{label}}: setup_cpu_s={{_setup(ts):.3f}} "
          f"set_cpu_s={{time.process_time() - c0:.3f}}")
"""


def cold_process(out: Path) -> None:
    """One set in a fresh process (imports not counted), with an empty compile cache, then
    again in a second fresh process with the cache the first left."""
    cache = Path(tempfile.mkdtemp(dir=out))
    env = {**os.environ, "STAGE_DSE_CACHE": str(cache)}
    for run in ("empty cache", "cache from the run before"):
        folder = Path(tempfile.mkdtemp(dir=out))
        code = COLD.format(bench=str(Path(__file__).parent), out=str(folder))
        res = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=str(folder),  # not this checkout: "python -c" puts the working folder first
            capture_output=True,
            text=True,
            check=False,
        )
        lines = res.stdout.rstrip().splitlines() or [res.stderr.strip().splitlines()[-1]]
        print(f"  [{run}]")
        for line in lines:
            print(line.replace("cold cache", "first set"))
        shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)


def large_cfg(name: str, plan: ParallelPlan, batch: int) -> TraceConfig:
    return TraceConfig(
        model=load_model(name),
        training=TrainingSpec(seq_len=8192, global_batch_size=batch),
        plan=plan,
        hardware=H100,
        cluster=load_cluster("dgx_h100", num_gpus=plan.num_gpus),
    )


def write_once(cfg: TraceConfig, out: Path, executor) -> dict:
    """Write one set, measure it, keep the folder for the replay (the caller deletes it)."""
    folder = Path(tempfile.mkdtemp(prefix="stage_dse_traces_", dir=out))
    t0, r0, tree0 = time.perf_counter(), os.times(), tree_cpu_s(os.getpid())
    ts = write_trace_set(cfg, folder, executor=executor)
    r1, wall = os.times(), time.perf_counter() - t0
    tree = tree_cpu_s(os.getpid()) - tree0
    user, system = r1.user - r0.user, r1.system - r0.system
    cpu = user + system + ts.worker_cpu_s
    rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, ts.worker_peak_rss_mib)
    return dict(ts=ts, folder=folder, wall=wall, user=user, sys=system, cpu=cpu, tree=tree, rss=rss)


def large_sets(sets, out: Path, executor, compare: bool, repeat: int) -> None:
    for name, plan, batch, use_ray in sets:
        cfg = large_cfg(name, plan, batch)
        ranks = plan.num_gpus
        m = write_once(cfg, out, executor if use_ray else None)
        ts = m["ts"]
        try:
            for w in ts.warnings:
                print(f"  warning: {w}")
            print(
                f"{name} tp={plan.tp} pp={plan.pp} dp={plan.dp} microbatches="
                f"{plan.num_microbatches(cfg.training)} nodes/rank(stage 0)="
                f"{sum(ts.nodes_per_stage[0].values())} via={'ray' if use_ray else 'local'}"
            )
            ray_part = f" tree_cpu_s={m['tree']:.2f}" if use_ray else ""
            print(
                f"ranks={ranks} wall_s={m['wall']:.2f} cpu_s={m['cpu']:.2f} (this process user "
                f"{m['user']:.2f} sys {m['sys']:.2f}, tasks {ts.worker_cpu_s:.2f}){ray_part} "
                f"setup_cpu_s={_setup(ts):.2f} cpu_ms_per_rank="
                f"{1e3 * (m['tree'] if use_ray else m['cpu']) / ranks:.3f} "
                f"peak_rss_mb={m['rss']:.0f} bytes={ts.bytes} files={ts.files}"
            )
            c0 = time.process_time()
            r = replay_trace_dir(m["folder"])
            print(
                f"  replay ranks={ranks} simulated={r.simulated_ranks} nodes={r.nodes} "
                f"cpu_s={time.process_time() - c0:.2f} step_s={r.step_s:.4f} "
                f"cost_step_s={r.cost_step_s:.4f}"
            )
            if ranks <= 64:
                c0 = time.process_time()
                full = replay_trace_dir(m["folder"], all_ranks=True)
                print(
                    f"  replay ranks={ranks} simulated={full.simulated_ranks} "
                    f"nodes={full.nodes} cpu_s={time.process_time() - c0:.2f} "
                    f"step_s={full.step_s:.4f} (every rank)"
                )
        finally:
            shutil.rmtree(m["folder"], ignore_errors=True)
        if use_ray and compare:
            compare_local(cfg, out, executor, repeat)


def compare_local(cfg: TraceConfig, out: Path, executor, repeat: int) -> None:
    """The same set in this process and as Ray tasks, alternately (file systems drift)."""
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    for _ in range(repeat):
        for mode in ("local", "ray"):
            m = write_once(cfg, out, executor if mode == "ray" else None)
            shutil.rmtree(m["folder"], ignore_errors=True)
            runs[mode].append(m)
            print(
                f"  {mode}: wall_s={m['wall']:.2f} cpu_s={m['cpu']:.2f} (user {m['user']:.2f} "
                f"sys {m['sys']:.2f} tasks {m['ts'].worker_cpu_s:.2f}) tree_cpu_s={m['tree']:.2f}"
            )
    local = statistics.median(m["tree"] for m in runs["local"])
    ray_tree = statistics.median(m["tree"] for m in runs["ray"])
    ray_cpu = statistics.median(m["cpu"] for m in runs["ray"])
    print(
        f"  ray/local CPU per rank (medians of {repeat}): whole process tree "
        f"{ray_tree / local:.2f}, this process + tasks {ray_cpu / local:.2f} (goal: within 1.3)"
    )


STAGE_ARGS = [
    "--dp", "64", "--tp", "8", "--pp", "8", "--num_stacks", "8", "--batch", "64",
    "--seq", "1024", "--dvocal", "128256", "--dmodel", "8192", "--dff", "28672",
    "--head", "64", "--kvhead", "8", "--weight_sharded", "0", "--tpsp", "1",
]  # fmt: skip
OURS = """
import time
from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.trace import TraceConfig, write_trace_set
plan = ParallelPlan(dp=64, tp=8, pp=8, sequence_parallel=True, micro_batch_size=1)
cfg = TraceConfig(
    model=load_model("llama3_70b").replace(num_layers=8),
    training=TrainingSpec(seq_len=1024, global_batch_size=64),
    plan=plan, hardware=load_hardware("h100_sxm"),
    cluster=load_cluster("dgx_h100", num_gpus=plan.num_gpus),
)
c0 = time.process_time()
write_trace_set(cfg, {out!r})
print(time.process_time() - c0)
"""


def _child_cpu(
    cmd: list[str], cwd: str | None = None, env: dict | None = None
) -> tuple[float, str]:
    """CPU seconds (user + system) of one child process run to its end, and its output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"{cmd[1]} failed: {tail}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, res.stdout


def versus_stage(stage_dir: Path | None, out: Path, repeat: int) -> None:
    """``stage_dir`` None: this package's side only."""
    env = dict(os.environ)
    try:
        import graphviz  # noqa: F401
    except ImportError:  # STAGE draws graphs with it; writing traces never calls it
        stub = Path(tempfile.mkdtemp(dir=out))
        (stub / "graphviz.py").write_text(
            "class Digraph:\n    def __init__(self, *a, **k):\n"
            "        raise RuntimeError('graphviz is not installed')\n"
        )
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stub), env.get("PYTHONPATH")]))
    ranks = 4096
    cpu: dict[str, list[float]] = {"stage": [], "ours": [], "ours_in_process": []}
    for _ in range(repeat):
        for who in ("stage", "ours") if stage_dir else ("ours",):
            folder = Path(tempfile.mkdtemp(dir=out))
            if who == "stage":
                cmd = [sys.executable, "main.py", "--output_dir", str(folder)]
                cmd += ["--output_name", "workload.%d.et", *STAGE_ARGS]
                c, _ = _child_cpu(cmd, cwd=str(stage_dir), env=env)
            else:
                # run from the output folder: "python -c" puts the working folder first on the path
                code = OURS.format(out=str(folder))
                c, text = _child_cpu([sys.executable, "-c", code], cwd=str(folder))
                cpu["ours_in_process"].append(float(text.split()[-1]))
            files = len(list(folder.glob("*.et")))
            size = sum(f.stat().st_size for f in folder.glob("*.et"))
            shutil.rmtree(folder, ignore_errors=True)
            cpu[who].append(c)
            inner = f" (write_trace_set {cpu['ours_in_process'][-1]:.2f})" if who == "ours" else ""
            print(
                f"  {who}: cpu_s={c:.2f}{inner} cpu_ms_per_rank={1e3 * c / ranks:.3f} "
                f"files={files} bytes={size}"
            )
    ours = statistics.median(cpu["ours"])
    inner = statistics.median(cpu["ours_in_process"])
    line = (
        f"at {ranks} ranks under {out}: ours {1e3 * ours / ranks:.3f} ms per rank "
        f"(process), {1e3 * inner / ranks:.3f} (write_trace_set)"
    )
    if stage_dir:
        stage = statistics.median(cpu["stage"])
        line += (
            f"; STAGE {1e3 * stage / ranks:.2f}: {stage / ours:.1f}x less CPU per rank "
            f"(process), {stage / inner:.1f}x (write_trace_set) (medians of {repeat})"
        )
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-largest", action="store_true")
    parser.add_argument("--skip-fixed", action="store_true", help="no part 1")
    parser.add_argument("--skip-large", action="store_true", help="no part 2")
    parser.add_argument("--profile", action="store_true", help="cProfile of part 1")
    parser.add_argument("--compare-local", action="store_true")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="*", help="only the large sets of these sizes")
    parser.add_argument("--out", default=tempfile.gettempdir())
    parser.add_argument("--stage", type=Path, help="a STAGE checkout: part 3")
    parser.add_argument("--ours-4096", action="store_true", help="part 3 without STAGE")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench_traces_", dir=args.out))
    try:
        if not args.skip_fixed:
            fixed_cost(out, args.profile)
        if args.stage or args.ours_4096:
            versus_stage(args.stage, out, args.repeat)
        if args.skip_large:
            return
        t0 = time.perf_counter()
        executor = RayExecutor(num_cpus=os.cpu_count())
        cpus = executor.num_cpus  # Ray starts on first use
        print(f"ray start: {time.perf_counter() - t0:.1f} s ({cpus} CPUs)")
        try:
            sets = LARGE[:-1] if args.skip_largest else LARGE
            if args.ranks:
                sets = [s for s in sets if s[1].num_gpus in args.ranks]
            large_sets(sets, out, executor, args.compare_local, args.repeat)
        finally:
            executor.close()
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
