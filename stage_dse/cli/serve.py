"""The serving half of ``stage-dse``: timing and SLA options of serving jobs and
``mode=recommend``'s answer (called by :mod:`stage_dse.cli.sweep`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from stage_dse.errors import StageDseError

GIB = 2.0**30


def _serving_timing(cfg: DictConfig, hardware) -> str:
    """``timing`` of a serving or recommend job, its tables loaded (a one-line error when the
    extra is missing or ``hardware.measured_gpu`` names no table set, as for training)."""
    from stage_dse.runner.serving import serving_timing

    timing = cfg.get("timing", "roofline")
    serving_timing(timing, hardware)
    return timing


def _print_tables_note(hardware) -> None:
    """One line per part without measured tables: its rows keep the roofline."""
    from stage_dse.kernels.tables import table_set

    for hw in hardware:
        if table_set(hw) is None:
            print(f"note: timing=measured: no measured kernel tables for {hw.name}; its rows use "
                  "the roofline")  # fmt: skip


def _sla(cfg: DictConfig) -> tuple[float | None, float | None]:
    sla = cfg.serving.sla
    for name in ("ttft_ms", "tpot_ms"):
        value = sla[name]
        if value is not None and not value > 0:
            raise StageDseError(f"serving.sla.{name} must be > 0, got {value}")
    return sla.ttft_ms, sla.tpot_ms


def _run_recommend(cfg: DictConfig) -> int:
    """``mode=recommend``: the fewest GPUs serving ``serving.target_requests_per_s`` within
    ``serving.sla`` on each hardware, aggregated and disaggregated."""
    import pandas as pd

    from stage_dse.config import load_hardware
    from stage_dse.config.schema import ServingConf, to_serving_sweep
    from stage_dse.runner.recommend import BOUND_WORDS, aggregated_rate_at, recommend
    from stage_dse.spec.serving import ServingSpec
    from stage_dse.spec.sweep import divisors

    spec = to_serving_sweep(cfg)
    ttft_ms, tpot_ms = _sla(cfg)
    target = cfg.serving.target_requests_per_s
    if not (ttft_ms and tpot_ms):
        raise StageDseError("mode=recommend needs serving.sla.ttft_ms and serving.sla.tpot_ms")
    if not target > 0:
        raise StageDseError(f"mode=recommend needs serving.target_requests_per_s > 0, got {target}")
    prompt = spec.prompt_lens[0]
    sv = cfg.serving
    prefill_hw = load_hardware(sv.prefill_hardware) if sv.prefill_hardware else None
    timing = _serving_timing(cfg, (*spec.hardware, *([prefill_hw] if prefill_hw else [])))
    # the dtypes are checked before anything is printed
    ServingSpec(prompt_len=prompt, weights_dtype=spec.weights_dtype, kv_dtype=spec.kv_dtype)
    mix = [tuple(float(x) for x in item) for item in spec.request_mix] or None
    total = sum(w for _, _, w in mix or ())
    mix_label = ",".join(f"{p:g}x{o:g}:{w / total:g}" for p, o, w in mix or ())  # as rows
    lengths = (
        f"the mix {mix_label} (prompt x output:weight)"
        if mix
        else f"{prompt} prompt + {spec.output_tokens} output tokens"
    )
    print(
        f"recommend {spec.model.name}: {target:g} requests/s of {lengths} within TTFT <= "
        f"{ttft_ms:g} ms, TPOT <= {tpot_ms:g} ms"
    )
    # serving.batch_size caps the running requests; the static-sweep default states none
    caps = list(spec.batch_sizes)
    max_running = None if caps == ServingConf().batch_size else max(caps)
    cap_from = "engine.max_running" if max_running is None else "serving.batch_size"
    print(
        f"weights {spec.weights_dtype}, KV cache {spec.kv_dtype}, engine {spec.engine.name}, "
        f"running requests at most {max_running or spec.engine.max_running} ({cap_from}) "
        "and the KV capacity"
    )
    per_node = spec.cluster.gpus_per_node
    tps = (
        tuple(d for d in divisors(spec.model.num_kv_heads) if d <= per_node)
        if spec.tp == "auto"
        else tuple(spec.tp)
    )
    candidates = []
    for hw in spec.hardware:
        answer = recommend(
            spec.model,
            hw,
            spec.cluster,
            prompt=None if mix else prompt,
            output_tokens=None if mix else spec.output_tokens,
            mix=mix,
            target_requests_per_s=target,
            ttft_sla_s=ttft_ms / 1e3,
            tpot_sla_s=tpot_ms / 1e3,
            tps=tps,
            eps=tuple(spec.ep),
            weights_dtype=spec.weights_dtype,
            kv_dtype=spec.kv_dtype,
            max_running=max_running,
            engine=spec.engine,
            prefill_hardware=prefill_hw,
            kv_link=sv.kv_link,
            timing=timing,
        )
        print(f"\n{hw.name}:")
        for part, frame in (
            ("aggregated", answer.aggregated),
            ("disaggregated", answer.disaggregated),
            ("near_miss", answer.near_miss),
        ):
            candidates.append(frame.assign(hardware=hw.name, model=spec.model.name, part=part))
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
            other = "" if d.prefill_hardware == hw.name else f" ({d.prefill_hardware})"
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
            rate, layout = aggregated_rate_at(answer.aggregated, d.gpus)
            if layout is not None:
                print(
                    f"  at {d.gpus:.0f} GPUs aggregated serves {rate:.1f} requests/s "
                    f"(tp {layout.tp}{f' ep {layout.ep}' if layout.ep > 1 else ''}, "
                    f"max_running {layout.max_running}) against "
                    f"{target:g} disaggregated"
                )
        else:
            print("  disaggregated: no pair of pools meets the targets")
        if timing == "measured":
            parts = pd.concat([answer.aggregated, answer.disaggregated])
            if len(parts):
                print(
                    f"  timing: measured kernel tables for {parts['measured_share'].median():.0%}"
                    " of the qualifying candidates' time (median), roofline for the rest"
                )
        if len(answer.near_miss):
            m = answer.near_miss.iloc[0]
            which = "TPOT" if m.tpot_s / (tpot_ms / 1e3) >= m.ttft_s / (ttft_ms / 1e3) else "TTFT"
            print(
                f"  nearest miss:  {m.kind} (TTFT {m.ttft_s * 1e3:.0f} ms, TPOT "
                f"{m.tpot_s * 1e3:.1f} ms) misses its {which} target by "
                f"{100 * (m.miss - 1):.0f}%"
            )
    # every qualifying deployment and the nearest misses, as rows beside the sweep's results
    from stage_dse.results.store import new_run_id

    folder = Path(cfg.results_dir) / spec.name / "_recommend"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{new_run_id()}.parquet"
    pd.concat(candidates, ignore_index=True).assign(
        target_requests_per_s=target, ttft_sla_ms=ttft_ms, tpot_sla_ms=tpot_ms,
        prompt=np.nan if mix else prompt, output_tokens=np.nan if mix else spec.output_tokens,
        request_mix=mix_label or None,
    ).to_parquet(path)  # fmt: skip
    print(f"\nrecommendation candidates: {path}")
    return 0
