"""recommend: the fewest GPUs that serve a request rate within TTFT and TPOT targets."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.errors import ConfigError
from stage_dse.runner.recommend import recommend

TARGET, TTFT, TPOT = 20.0, 1.0, 0.05


def ask(model="llama3_70b", **targets):
    """recommend() for a 2048 + 256 token workload on H100s; ``targets`` override the default
    rate and latency targets."""
    args = {"target_requests_per_s": TARGET, "ttft_sla_s": TTFT, "tpot_sla_s": TPOT, **targets}
    return recommend(
        load_model(model),
        load_hardware("h100_sxm"),
        load_cluster("dgx_h100", num_gpus=8),
        prompt=2048,
        output_tokens=256,
        **args,
    )


@pytest.fixture(scope="module")
def answer():
    return ask()


def md1_ttft(ttft0, mu, load):
    rho = load / mu
    return np.inf if rho >= 1 else ttft0 + rho / (2 * (1 - rho)) / mu


def test_aggregated_answer_meets_the_sla_and_one_replica_fewer_does_not(answer):
    best = answer.aggregated.iloc[0]
    n, mu = best["replicas"], best["replica_requests_per_s"]
    assert best["tpot_s"] <= TPOT
    assert md1_ttft(best["ttft_s"], mu, TARGET / n) <= TTFT + 1e-12
    assert md1_ttft(best["ttft_s"], mu, TARGET / (n - 1)) > TTFT
    assert best["gpus"] == n * best["tp"]
    assert (answer.aggregated["gpus"] >= best["gpus"]).all()


def test_disaggregated_answer_sizes_both_pools(answer):
    best = answer.disaggregated.iloc[0]
    assert best["tpot_s"] <= TPOT and best["ttft_s"] <= TTFT
    assert best["gpus"] == (
        best["prefill_replicas"] * best["prefill_tp"] + best["decode_replicas"] * best["decode_tp"]
    )
    assert (answer.disaggregated["gpus"] >= best["gpus"]).all()


def test_an_impossible_target_names_the_nearest_miss():
    # 2 ms per token: below any 70B decode step on H100
    answer = ask(target_requests_per_s=5, tpot_sla_s=0.002)
    assert answer.aggregated.empty and answer.disaggregated.empty
    near = answer.near_miss.iloc[0]
    assert near["miss"] > 1 and near["miss"] == answer.near_miss["miss"].min()
    assert near["tpot_s"] / 0.002 == pytest.approx(near["miss"])


def test_targets_must_be_positive():
    with pytest.raises(ConfigError, match="tpot_sla_s must be > 0, got 0"):
        ask("llama3_8b", target_requests_per_s=1, tpot_sla_s=0)


def test_the_sla_sweep_prints_its_front_and_both_recommendations(tmp_path, capsys):
    from test_sweep import compose_cfg

    from stage_dse.cli import run
    from stage_dse.results import load

    run(compose_cfg(["+sweep=llama3_70b_serving_sla", f"results_dir={tmp_path}"]))
    out = capsys.readouterr().out
    assert "Pareto front of tokens/s per GPU vs tokens/s per user" in out
    for hw in ("h100_sxm", "h200"):
        block = out.split(f"\n{hw}:\n")[1]
        assert block.lstrip().startswith("aggregated:") and "disaggregated:" in block
    (saved,) = (tmp_path / "llama3_70b_serving_sla" / "_recommend").glob("*.parquet")
    candidates = pd.read_parquet(saved)
    assert {"aggregated", "disaggregated"} <= set(candidates["part"])
    assert set(candidates["hardware"]) == {"h100_sxm", "h200"}
    rows = load(tmp_path / "llama3_70b_serving_sla")
    assert set(rows["serving_mode"]) == {"continuous"} and rows["config_hash"].is_unique
    assert set(rows["hardware"]) == {"h100_sxm", "h200"}
    assert (rows["requests_per_s"] > 0).all() and (rows["tokens_per_s_per_user"] > 0).all()
    # the same layouts as static rows hash differently (the scheduler is part of the question)
    run(
        compose_cfg(
            [
                "+sweep=llama3_70b_serving_sla",
                f"results_dir={tmp_path}",
                "sweep_name=static",
                "serving.mode=static",
                "serving.target_requests_per_s=0",
            ]
        )
    )
    static = load(tmp_path / "static")
    assert not set(static["config_hash"]) & set(rows["config_hash"])


def test_recommend_mode_needs_targets(tmp_path):
    from test_sweep import compose_cfg

    from stage_dse.cli import run
    from stage_dse.errors import StageDseError

    with pytest.raises(StageDseError, match=r"serving\.sla\.ttft_ms and serving\.sla\.tpot_ms"):
        run(compose_cfg(["mode=recommend", "model=llama3_8b", f"results_dir={tmp_path}"]))


def test_pools_on_other_gpus_and_links_and_the_comparison_at_equal_gpus(answer):
    from stage_dse.runner.recommend import aggregated_rate_at

    mixed = recommend(
        load_model("llama3_70b"),
        load_hardware("h200"),
        load_cluster("dgx_h100", num_gpus=8),
        prompt=2048,
        output_tokens=256,
        target_requests_per_s=TARGET,
        ttft_sla_s=TTFT,
        tpot_sla_s=TPOT,
        prefill_hardware=load_hardware("h100_sxm"),
    )
    assert set(mixed.disaggregated["prefill_hardware"]) == {"h100_sxm"}
    nvlink = ask(kv_link="nvlink")
    # the same pools, a faster link: the KV transfer and so TTFT shrink
    key = ["prefill_tp", "decode_tp", "decode_batch"]
    both = answer.disaggregated.merge(nvlink.disaggregated, on=key, suffixes=("_nic", "_nvl"))
    assert len(both) and (both["ttft_s_nvl"] < both["ttft_s_nic"]).all()
    with pytest.raises(ConfigError, match=r"serving\.kv_link='pcie' is not one of: nic, nvlink"):
        ask(kv_link="pcie")
    # at the disaggregated answer's GPUs, whole aggregated replicas at their SLA load
    d = answer.disaggregated.iloc[0]
    rate, layout = aggregated_rate_at(answer.aggregated, d["gpus"])
    replicas = np.floor(d["gpus"] / layout["replica_gpus"])
    assert rate == pytest.approx(replicas * layout["load_per_replica"])
    best = answer.aggregated.iloc[0]
    assert rate < TARGET or d["gpus"] >= best["gpus"]


def test_a_request_mix_sweep_stores_its_mix_and_hashes_apart(tmp_path):
    from test_sweep import compose_cfg

    from stage_dse.cli import run
    from stage_dse.errors import StageDseError
    from stage_dse.results import load

    base = [
        "+sweep=llama3_70b_serving_sla",
        f"results_dir={tmp_path}",
        "serving.target_requests_per_s=0",
        "serving.tp=[8]",
        "serving.hardware=[]",
    ]
    run(compose_cfg([*base, "sweep_name=plain", "serving.prompt_len=[3891]"]))
    run(
        compose_cfg(
            [*base, "sweep_name=mix", "serving.request_mix=[[2048,256,0.7],[8192,512,0.3]]"]
        )
    )
    plain, mixed = load(tmp_path / "plain"), load(tmp_path / "mix")
    assert set(mixed["request_mix"]) == {"2048x256:0.7,8192x512:0.3"}
    assert set(mixed["prompt"]) == {3891}  # the static parts at the mean prompt
    assert not set(plain["config_hash"]) & set(mixed["config_hash"])
    with pytest.raises(StageDseError, match=r"serving\.request_mix needs serving\.mode=continuous"):
        run(compose_cfg([*base, "serving.mode=static", "serving.request_mix=[[2048,256,1]]"]))
