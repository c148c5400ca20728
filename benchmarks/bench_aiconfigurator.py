"""NVIDIA AIConfigurator beside ``stage-dse-validate`` on the serving corpus.

What it compares
    Every serving case of the corpus (``stage_dse/validation/corpus/serving/*.yaml``, read with
    :func:`stage_dse.validation.corpus.load_corpus`) that AIConfigurator (the "peer") can
    express is estimated by the peer's own entry point, ``aiconfigurator.cli.api.cli_estimate``
    (the function behind ``aiconfigurator cli estimate``), and the same cases are predicted by
    ``stage-dse-validate --kind serving`` under ``timing=roofline`` and ``timing=measured``.
    Errors are ``predicted / published - 1`` for both, on the published metric; the tables give
    the mean absolute error per group (source / target kind) and overall on the SAME cases
    (those both tools predict), and the CPU-seconds each tool spent.

Install the peer (its own venv, so the project's environment is not changed)
    python -m venv ~/venvs/aic && ~/venvs/aic/bin/pip install aiconfigurator
    python benchmarks/bench_aiconfigurator.py --aic-python ~/venvs/aic/bin/python

    ``--aic-python`` defaults to ``$STAGE_DSE_AIC_PYTHON``, else this interpreter when it can
    import ``aiconfigurator``; without the peer the script prints why and "skipped" (exit 0).
    The peer runs in a subprocess of its interpreter (``benchmarks/_aic_driver.py``, JSON in
    and out); this process never imports it.

How a case is translated (nothing is fitted or tuned)
    * model: the checkpoint the peer ships for the corpus model and weight dtype (e.g.
      ``llama3_70b`` fp8 -> ``nvidia/Llama-3.1-70B-Instruct-FP8``); without a shipped checkpoint
      of that dtype, the shipped base checkpoint with the quant modes the peer itself infers
      for such a checkpoint (fp8: ``fp8_static`` GEMMs, fp8 MoE/FMHA/KV, as for a ModelOpt FP8
      checkpoint; fp4: ``nvfp4``, fp8 FMHA/KV). Dense Llama-architecture corpus models the peer
      ships no config for (Llama 2) get a ``LlamaForCausalLM`` config.json written from the
      corpus preset's dimensions (``--no-preset-configs``: count them as not expressible);
      the ``peer_model_source`` column says which. A stated KV dtype sets the KV quant mode.
    * GPU: h100_sxm, h200 -> h200_sxm, a100_80gb -> a100_sxm, b200 -> b200_sxm, gb200, gb300,
      rtx_pro_6000 -> rtx_pro_6000_server. Engine: trtllm, vllm or sglang, at the database
      version the peer resolves as current for that GPU (the peer keeps one per GPU and
      engine, mostly newer than the published runs: ``engine_version`` and ``peer_version``
      columns).
    * layout, as stage_dse reads the record: a replica is tp x pp x ep GPUs with ep
      attention data-parallel ranks; the peer gets ``tp_size=tp, pp_size=pp,
      attention_dp_size=ep, moe_tp_size=tp, moe_ep_size=ep``; ``n_gpus / (tp*pp*ep)`` replicas.
    * ``static`` cases (a batch prefilled and decoded together; batch-1 TTFT/TPOT): the peer's
      static mode at ``batch / ep`` per rank.
    * ``inflight_max`` (offline throughput) and ``burst`` (throughput and TPOT of requests
      sent at once): the peer's aggregated in-flight-batching estimate (``mode="agg"``, the one
      its own sweep evaluates for a running batch) with ``ctx_tokens`` = the engine's
      ``max_num_tokens`` (kept <= (batch-1) x ISL, one request decoding, as the peer's sweep
      requires) and the running batch = the engine's ``max_batch`` per rank (at most the
      requests sent, per replica), lowered by bisection to the largest batch the peer's own
      memory check accepts (its KV-cache capacity / OOM check, as its sweep does).
    * metric from the peer's requests/s (``seq/s``), TTFT and TPOT with the same definitions
      as stage_dse's serving validation (``out_tok_s = seq/s x OSL x replicas`` ...); a static
      case the peer flags as out of memory keeps its figures (status ``oom``), as in stage_dse.
    * not expressible, with the reason counted in a table: closed-loop / other deployments,
      burst TTFT (queueing), p90+ latencies, unstated engine limits, models or GPUs the peer
      has no config / data for, and every case the peer itself refuses (its error message).

Read the output
    First the exclusion table (reason, count), then per group: ``peer n`` cases the peer
    predicts and its mean |error| on them; ``same n`` of those also predicted by stage_dse
    under both timings, with the peer's, stage_dse roofline's and measured's mean |error| and
    the signed means on that same set; then the same by target kind and by the peer's mode,
    and the CPU-seconds of each run (stage_dse's runs cover the whole serving corpus in one
    vectorized pass). A stage_dse run that fails is reported there, and the same set then
    uses the timing that ran. ``--cases`` adds one line per predicted case.
    ``--out`` (default ``/tmp/stage_dse_aic/bench_aiconfigurator.parquet``; ``.csv`` works
    too) gets one row per serving case with both tools' predictions and errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from stage_dse.validation.corpus import Case, load_corpus

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DRIVER = HERE / "_aic_driver.py"
DEFAULT_OUT = Path(tempfile.gettempdir()) / "stage_dse_aic" / "bench_aiconfigurator.parquet"

# corpus hardware preset -> the peer's system name
SYSTEMS = {
    "h100_sxm": "h100_sxm",
    "h200": "h200_sxm",
    "a100_80gb": "a100_sxm",
    "b200": "b200_sxm",
    "gb200": "gb200",
    "gb300": "gb300",
    "rtx_pro_6000": "rtx_pro_6000_server",
}
BLACKWELL = {"b200_sxm", "gb200", "gb300", "rtx_pro_6000_server"}

# corpus model preset -> the checkpoint the peer ships, per weight dtype ("base": the one used
# with explicit quant modes when the dtype has no checkpoint of its own)
CHECKPOINTS: dict[str, dict[str, str]] = {
    "llama3_8b": {"base": "meta-llama/Meta-Llama-3.1-8B", "bf16": "meta-llama/Meta-Llama-3.1-8B"},
    "llama3_70b": {
        "base": "meta-llama/Meta-Llama-3.1-70B",
        "bf16": "meta-llama/Meta-Llama-3.1-70B",
        "fp8": "nvidia/Llama-3.1-70B-Instruct-FP8",
    },
    "llama3_405b": {
        "base": "meta-llama/Meta-Llama-3.1-405B",
        "bf16": "meta-llama/Meta-Llama-3.1-405B",
    },
    "qwen3_8b": {"base": "Qwen/Qwen3-8B", "bf16": "Qwen/Qwen3-8B"},
    "qwen3_32b": {"base": "Qwen/Qwen3-32B", "bf16": "Qwen/Qwen3-32B", "fp8": "Qwen/Qwen3-32B-FP8"},
    "qwen3_30b_a3b": {
        "base": "Qwen/Qwen3-30B-A3B",
        "bf16": "Qwen/Qwen3-30B-A3B",
        "fp8": "Qwen/Qwen3-30B-A3B-FP8",
    },
    "qwen3_235b_a22b": {
        "base": "Qwen/Qwen3-235B-A22B",
        "bf16": "Qwen/Qwen3-235B-A22B",
        "fp8": "Qwen/Qwen3-235B-A22B-FP8",
        "fp4": "nvidia/Qwen3-235B-A22B-NVFP4",
    },
    # DeepSeek-V3 architecture (R1 and V3 share it): native block-fp8; NVFP4 from the V3.1 one
    "deepseek_v3": {"fp8": "deepseek-ai/DeepSeek-R1", "fp4": "nvidia/DeepSeek-V3.1-NVFP4"},
    "deepseek_r1": {"fp8": "deepseek-ai/DeepSeek-R1", "fp4": "nvidia/DeepSeek-V3.1-NVFP4"},
    "deepseek_v3_2": {"fp8": "deepseek-ai/DeepSeek-V3.2", "fp4": "nvidia/DeepSeek-V3.2-NVFP4"},
    # gpt-oss ships MXFP4 experts: the corpus' "fp4"
    "gpt_oss_20b": {"fp4": "openai/gpt-oss-20b"},
    "gpt_oss_120b": {"fp4": "openai/gpt-oss-120b"},
    "llama4_scout": {
        "base": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
        "bf16": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    },
    "llama4_maverick": {
        "base": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
        "bf16": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
    },
    "mixtral_8x7b": {"base": "mistralai/Mixtral-8x7B-v0.1", "bf16": "mistralai/Mixtral-8x7B-v0.1"},
}
# the quant modes the peer infers from a checkpoint of that kind (its helpers'
# _infer_quant_modes_from_raw_config), for a base checkpoint used at another dtype
QUANT_AS_CHECKPOINT = {
    "fp8": {
        "gemm_quant_mode": "fp8_static",
        "moe_quant_mode": "fp8",
        "fmha_quant_mode": "fp8",
        "kvcache_quant_mode": "fp8",
    },
    "fp4": {
        "gemm_quant_mode": "nvfp4",
        "moe_quant_mode": "nvfp4",
        "fmha_quant_mode": "fp8",
        "kvcache_quant_mode": "fp8",
    },
    "int4": {"gemm_quant_mode": "int4_wo", "moe_quant_mode": "int4_wo"},
}
KV_MODES = {"bf16": "bfloat16", "fp16": "bfloat16", "fp8": "fp8"}


class NotExpressible(Exception):
    """The peer cannot express this case; ``args[0]`` is the reason counted in the table."""


# ----------------------------------------------------------------------------- peer discovery


def peer_python(arg: str | None) -> tuple[str | None, str]:
    """The peer's interpreter and, when there is none, why."""
    if arg:
        return (arg, "") if Path(arg).exists() else (None, f"--aic-python {arg}: no such file")
    env = os.environ.get("STAGE_DSE_AIC_PYTHON")
    if env:
        if Path(env).exists():
            return env, ""
        return None, f"STAGE_DSE_AIC_PYTHON={env}: no such file"
    import importlib.util

    if importlib.util.find_spec("aiconfigurator") is not None:
        return sys.executable, ""
    return None, (
        "aiconfigurator is not installed here and neither --aic-python nor "
        "STAGE_DSE_AIC_PYTHON names an interpreter that has it"
    )


def call_driver(python: str, request: dict, workdir: Path) -> tuple[dict, float, str]:
    """Run the driver with the peer's interpreter: (its answer, CPU-seconds, stderr tail)."""
    src, dst = workdir / "request.json", workdir / "answer.json"
    src.write_text(json.dumps(request))
    dst.unlink(missing_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [python, str(DRIVER), str(src), str(dst)], capture_output=True, text=True, check=False
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
    if proc.returncode != 0 or not dst.exists():
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"driver exited {proc.returncode}: {last}")
    return json.loads(dst.read_text()), cpu, tail


# ----------------------------------------------------------------------------- translation


def _engine(case: Case) -> str | None:
    engine = (case.fields.get("engine") or "").lower()
    if engine in ("trtllm", "vllm", "sglang"):
        return engine
    text = f"{engine} {case.source.framework}".lower()
    names = (("trtllm", ("tensorrt-llm", "trtllm")), ("vllm", ("vllm",)), ("sglang", ("sglang",)))
    for name, keys in names:
        if any(k in text for k in keys):
            return name
    return None


def _preset_config(name: str, isl: int, osl: int) -> dict | None:
    """A LlamaForCausalLM config.json from a dense Llama-like corpus preset (else None)."""
    from stage_dse.config import load_model
    from stage_dse.config.presets import list_presets

    if name not in list_presets("model"):
        return None
    m = load_model(name)
    plain = (
        m.num_experts == 0
        and m.q_lora_rank == 0
        and m.kv_lora_rank == 0
        and not m.bias
        and str(getattr(m.mlp, "value", m.mlp)) == "swiglu"
        and str(getattr(m.norm, "value", m.norm)) == "rmsnorm"
        and str(getattr(m.position, "value", m.position)) == "rope"
        and name.startswith("llama")
    )
    if not plain:
        return None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "num_hidden_layers": m.num_layers,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": max(4096, m.max_positions or 0, isl + osl),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": bool(m.tied_embeddings),
        "torch_dtype": "bfloat16",
    }


def _model(case: Case, info: dict, preset_configs: bool) -> tuple[dict, str, dict]:
    """(model fields of the job, where the config comes from, quant-mode overrides)."""
    f = case.fields
    name = f["model"]
    weights = {"fp16": "bf16"}.get(f.get("weights", "bf16"), f.get("weights", "bf16"))
    quant: dict[str, str] = {}
    table = CHECKPOINTS.get(name)
    if table is not None:
        hf = table.get(weights)
        if hf is None:
            hf = table.get("base")
            if hf is None or weights not in QUANT_AS_CHECKPOINT:
                raise NotExpressible(f"no shipped checkpoint for {name} at {weights} weights")
            quant.update(QUANT_AS_CHECKPOINT[weights])
        if hf in info["listed_models"]:
            model, source = {"model_path": hf}, f"shipped {hf}"
        elif hf in info["shipped_configs"]:
            model, source = {"shipped_config": hf}, f"shipped config {hf} (local dir)"
        else:
            raise NotExpressible(f"model {name}: the peer ships no config (it would download it)")
    else:
        config = _preset_config(name, f["isl"], f["osl"]) if preset_configs else None
        if config is None:
            raise NotExpressible("model not shipped with the peer (no config, no download here)")
        if weights in QUANT_AS_CHECKPOINT:
            quant.update(QUANT_AS_CHECKPOINT[weights])
        elif weights != "bf16":
            raise NotExpressible(f"{weights} weights")
        model, source = {"local_config": config}, f"config.json from corpus preset {name}"
    if weights == "fp4" and SYSTEMS.get(f["hardware"]) not in BLACKWELL and "gpt_oss" not in name:
        raise NotExpressible("nvfp4 weights on a GPU without fp4 tensor cores")
    kv = f.get("kv")
    if kv is not None:
        if kv not in KV_MODES:
            raise NotExpressible(f"kv dtype {kv}")
        quant["kvcache_quant_mode"] = KV_MODES[kv]
    return model, source, quant


def translate(case: Case, info: dict, preset_configs: bool) -> dict:
    """The driver job of a case (a :class:`NotExpressible` with the reason otherwise)."""
    f = case.fields
    mode, kind = f["mode"], case.target_kind
    if mode not in ("static", "inflight_max", "burst"):
        raise NotExpressible(f"mode {mode}: outside this comparison (static, inflight_max, burst)")
    if mode == "burst" and kind in ("ttft_ms", "e2e_latency_s"):
        raise NotExpressible("burst TTFT/latency (the queue of requests sent at once)")
    stat = case.target.get("statistic", "mean")
    if stat in ("p90", "p95", "p99"):
        raise NotExpressible(f"{stat} latency (the peer gives means)")
    if kind == "prefill_tok_s_gpu":
        raise NotExpressible("prefill-only deployment metric")
    backend = _engine(case)
    if backend is None:
        raise NotExpressible("engine not one of trtllm, vllm, sglang")
    system = SYSTEMS.get(f["hardware"])
    if system is None:
        raise NotExpressible(f"GPU {f['hardware']!r} has no peer system")
    model, source, quant = _model(case, info, preset_configs)
    tp, pp, ep = f["tp"], f.get("pp", 1), f.get("ep", 1)
    gpus = tp * pp * ep
    if f["n_gpus"] % gpus:
        raise NotExpressible("n_gpus not a multiple of tp*pp*ep")
    job = {
        **model,
        "system": system,
        "backend": backend,
        "isl": f["isl"],
        "osl": f["osl"],
        "tp": tp,
        "pp": pp,
        "dp": ep,
        "moe_tp": tp,
        "moe_ep": ep,
        "quant": quant,
        "model_source": source,
    }
    if mode == "static":
        if f["batch"] % ep:
            raise NotExpressible("batch does not split over the attention ranks")
        return {**job, "mode": "static", "batch": f["batch"] // ep}
    if "max_batch" not in f or "max_num_tokens" not in f:
        raise NotExpressible("engine limits (max_batch / max_num_tokens) not stated")
    replicas = f["n_gpus"] // gpus
    running = f["max_batch"]
    if f.get("num_requests"):
        running = min(running, math.ceil(f["num_requests"] / replicas))
    return {
        **job,
        "mode": "agg",
        "max_batch": max(1, running // ep),
        "ctx_tokens": f["max_num_tokens"],
    }


def metric(case: Case, res: dict) -> float:
    """The published metric from the peer's requests/s, TTFT and TPOT (stage_dse's formulas)."""
    f = case.fields
    gpus = f["tp"] * f.get("pp", 1) * f.get("ep", 1)
    replicas = f["n_gpus"] / gpus
    ttft, tpot = res["ttft_ms"] / 1e3, res["tpot_ms"] / 1e3
    req_s = res["seq_s"] * replicas
    out_tok_gpu = req_s * f["osl"] / f["n_gpus"]
    kind = case.target_kind
    if kind in ("tpot_ms", "itl_ms", "out_tok_s_user") and not tpot > 0:
        return float("nan")
    return {
        "out_tok_s_gpu": lambda: out_tok_gpu,
        "out_tok_s": lambda: out_tok_gpu * f["n_gpus"],
        "out_tok_s_user": lambda: 1.0 / tpot,
        "total_tok_s": lambda: out_tok_gpu * f["n_gpus"] * (f["isl"] + f["osl"]) / f["osl"],
        "total_tok_s_gpu": lambda: out_tok_gpu * (f["isl"] + f["osl"]) / f["osl"],
        "ttft_ms": lambda: ttft * 1e3,
        "tpot_ms": lambda: tpot * 1e3,
        "itl_ms": lambda: tpot * 1e3,
        "e2e_latency_s": lambda: ttft + (f["osl"] - 1) * tpot,
        "request_s": lambda: req_s,
    }[kind]()


def _peer_reason(res: dict) -> str:
    """A countable reason for a case the peer refused (its exception, without paths)."""
    err = res.get("error", "")
    head, _, rest = err.partition(": ")
    rest = rest.split(" at /")[0].split(" Try ")[0]
    if head == "PerfDataNotAvailableError":
        what = rest.split("{")[0].replace("perf database error: ", "").strip()
        return f"peer: {what or 'perf data missing'}"
    if head == "RuntimeError" and rest.startswith("OOM"):
        return "peer: OOM (weights do not fit)"
    if head == "MemoryError":
        return "peer: not one request's KV cache fits"
    if head == "LookupError":
        return f"peer: {rest}"
    return f"peer: {head}: {rest[:70]}"


# ----------------------------------------------------------------------------- stage_dse


def run_stage_dse(timing: str, out: Path) -> tuple[pd.DataFrame | None, float, str]:
    """``stage-dse-validate --kind serving timing=...`` in a subprocess: rows, CPU-s, last line."""
    code = "import sys; from stage_dse.cli.validate import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, f"timing={timing}", "--kind", "serving", "--quiet"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
    notes = [ln for ln in lines if ln.startswith(("note:", "validated"))]
    if proc.returncode != 0 or not out.exists():
        return None, cpu, (proc.stderr.strip().splitlines() or ["failed"])[-1]
    return pd.read_parquet(out), cpu, "; ".join(notes)


# ----------------------------------------------------------------------------- report


def _mae(x: pd.Series) -> float:
    x = x.dropna()
    return float(x.abs().mean()) if len(x) else float("nan")


def _signed(x: pd.Series) -> float:
    x = x.dropna()
    return float(x.mean()) if len(x) else float("nan")


def _p(v: float, sign: str = "") -> str:
    return f"{v:{sign}.1f}" if np.isfinite(v) else "-"


def summary_rows(df: pd.DataFrame, by: str) -> list[tuple]:
    rows = []
    groups = [(name, g) for name, g in df.groupby(by, sort=True)]
    groups.append(("ALL", df))
    for name, g in groups:
        peer = g[g["peer_has"]]
        same = g[g["same"]]
        if not len(peer):
            continue
        rows.append(
            (
                name,
                len(peer),
                _mae(peer["peer_err_pct"]),
                len(same),
                _mae(same["peer_err_pct"]),
                _mae(same["sd_roofline_err_pct"]),
                _mae(same["sd_measured_err_pct"]),
                _signed(same["peer_err_pct"]),
                _signed(same["sd_roofline_err_pct"]),
            )
        )
    return rows


def print_summary(title: str, rows: list[tuple], width: int) -> None:
    print(f"\n{title}")
    print(
        f"  {'':{width}s} {'peer':>5s} {'peer':>7s} | {'same':>5s} {'peer':>7s} {'roof':>7s} "
        f"{'meas':>7s} {'peer':>7s} {'roof':>7s}"
    )
    print(
        f"  {'group':{width}s} {'n':>5s} {'|e|%':>7s} | {'n':>5s} {'|e|%':>7s} {'|e|%':>7s} "
        f"{'|e|%':>7s} {'sign%':>7s} {'sign%':>7s}"
    )
    for name, n, mae, ns, pm, rm, mm, ps, rs in rows:
        print(
            f"  {name:{width}s} {n:5d} {_p(mae):>7s} | {ns:5d} {_p(pm):>7s} {_p(rm):>7s} "
            f"{_p(mm):>7s} {_p(ps, '+'):>7s} {_p(rs, '+'):>7s}"
        )


def main(argv: list[str] | None = None) -> int:
    work = Path(tempfile.mkdtemp(prefix="stage_dse_aic_"))
    try:
        return run(argv, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(argv: list[str] | None, work: Path) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--aic-python", help="the interpreter that has aiconfigurator installed")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="per-case .parquet or .csv")
    p.add_argument("--source", action="append", default=[], help="only this source id (repeat)")
    p.add_argument(
        "--no-preset-configs",
        action="store_true",
        help="do not hand the peer config.json files written from corpus presets (Llama 2)",
    )
    p.add_argument("--cases", action="store_true", help="print one line per compared case")
    args = p.parse_args(argv)
    out = args.out.resolve()
    if out.suffix not in (".parquet", ".csv"):
        p.error(f"--out {args.out}: give a .parquet or .csv file")
    if out.is_relative_to(REPO):
        p.error(f"--out {args.out}: write outside the repository")

    python, why = peer_python(args.aic_python)
    if python is None:
        print(f"bench_aiconfigurator: {why}")
        print("skipped: AIConfigurator is not available")
        return 0
    try:
        info, info_cpu, _ = call_driver(python, {"op": "info"}, work)
    except (RuntimeError, OSError) as exc:
        print(f"bench_aiconfigurator: {python} cannot run the peer ({exc})".splitlines()[0])
        print("skipped: AIConfigurator is not available")
        return 0
    print(
        f"peer: aiconfigurator {info['aiconfigurator']} (core {info['aiconfigurator_core']}, "
        f"python {info['python']}) at {python}"
    )

    cases = load_corpus("serving")
    if args.source:
        cases = [c for c in cases if c.source.id in set(args.source)]
    jobs, excluded = [], {}
    for i, case in enumerate(cases):
        try:
            job = translate(case, info, not args.no_preset_configs)
        except NotExpressible as exc:
            excluded[case.id] = str(exc)
            continue
        jobs.append({**job, "id": i})
    print(f"{len(cases)} serving cases; {len(jobs)} translated for the peer")

    t0 = time.perf_counter()
    try:
        answer, peer_cpu, tail = call_driver(python, {"op": "estimate", "jobs": jobs}, work)
    except (RuntimeError, OSError) as exc:
        print(f"bench_aiconfigurator: the peer's estimates failed: {exc}")
        return 1
    peer_wall = time.perf_counter() - t0
    results = {r["id"]: r for r in answer["results"]}

    sd = {}
    sd_cpu = {}
    sd_note = {}
    for timing in ("roofline", "measured"):
        frame, cpu, note = run_stage_dse(timing, work / f"stage_dse_{timing}.parquet")
        sd[timing] = frame.set_index("case") if frame is not None else None
        sd_cpu[timing], sd_note[timing] = cpu, note

    rows = []
    job_of = {j["id"]: j for j in jobs}
    for i, case in enumerate(cases):
        f = case.fields
        row = {
            "case": case.id,
            "group": case.group,
            "source": case.source.id,
            "kind": case.target_kind,
            "mode": f["mode"],
            "model": f["model"],
            "hardware": f["hardware"],
            "engine": _engine(case) or "",
            "engine_version": str(f.get("engine_version", "")),
            "layout": f"tp{f['tp']} pp{f.get('pp', 1)} ep{f.get('ep', 1)} n{f['n_gpus']}",
            "weights": f.get("weights", ""),
            "kv": f.get("kv", ""),
            "isl": f["isl"],
            "osl": f["osl"],
            "published": case.value,
        }
        if case.id in excluded:
            row.update(peer_status="not expressible", peer_reason=excluded[case.id])
        else:
            job, res = job_of[i], results[i]
            row.update(
                peer_model_source=job["model_source"],
                peer_system=job["system"],
                peer_backend=job["backend"],
                peer_mode=job["mode"],
                peer_cpu_s=res["cpu_s"],
            )
            if res["status"] == "error":
                row.update(peer_status="not expressible", peer_reason=_peer_reason(res))
                row["peer_error"] = res["error"][:500]
            else:
                pred = metric(case, res)
                row.update(
                    peer_status=res["status"] if np.isfinite(pred) else "not expressible",
                    peer_reason="" if np.isfinite(pred) else "no TPOT for a 1-token output",
                    peer_predicted=pred,
                    peer_err_pct=100 * (pred / case.value - 1) if np.isfinite(pred) else np.nan,
                    peer_version=res["version"],
                    peer_quant=res["quant"],
                    peer_batch=res["batch"],
                    peer_ctx_tokens=res["ctx_tokens"],
                    peer_ttft_ms=res["ttft_ms"],
                    peer_tpot_ms=res["tpot_ms"],
                    peer_seq_s=res["seq_s"],
                    peer_warning=res["warning"][:300],
                )
        for timing in ("roofline", "measured"):
            frame = sd[timing]
            if frame is not None and case.id in frame.index:
                r = frame.loc[case.id]
                row[f"sd_{timing}_status"] = r["status"]
                row[f"sd_{timing}_predicted"] = r.get("predicted", np.nan)
                row[f"sd_{timing}_err_pct"] = r.get("err_pct", np.nan)
                row[f"sd_{timing}_reason"] = r.get("reason", "")
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in ("sd_roofline_status", "sd_measured_status", "peer_err_pct"):
        if col not in df:
            df[col] = np.nan if col.endswith("pct") else ""
    for timing in ("roofline", "measured"):
        if f"sd_{timing}_err_pct" not in df:
            df[f"sd_{timing}_err_pct"] = np.nan
    df["peer_has"] = df["peer_status"].isin(("ok", "oom")) & df["peer_err_pct"].notna()
    ran = [t for t in ("roofline", "measured") if sd[t] is not None]
    sd_has = pd.Series(bool(ran), index=df.index)
    for timing in ran:
        sd_has &= df[f"sd_{timing}_status"].isin(("ok", "oom")) & np.isfinite(
            df[f"sd_{timing}_err_pct"].astype(float)
        )
    df["same"] = df["peer_has"] & sd_has

    # --- exclusions
    reasons = Counter(df.loc[~df["peer_has"], "peer_reason"])
    print(f"\nnot expressible by the peer: {int((~df['peer_has']).sum())} of {len(df)} cases")
    for reason, n in reasons.most_common():
        print(f"  {n:5d}  {reason}")
    if tail and not len(answer["results"]):
        print(f"  (driver: {tail})")
    by_group = df[df["peer_has"]].groupby("group").size()
    print(f"\nexpressible by the peer: {int(df['peer_has'].sum())} cases in {len(by_group)} groups")
    sources = df.loc[df["peer_has"], "peer_model_source"].astype(str)
    print(
        f"  model configs: {int(sources.str.startswith('shipped').sum())} shipped by the peer, "
        f"{int(sources.str.startswith('config.json').sum())} written from corpus presets"
    )
    oom = int((df["peer_status"] == "oom").sum())
    if oom:
        print(f"  {oom} static cases the peer flags as out of memory (predicted all the same)")

    if args.cases:
        print(f"\n{'case':62s} {'published':>10s} {'peer':>8s} {'roof':>8s} {'meas':>8s}  peer run")
        for r in df[df["peer_has"]].itertuples():
            print(
                f"{r.case[:62]:62s} {r.published:10.4g} {r.peer_err_pct:+7.1f}% "
                f"{_p(r.sd_roofline_err_pct, '+'):>7s}% {_p(r.sd_measured_err_pct, '+'):>7s}%  "
                f"{r.peer_backend} {r.peer_version} {r.peer_mode} b={r.peer_batch} "
                f"{r.peer_quant}"
            )

    width = max(22, *(len(g) for g in df.loc[df["peer_has"], "group"]), 5)
    failed = [t for t in ("roofline", "measured") if t not in ran]
    print(
        "\nmean |error| % (error = predicted / published - 1); 'same': the cases both tools "
        f"predict (stage_dse under {' and '.join(ran) or 'no'} timing); sign%: the signed mean "
        "on that set"
        + (f"; stage_dse timing={', '.join(failed)} failed: see CPU-seconds" if failed else "")
    )
    print_summary("per group:", summary_rows(df, "group"), width)
    print_summary("per target kind:", summary_rows(df, "kind"), width)
    print_summary("per peer mode:", summary_rows(df.assign(pm=df.get("peer_mode")), "pm"), width)

    n_peer = int(df["peer_has"].sum())
    print("\nCPU-seconds:")
    print(
        f"  peer (aiconfigurator cli_estimate, {len(jobs)} cases run, {n_peer} predicted): "
        f"{peer_cpu:.1f} CPU-s ({peer_wall:.1f} s wall, startup and info {info_cpu:.1f} CPU-s)"
    )
    for timing in ("roofline", "measured"):
        ok = sd[timing] is not None
        n = len(sd[timing]) if ok else 0
        print(
            f"  stage-dse-validate --kind serving timing={timing} ({n} cases, whole serving "
            f"corpus): {sd_cpu[timing]:.1f} CPU-s"
            + (f"  [{sd_note[timing]}]" if sd_note[timing] else "")
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    df = df.drop(columns=["peer_has"]).assign(peer_predicts=df["peer_has"])
    if out.suffix == ".parquet":
        df.to_parquet(out, index=False)
    else:
        df.to_csv(out, index=False)
    print(f"\nwrote {len(df)} rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
