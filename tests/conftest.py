"""Shared helpers: GPT dimension substitutions and a fast numeric path for expressions."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import sympy as sp

from stage_dse.graph.symbols import S
from stage_dse.spec import ModelSpec, TrainingSpec

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# compiled families go to a cache private to this test session (exercises the compile path),
# removed when the session ends
_SESSION_CACHE = tempfile.mkdtemp(prefix="stage_dse_cache_")
os.environ["STAGE_DSE_CACHE"] = _SESSION_CACHE


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


# GPT of Narayanan et al.: ffn = 4h, head_dim = h / a, MHA, learned positions of length s
GPT_SUBS = {
    S.gemm_bytes: 2,  # bf16 GEMM inputs
    S.fp8_rowwise: 0,  # no FP8 scaling recipe
    S.fp8_wgrad_hp: 0,
    S.fp8_mx: 0,
    S.recompute_share: 1,  # full recompute covers every layer
    S.ffn: 4 * S.hidden,
    S.head_dim: S.hidden / S.heads,
    S.kv_heads: S.heads,
    S.positions: S.seq,
}


def gpt(layers=4, hidden=1024, heads=16, vocab=51200, **kw) -> ModelSpec:
    return ModelSpec(
        name="gpt_test",
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=4 * hidden,
        num_heads=heads,
        vocab_size=vocab,
        **kw,
    )


def llama(layers=4, hidden=1024, heads=16, kv_heads=4, ffn=2816, vocab=32000) -> ModelSpec:
    return ModelSpec(
        name="llama_test",
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=vocab,
        norm="rmsnorm",
        mlp="swiglu",
        position="rope",
        tied_embeddings=False,
        bias=False,
        dropout=False,
    )


def same(a: sp.Expr, b: sp.Expr) -> bool:
    """Symbolic equality of two rational expressions."""
    return sp.simplify(sp.cancel(sp.expand(a - b))) == 0


@pytest.fixture
def training() -> TrainingSpec:
    return TrainingSpec(seq_len=2048, global_batch_size=64)


@pytest.fixture
def run_python():
    """Runs Python source in a fresh interpreter (``env`` as given, in ``cwd``) and returns its
    stdout split on whitespace; a failure shows the child's stderr."""
    import subprocess
    import sys

    def run(code: str, env: dict, cwd=None) -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            check=False,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()

    return run
