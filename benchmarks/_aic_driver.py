"""Runs under AIConfigurator's own interpreter for ``bench_aiconfigurator.py``: JSON in, JSON out.

    python _aic_driver.py IN.json OUT.json

``IN.json`` is ``{"op": "info"}`` (the peer's version and the model configs it ships) or
``{"op": "estimate", "jobs": [...]}``, one job per corpus case, already translated to the
peer's names by the benchmark. Only the peer's public estimation entry point is called
(``aiconfigurator.cli.api.cli_estimate``, the function behind ``aiconfigurator cli estimate``);
this file imports nothing from stage_dse, so the two environments stay apart.

Job fields: ``id``, ``model_path`` (a Hugging Face id the peer ships, or ``shipped_config``: the
id of a config file in the peer's ``model_configs`` that its id list omits, or
``local_config``: a config.json mapping), ``system``, ``backend``, ``mode`` (``static`` or
``agg``), ``isl``, ``osl``, ``tp``, ``pp``, ``dp`` (attention data-parallel ranks), ``moe_tp``,
``moe_ep``, ``quant`` (quant-mode overrides, may be empty), and for ``static`` the per-rank
``batch``; for ``agg`` the per-rank ``max_batch`` and ``ctx_tokens``.

``agg`` runs the peer's in-flight-batching estimate at the largest batch not above
``max_batch`` that its own memory check accepts (weights, activations and the KV cache of
every running request; its ``kv_cache_warning`` and OOM errors), found by bisection.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback


def _quiet() -> None:
    logging.disable(logging.WARNING)
    for name in ("aiconfigurator", "aiconfigurator_core"):
        logging.getLogger(name).setLevel(logging.ERROR)


def info() -> dict:
    from importlib.metadata import version

    import aiconfigurator_core
    from aiconfigurator_core.sdk.common import DefaultHFModels

    folder = os.path.join(os.path.dirname(aiconfigurator_core.__file__), "model_configs")
    shipped = sorted(
        name[: -len("_config.json")].replace("--", "/", 1)
        for name in os.listdir(folder)
        if name.endswith("_config.json") and not name.endswith("_hf_quant_config.json")
    )
    return {
        "aiconfigurator": version("aiconfigurator"),
        "aiconfigurator_core": version("aiconfigurator-core"),
        "python": sys.version.split()[0],
        "listed_models": sorted(DefaultHFModels),
        "shipped_configs": shipped,
        "model_configs_dir": folder,
    }


class Peer:
    def __init__(self) -> None:
        from aiconfigurator.cli.api import cli_estimate
        from aiconfigurator.sdk.perf_database import get_latest_database_version

        self.estimate = cli_estimate
        self.latest = get_latest_database_version
        self.versions: dict[tuple[str, str], str | None] = {}
        self.dirs: dict[str, str] = {}
        self.tmp = tempfile.mkdtemp(prefix="aic_models_")
        self.configs = info()["model_configs_dir"]

    def version(self, system: str, backend: str) -> str | None:
        key = (system, backend)
        if key not in self.versions:
            self.versions[key] = self.latest(system=system, backend=backend)
        return self.versions[key]

    def model(self, job: dict) -> str:
        """The model_path to hand the peer (a directory for configs outside its id list)."""
        if "local_config" in job:
            key = json.dumps(job["local_config"], sort_keys=True)
            if key not in self.dirs:
                path = os.path.join(self.tmp, f"local{len(self.dirs)}")
                os.makedirs(path)
                with open(os.path.join(path, "config.json"), "w") as fh:
                    json.dump(job["local_config"], fh)
                self.dirs[key] = path
            return self.dirs[key]
        if "shipped_config" in job:
            hf = job["shipped_config"]
            if hf not in self.dirs:
                path = os.path.join(self.tmp, hf.replace("/", "--"))
                os.makedirs(path)
                stem = os.path.join(self.configs, hf.replace("/", "--"))
                pairs = (
                    ("_config.json", "config.json"),
                    ("_hf_quant_config.json", "hf_quant_config.json"),
                )
                for suffix, name in pairs:
                    if os.path.exists(stem + suffix):
                        with open(stem + suffix) as src, open(os.path.join(path, name), "w") as dst:
                            dst.write(src.read())
                self.dirs[hf] = path
            return self.dirs[hf]
        return job["model_path"]

    def run(self, job: dict) -> dict:
        version = self.version(job["system"], job["backend"])
        if version is None:
            raise LookupError(f"no perf database for {job['system']}/{job['backend']}")
        common = {
            "backend_name": job["backend"],
            "backend_version": version,
            "isl": job["isl"],
            "osl": job["osl"],
            "tp_size": job["tp"],
            "pp_size": job["pp"],
            "attention_dp_size": job["dp"],
            "moe_tp_size": job.get("moe_tp"),
            "moe_ep_size": job.get("moe_ep"),
            **job.get("quant", {}),
        }
        model = self.model(job)
        if job["mode"] == "static":
            r = self.estimate(
                model, job["system"], mode="static", batch_size=job["batch"], **common
            )
            return _result(r, version, job["batch"], None, "oom" if r.kv_cache_warning else "ok")

        def probe(b: int):
            # the engine's per-step token budget, leaving one running request decoding (the
            # peer's own sweep requires a generation request next to the prefill ones)
            ctx = min(job["ctx_tokens"], job["isl"] if b == 1 else (b - 1) * job["isl"])
            try:
                r = self.estimate(
                    model, job["system"], mode="agg", batch_size=b, ctx_tokens=ctx, **common
                )
            except RuntimeError as exc:
                if str(exc).startswith("OOM"):
                    return None, ctx, str(exc)
                raise
            return (None if r.kv_cache_warning else r), ctx, r.kv_cache_warning

        top = int(job["max_batch"])
        best, ctx, why = probe(top)
        b_used = top
        if best is None:
            lo_r, lo_ctx, why1 = probe(1)
            if lo_r is None:
                raise MemoryError(f"peer memory check: not even one request fits ({why1 or why})")
            lo, hi = 1, top  # lo fits, hi does not
            best, ctx = lo_r, lo_ctx
            while hi - lo > 1:
                mid = (lo + hi) // 2
                r, c, _ = probe(mid)
                if r is None:
                    hi = mid
                else:
                    lo, best, ctx = mid, r, c
            b_used = lo
        return _result(best, version, b_used, ctx, "ok")


def _result(r, version: str, batch: int, ctx, status: str) -> dict:
    raw = r.raw
    return {
        "status": status,
        "version": version,
        "batch": batch,
        "ctx_tokens": ctx,
        "ttft_ms": float(r.ttft),
        "tpot_ms": float(r.tpot),
        "seq_s": float(raw.get("seq/s", 0.0)),
        "request_latency_ms": float(raw.get("request_latency", 0.0)),
        "memory_gib": float(raw.get("memory", 0.0) or 0.0),
        "quant": "/".join(str(raw.get(k)) for k in ("gemm", "moe", "kvcache", "fmha", "comm")),
        "warning": r.kv_cache_warning or "",
    }


def main(argv: list[str]) -> int:
    _quiet()
    src, dst = argv
    with open(src) as fh:
        request = json.load(fh)
    if request["op"] == "info":
        out = info()
    else:
        peer = Peer()
        out = {"results": []}
        for job in request["jobs"]:
            t0 = time.process_time()
            try:
                res = peer.run(job)
            except Exception as exc:  # the peer cannot run it: reported, not fatal
                last = traceback.extract_tb(exc.__traceback__)[-1]
                res = {
                    "status": "error",
                    "error": f"{type(exc).__name__}: {exc}".strip(),
                    "where": f"{os.path.basename(last.filename)}:{last.lineno}",
                }
            res["id"] = job["id"]
            res["cpu_s"] = time.process_time() - t0
            out["results"].append(res)
        shutil.rmtree(peer.tmp, ignore_errors=True)
    with open(dst, "w") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
