"""PNG figures of a results folder (matplotlib, no display needed; ``stage-dse-plot``).

* ``step_time_vs_gpus.png``: best feasible step time per GPU count (one line per model and
  hardware);
* ``pareto_time_memory.png``: all feasible plans and their Pareto front of step time vs memory
  per GPU;
* ``memory_breakdown.png``: weights / gradients / optimizer / activations of the fastest plans.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from stage_dse.results.analysis import best_per, load, pareto

__all__ = ["plot_results"]

GIB = 2.0**30


def plot_results(path: str | Path, out: str | Path, top: int = 10) -> list[Path]:
    df = load(path)
    ok = df[df["status"] == "ok"]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if len(ok) == 0:
        return written

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (model, hw), group in ok.groupby(["model", "hardware"]):
        best = best_per(group, "num_gpus")
        ax.plot(best["num_gpus"], best["step_s"], marker="o", label=f"{model} / {hw}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("best step time (s)")
    ax.set_title("Fastest feasible plan per GPU count")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "step_time_vs_gpus.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(ok["mem_total_bytes"] / GIB, ok["step_s"], s=4, alpha=0.3, label="feasible plans")
    front = pareto(ok, ["step_s", "mem_total_bytes"]).sort_values("mem_total_bytes")
    ax.plot(
        front["mem_total_bytes"] / GIB,
        front["step_s"],
        color="C3",
        marker="o",
        label="Pareto front",
    )
    ax.set_xlabel("memory per GPU (GiB)")
    ax.set_ylabel("step time (s)")
    ax.set_title("Step time vs memory")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "pareto_time_memory.png"))

    best = ok.sort_values("step_s").head(top)
    labels = [
        f"dp{r.dp} tp{r.tp} pp{r.pp} cp{r.cp}\nmbs{r.micro_batch} z{r.zero_stage} {r.recompute[:3]}"
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
    ax.set_xticks(range(len(best)), labels, fontsize=7, rotation=35, ha="right")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"Memory of the {len(best)} fastest plans")
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "memory_breakdown.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
