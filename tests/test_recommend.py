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


# --- what the user asks: formats, layouts, running caps, request mixes, engines ---------------

BOUNDS = {"tokens", "slots", "kv", "load"}


def ask_on(model, hardware="h100_sxm", **options):
    """recommend() of ``model`` on 8-GPU nodes of ``hardware`` at the default targets (2048 +
    256 tokens unless a mix is given); ``options`` override."""
    args = {"target_requests_per_s": TARGET, "ttft_sla_s": TTFT, "tpot_sla_s": TPOT}
    if "mix" not in options:
        args.update(prompt=2048, output_tokens=256)
    return recommend(
        load_model(model),
        load_hardware(hardware),
        load_cluster("dgx_h100", num_gpus=8),
        **{**args, **options},
    )


@pytest.mark.parametrize(
    ("model", "hardware", "rate", "tpot"),
    [
        ("llama3_70b", "h100_sxm", TARGET, TPOT),
        ("llama3_8b", "h100_sxm", 40.0, 0.02),
        ("llama3_70b", "a100_80gb", 5.0, 0.08),  # no FP8 tensor cores: fp8 weights stored only
    ],
)
def test_fp8_weights_need_no_more_gpus_than_bf16(model, hardware, rate, tpot):
    runs = {
        w: ask_on(model, hardware, target_requests_per_s=rate, tpot_sla_s=tpot, weights_dtype=w)
        for w in ("bf16", "fp8")
    }
    bf16, fp8 = (runs[w].aggregated for w in ("bf16", "fp8"))
    assert len(bf16) and len(fp8)
    assert fp8["gpus"].iloc[0] <= bf16["gpus"].iloc[0]
    assert set(fp8["weights_dtype"]) == {"fp8"} and set(bf16["weights_dtype"]) == {"bf16"}
    # half the weight bytes: more sequences' cache on the same layout
    both = bf16.merge(fp8, on=["tp", "max_running", "prefill_budget"], suffixes=("_b", "_f"))
    assert len(both) and (both["kv_capacity_seqs_f"] > both["kv_capacity_seqs_b"]).all()


def test_fp8_on_h100_changes_the_answer_of_a_several_replica_case(answer):
    """Llama-3-70B at 20 requests/s on H100 (7 replicas in bf16): FP8 weights run W8A8 and
    leave twice the memory for the cache, so fewer GPUs serve the same rate."""
    fp8 = ask_on("llama3_70b", weights_dtype="fp8")
    b, f = answer.aggregated.iloc[0], fp8.aggregated.iloc[0]
    assert b["replicas"] > 2
    assert f["gpus"] < b["gpus"]
    assert (f["tp"], f["gpus"]) != (b["tp"], b["gpus"])
    assert fp8.disaggregated["gpus"].iloc[0] <= answer.disaggregated["gpus"].iloc[0]
    # the KV cache format is honoured too: an fp8 cache holds more sequences
    kv8 = ask_on("llama3_70b", kv_dtype="fp8").aggregated
    both = answer.aggregated.merge(kv8, on=["tp", "max_running", "prefill_budget"])
    assert len(both) and (both["kv_capacity_seqs_y"] > both["kv_capacity_seqs_x"]).all()
    assert set(kv8["kv_dtype"]) == {"fp8"}


@pytest.fixture(scope="module")
def loose():
    """Llama-3-70B under SGLang's limits (4,096 running requests) and a loose TPOT target:
    large batches qualify, and the KV cache is what stops them."""
    from stage_dse.config import load_engine

    return ask_on("llama3_70b", tps=(2, 4, 8), tpot_sla_s=0.2, engine=load_engine("sglang"))


def test_the_answer_never_runs_more_requests_than_the_kv_cache_holds(loose):
    rows = pd.concat([loose.aggregated, loose.near_miss[loose.near_miss["kind"] == "aggregated"]])
    assert (rows["max_running"] <= rows["kv_capacity_seqs"]).all()
    assert (rows["running"] <= rows["kv_capacity_seqs"] * (1 + 1e-9)).all()
    # the cap is the engine's, not 256: limits past 256 are tried up to the KV capacity
    assert rows["max_running"].max() > 256
    assert (rows["running_cap"] == 4096).all()
    kv = rows[rows["bound"] == "kv"]
    assert len(kv) and (kv["max_running"] == kv["kv_capacity_seqs"]).all()
    dis = loose.disaggregated
    assert (dis["decode_batch"] <= dis["kv_capacity_seqs"]).all()
    at_kv = dis[dis["bound"] == "kv"]
    assert len(at_kv) and (at_kv["decode_batch"] < at_kv["running_cap"]).all()


def test_a_running_cap_bounds_every_candidate():
    capped = ask_on("llama3_70b", max_running=16)
    assert capped.aggregated["max_running"].max() == 16
    assert capped.disaggregated["decode_batch"].max() <= 16
    assert (capped.aggregated["running"] <= 16 + 1e-9).all()


def test_every_candidate_says_what_bound_it(answer, loose):
    for frame in (answer.aggregated, answer.disaggregated, answer.near_miss, loose.aggregated):
        assert "bound" in frame and set(frame["bound"]) <= BOUNDS
    agg = loose.aggregated
    slots = agg[agg["bound"] == "slots"]
    tokens = agg[agg["bound"] == "tokens"]
    assert len(slots) and len(tokens)
    # the running limit binds: as many run as it allows; the budget binds: fewer run
    assert np.allclose(slots["running"], slots["max_running"], rtol=1e-6)
    assert (tokens["running"] < tokens["max_running"]).all()


def test_running_limits_are_powers_of_two_up_to_the_limit():
    from hypothesis import given
    from hypothesis import strategies as st

    from stage_dse.runner.recommend import running_limits

    @given(st.integers(min_value=-3, max_value=100_000))
    def check(limit):
        got = running_limits(limit)
        if limit < 1:
            assert got == ()
            return
        assert got[-1] == limit and list(got) == sorted(set(got))
        powers = [8 * 2**i for i in range(20) if 8 * 2**i < limit]
        assert list(got[:-1]) == powers

    check()


@pytest.mark.parametrize("model", ["mixtral_8x7b", "qwen3_30b_a3b"])
def test_moe_models_get_expert_parallel_candidates(model):
    moe = ask_on(model, tps=(1, 2, 4), eps=(1, 2, 4))
    agg = moe.aggregated
    wide = agg[agg["ep"] > 1]
    assert len(wide) and set(agg["ep"]) == {1, 2, 4}
    assert (agg["replica_gpus"] == agg["tp"] * agg["ep"]).all()
    assert (agg["gpus"] == agg["replicas"] * agg["replica_gpus"]).all()
    # each attention rank queues its own share: its M/D/1 TTFT meets the target
    for r in wide.head(20).itertuples():
        mu_rank, load_rank = r.replica_requests_per_s / r.ep, TARGET / r.replicas / r.ep
        assert md1_ttft(r.ttft_s, mu_rank, load_rank) <= TTFT + 1e-9
    assert (moe.disaggregated["decode_ep"] > 1).any()
    assert set(agg["expert_weights_dtype"]) == {"bf16"}


def test_a_request_mix_changes_the_answer(answer):
    mix = [(2048, 256, 0.7), (8192, 512, 0.3)]
    mixed = ask_on("llama3_70b", mix=mix)
    best, plain = mixed.aggregated.iloc[0], answer.aggregated.iloc[0]
    assert best["gpus"] != plain["gpus"]
    # output tokens/s per GPU at the mix's mean output length
    mean_out = 0.7 * 256 + 0.3 * 512
    assert best["tokens_per_s_per_gpu"] * best["gpus"] == pytest.approx(TARGET * mean_out)
    # a mix of one class is that fixed workload
    one = ask_on("llama3_70b", mix=[(2048, 256, 1.0)]).aggregated
    assert one["gpus"].iloc[0] == plain["gpus"]
    assert np.allclose(one["tpot_s"].to_numpy(), answer.aggregated["tpot_s"].to_numpy())


def test_an_engine_adds_its_costs_to_every_candidate(answer):
    from stage_dse.config import load_engine

    slow = ask_on(
        "llama3_70b", engine=load_engine("vllm", step_overhead_us=3000, request_overhead_us=0)
    )
    agg = slow.aggregated
    assert set(agg["engine"]) == {"vllm"} and set(agg["step_overhead_s"]) == {0.003}
    assert set(agg["request_overhead_s"]) == {0.0}
    key = ["tp", "max_running", "prefill_budget"]
    both = answer.aggregated.merge(agg, on=key, suffixes=("_none", "_vllm"))
    assert len(both) and (both["tpot_s_vllm"] > both["tpot_s_none"]).all()
    assert agg["gpus"].iloc[0] >= answer.aggregated["gpus"].iloc[0]
    dkey = ["prefill_tp", "decode_tp", "decode_batch"]
    dis = answer.disaggregated.merge(slow.disaggregated, on=dkey, suffixes=("_none", "_vllm"))
    assert np.allclose(dis["tpot_s_vllm"] - dis["tpot_s_none"], 0.003)


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        ("llama3_70b", {"eps": (2,)}, r"^serving\.ep=\[2\]: .*llama3_70b is dense"),
        ("llama3_70b", {"tps": (3,)}, r"^serving\.tp=\[3\]: .*tp\(3\) does not divide heads"),
        ("llama3_70b", {"tps": (16,)}, r"^serving\.tp=\[16\]: .*8 GPUs per node"),
        ("mixtral_8x7b", {"eps": (3,)}, r"^serving\.ep=\[3\]: .*does not divide experts\(8\)"),
        ("llama3_70b", {"weights_dtype": "int3"}, r"^serving\.weights_dtype='int3' is not"),
        ("llama3_70b", {"kv_dtype": "fp4"}, r"^serving\.kv_dtype=nvfp4: a 4-bit KV cache"),
        ("llama3_70b", {"expert_weights_dtype": "fp8"}, r"needs a mixture-of-experts model"),
        ("llama3_70b", {"max_running": 0}, r"^max_running \(serving\.batch_size\) must be"),
        ("llama3_70b", {"eps": ()}, r"^serving\.ep=\[\] must be integers >= 1"),
        ("llama3_70b", {"mix": [(2048, 0, 1)]}, r"^serving\.request_mix: prompt and output"),
    ],
)
def test_bad_inputs_are_one_line_errors(model, options, message):
    with pytest.raises(ConfigError, match=message) as err:
        ask_on(model, **options)
    assert "\n" not in str(err.value)


def test_unbuildable_candidates_are_skipped():
    dense = ask_on("llama3_8b", tps=(3, 4), eps=(1, 2), target_requests_per_s=2)
    assert set(dense.aggregated["tp"]) == {4} and set(dense.aggregated["ep"]) == {1}
    with pytest.raises(ConfigError, match="prompt and output_tokens or a request mix, not both"):
        recommend(
            load_model("llama3_8b"),
            load_hardware("h100_sxm"),
            load_cluster("dgx_h100", num_gpus=8),
            prompt=2048,
            output_tokens=256,
            mix=[(2048, 256, 1)],
            target_requests_per_s=1,
            ttft_sla_s=1,
            tpot_sla_s=0.05,
        )


def test_recommend_mode_passes_what_the_config_asks(tmp_path, capsys):
    from test_sweep import compose_cfg

    from stage_dse.cli import run
    from stage_dse.errors import StageDseError

    base = [
        "+sweep=llama3_70b_serving_sla",
        "mode=recommend",
        "serving.hardware=[]",
        f"results_dir={tmp_path}",
    ]
    run(compose_cfg([*base, "serving.weights_dtype=fp8", "serving.kv_dtype=fp8"]))
    out = capsys.readouterr().out
    assert "weights fp8, KV cache fp8, engine none, running requests at most 256" in out
    assert "bound by the" in out
    (saved,) = (tmp_path / "llama3_70b_serving_sla" / "_recommend").glob("*.parquet")
    rows = pd.read_parquet(saved)
    assert set(rows["weights_dtype"]) == {"fp8"} and set(rows["kv_dtype"]) == {"fp8"}
    saved.unlink()
    run(
        compose_cfg(
            [
                *base,
                "model=mixtral_8x7b",
                "serving.tp=[1,2]",
                "serving.ep=[1,2,4]",
                "serving.batch_size=[64]",
                "serving.engine=vllm",
                "serving.request_mix=[[2048,256,0.7],[8192,512,0.3]]",
            ]
        )
    )
    out = capsys.readouterr().out
    assert "of the mix 2048x256:0.7,8192x512:0.3 (prompt x output:weight)" in out
    assert "engine vllm, running requests at most 64 (serving.batch_size)" in out
    (saved,) = (tmp_path / "llama3_70b_serving_sla" / "_recommend").glob("*.parquet")
    rows = pd.read_parquet(saved)
    agg = rows[rows["part"] == "aggregated"]
    assert set(agg["tp"]) <= {1, 2} and (agg["ep"] > 1).any()
    assert agg["max_running"].max() <= 64 and set(rows["engine"]) == {"vllm"}
    assert set(rows["request_mix"]) == {"2048x256:0.7,8192x512:0.3"}  # as serving rows
    for override, field in (("serving.ep=[2]", "serving.ep"), ("serving.tp=[3]", "serving.tp")):
        with pytest.raises(StageDseError, match=rf"^{field}=\[\d\]: ") as err:
            run(compose_cfg([*base, override]))
        assert "\n" not in str(err.value)
