"""The serving half of ``stage-dse`` (called by :mod:`stage_dse.cli.sweep`): the config
becomes one :class:`~stage_dse.spec.sweep.ServingJob`, the driver
(:func:`stage_dse.runner.serving_job.run_serving_job`) runs it once, and this module prints
what it returns. Nothing is decided here."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

GIB = 2.0**30


def run_serving_job(cfg: DictConfig, repeats=()) -> int:
    """A serving job (``workload=serving`` or ``mode=recommend``); returns the number of rows
    the sweep evaluated."""
    from stage_dse.config.schema import to_serving_job
    from stage_dse.results.store import ResultStore
    from stage_dse.runner import serving_job

    job = to_serving_job(cfg)
    store = ResultStore(Path(cfg.results_dir) / job.sweep.name, replace_stale=cfg.replace_stale)
    result = serving_job.run_serving_job(job, store)
    if result.report is not None:
        _print_sweep(result, repeats)
    if result.recommendation is not None:
        if result.report is not None:
            print()
        _print_recommendation(result.recommendation)
    return 0 if result.report is None else result.report.evaluated


def check_serving_job(cfg: DictConfig) -> None:
    """Everything a serving job checks before it evaluates anything."""
    from stage_dse.config.schema import to_serving_job
    from stage_dse.runner.serving_job import check_serving_job

    check_serving_job(to_serving_job(cfg))


def _print_sweep(result, repeats) -> None:
    from stage_dse.cli.sweep import _print_outcomes, print_run_rows

    job = result.job
    _print_outcomes(
        result.store_root, result.folder_rows, result.report, "configurations rejected, by rule:",
        repeats,
    )  # fmt: skip
    for note in result.notes:
        print(note)
    print_run_rows(len(result.rows), result.folder_rows, result.reused)
    top = result.top
    print(f"\ntop {len(top)} serving configurations by decode tokens/s per GPU:")
    print(top.to_string(index=False) if len(top) else "  none fits")
    if result.front is None:
        return
    print(
        f"\nPareto front of tokens/s per GPU vs tokens/s per user within TTFT <= "
        f"{job.ttft_sla_ms or 'any'} ms, TPOT <= {job.tpot_sla_ms or 'any'} ms "
        f"({result.within_targets:,} of {result.feasible:,} configurations meet the targets):"
    )
    front = result.front
    print(front.to_string(index=False) if len(front) else "  none meets the targets")


def _print_recommendation(rec) -> None:
    """``mode=recommend``'s answer: per hardware, the fewest GPUs aggregated and
    disaggregated, the comparison at equal GPUs and the nearest miss."""
    from stage_dse.runner.serving_job import BOUND_WORDS

    ttft_ms, tpot_ms, target = rec.ttft_sla_ms, rec.tpot_sla_ms, rec.target_requests_per_s
    print(
        f"recommend {rec.model}: {target:g} requests/s of {rec.workload} within TTFT <= "
        f"{ttft_ms:g} ms, TPOT <= {tpot_ms:g} ms"
    )
    print(
        f"weights {rec.weights_dtype}, KV cache {rec.kv_dtype}, engine {rec.engine}, "
        f"running requests at most {rec.running_cap} ({rec.running_cap_from}) and the KV "
        "capacity"
    )
    for hw in rec.hardware:
        answer = hw.answer
        print(f"\n{hw.hardware}:")
        if len(answer.aggregated):
            a = answer.aggregated.iloc[0]
            ep = f" ep {a.ep}" if a.ep > 1 else ""
            print(
                f"  aggregated:    {a.gpus:.0f} GPUs = {a.replicas:.0f} "
                f"replica{'' if a.replicas == 1 else 's'} x tp {a.tp}{ep} "
                f"(max_running {a.max_running}, prefill budget {a.prefill_budget}, bound by "
                f"{BOUND_WORDS.get(a.bound, a.bound)}); TTFT "
                f"{a.ttft_s * 1e3:.0f} ms unqueued, TPOT {a.tpot_s * 1e3:.1f} ms, "
                f"{a.tokens_per_s_per_gpu:.0f} tokens/s per GPU"
            )
        else:
            print("  aggregated:    no layout meets the targets")
        if len(answer.disaggregated):
            d = answer.disaggregated.iloc[0]
            other = "" if d.prefill_hardware == hw.hardware else f" ({d.prefill_hardware})"
            p_ep = f" ep {d.prefill_ep}" if d.prefill_ep > 1 else ""
            d_ep = f" ep {d.decode_ep}" if d.decode_ep > 1 else ""
            print(
                f"  disaggregated: {d.gpus:.0f} GPUs = {d.prefill_replicas:.0f} prefill x tp "
                f"{d.prefill_tp}{p_ep}{other}"
                f" + {d.decode_replicas:.0f} decode x tp {d.decode_tp}{d_ep} (batch "
                f"{d.decode_batch}, bound by {BOUND_WORDS.get(d.bound, d.bound)}); TTFT "
                f"{d.ttft_s * 1e3:.0f} ms with the KV transfer, TPOT "
                f"{d.tpot_s * 1e3:.1f} ms, {d.tokens_per_s_per_gpu:.0f} tokens/s per GPU"
            )
            layout = hw.equal_gpus_layout
            if layout is not None:
                print(
                    f"  at {d.gpus:.0f} GPUs aggregated serves {hw.equal_gpus_rate:.1f} "
                    f"requests/s (tp {layout.tp}{f' ep {layout.ep}' if layout.ep > 1 else ''}, "
                    f"max_running {layout.max_running}) against {target:g} disaggregated"
                )
        else:
            print("  disaggregated: no pair of pools meets the targets")
        if hw.measured_share is not None:
            print(
                f"  timing: measured kernel tables for {hw.measured_share:.0%} of the "
                "qualifying candidates' time (median), roofline for the rest"
            )
        if len(answer.near_miss):
            m = answer.near_miss.iloc[0]
            which = "TPOT" if m.tpot_s / (tpot_ms / 1e3) >= m.ttft_s / (ttft_ms / 1e3) else "TTFT"
            print(
                f"  nearest miss:  {m.kind} (TTFT {m.ttft_s * 1e3:.0f} ms, TPOT "
                f"{m.tpot_s * 1e3:.1f} ms) misses its {which} target by "
                f"{100 * (m.miss - 1):.0f}%"
            )
    print(f"\nrecommendation candidates: {rec.path}")
