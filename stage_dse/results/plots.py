"""PNG figures of a results folder (matplotlib, no display needed; ``stage-dse-plot``).

* ``step_time_vs_gpus.png``: best feasible step time per GPU count (one line per model and
  hardware);
* ``pareto_time_memory.png``: all feasible plans and their Pareto front of step time vs memory
  per GPU;
* ``memory_breakdown.png``: weights / gradients / optimizer / activations of the fastest plans;
* ``serving_pareto.png`` (serving rows): output tokens/s per GPU against tokens/s per user.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import ScalarFormatter

from stage_dse.results.analysis import best_per, load, pareto

__all__ = ["plot_results"]

GIB = 2.0**30


PLOT_COLUMNS = [
    "status", "workload", "model", "hardware", "seq", "global_batch", "num_gpus", "step_s",
    "mem_total_bytes", "dp", "tp", "pp", "cp", "ep", "micro_batch", "zero_stage", "recompute",
    "mem_weights_bytes", "mem_grads_bytes", "mem_optimizer_bytes", "mem_activations_bytes",
    "mem_recompute_working_bytes", "usable_memory", "prompt", "serving_mode", "tpot_s",
    "decode_tokens_per_s_per_gpu",
]  # fmt: skip
"""What the figures draw: only these columns of the feasible rows are read."""


def plot_results(path: str | Path, out: str | Path, top: int = 10) -> list[Path]:
    import pyarrow.dataset as ds

    # a scan of the feasible rows' plotted columns, not the whole folder
    df = load(path, filters=ds.field("status") == "ok", columns=PLOT_COLUMNS)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    serving = df[(df["status"] == "ok") & (df["workload"].astype(str) == "serving")]
    written: list[Path] = []
    if len(serving):
        written.append(_serving_front(serving, out / "serving_pareto.png"))
    # training plans (serving rows have no step time); one series per model, hardware
    # and training step, so runs of different questions are never joined into one line
    ok = df[(df["status"] == "ok") & (df["workload"].astype(str) == "training")]
    if len(ok) == 0:
        return written
    series = ["model", "hardware", "seq", "global_batch"]
    groups = list(ok.groupby(series, observed=True))

    def label(key) -> str:
        model, hw, seq, batch = key
        return f"{model} / {hw} / seq {seq} / batch {batch}"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, group in groups:
        best = best_per(group, "num_gpus")
        ax.plot(best["num_gpus"], best["step_s"], marker="o", label=label(key))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("best step time (s)")
    ax.set_title("Fastest feasible plan per GPU count")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "step_time_vs_gpus.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (key, group) in enumerate(groups):  # one front per question, never across them
        color = f"C{i % 10}"
        ax.scatter(group["mem_total_bytes"] / GIB, group["step_s"], s=4, alpha=0.2, color=color)
        front = pareto(group, ["step_s", "mem_total_bytes"]).sort_values("mem_total_bytes")
        ax.plot(
            front["mem_total_bytes"] / GIB,
            front["step_s"],
            color=color,
            marker="o",
            drawstyle="steps-post",  # a front is a staircase: no plan lies on its risers
            label=f"Pareto front: {label(key)}",
        )
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("memory per GPU (GiB)")
    ax.set_ylabel("step time (s)")
    ax.set_title("Step time vs memory")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "pareto_time_memory.png"))

    # the memory of the fastest plans of the question holding the fastest plan overall
    fastest_key = tuple(ok.sort_values("step_s").iloc[0][series])
    question = dict(groups)[fastest_key]
    best = question.sort_values("step_s").head(top)
    labels = [
        f"dp{r.dp} tp{r.tp} pp{r.pp} cp{r.cp} ep{r.ep}\n"
        f"mbs{r.micro_batch} zero{r.zero_stage} {r.recompute}"
        for r in best.itertuples()
    ]
    parts = [
        ("mem_weights_bytes", "weights"),
        ("mem_grads_bytes", "gradients"),
        ("mem_optimizer_bytes", "optimizer"),
        ("mem_activations_bytes", "activations"),
        ("mem_recompute_working_bytes", "recompute working"),
    ]
    fig, ax = plt.subplots(figsize=(max(7, len(best) * 1.2), 5.2))
    bottom = [0.0] * len(best)
    for col, name in parts:
        vals = (best[col] / GIB).tolist()
        ax.bar(range(len(best)), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    limit = float(best["usable_memory"].max()) / GIB
    ax.axhline(limit, color="k", linestyle="--", linewidth=1, label=f"usable {limit:.0f} GiB")
    ax.set_ylim(0, max(limit, max(bottom)) * 1.1)
    ax.set_xticks(range(len(best)), labels, fontsize=7, rotation=35, ha="right")
    ax.set_ylabel("GiB per GPU (heaviest stage)")
    ax.set_title(f"Memory of the {len(best)} fastest plans: {label(fastest_key)}", fontsize=9)
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "memory_breakdown.png"))
    return written


def _serving_front(rows, path: Path) -> Path:
    """Tokens/s per GPU against tokens/s per user (1 / TPOT) of every serving configuration,
    and the Pareto front of each (model, hardware, prompt, mode)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = ["model", "hardware", "prompt", "serving_mode"]
    rows = rows.assign(
        per_user=1.0 / rows["tpot_s"],
        per_gpu=rows["decode_tokens_per_s_per_gpu"],
        serving_mode=rows["serving_mode"].astype(str).replace("None", "static"),
    )
    for i, (key, group) in enumerate(rows.groupby(series, observed=True)):
        color = f"C{i % 10}"
        ax.scatter(group["per_user"], group["per_gpu"], s=6, alpha=0.3, color=color)
        scored = group.assign(neg_user=-group["per_user"], neg_gpu=-group["per_gpu"])
        front = pareto(scored, ["neg_user", "neg_gpu"]).sort_values("per_user")
        model, hw, prompt, mode = key
        ax.plot(
            front["per_user"],
            front["per_gpu"],
            color=color,
            marker="o",
            drawstyle="steps-pre",
            label=f"{model} / {hw} / prompt {prompt} / {mode}",
        )
    ax.set_xscale("log")
    ax.set_xlabel("tokens/s per user (1 / TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title("Serving: throughput against interactivity (Pareto fronts)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
