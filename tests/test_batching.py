"""Continuous batching with chunked prefill (stage_dse.cost.batching)."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_engine, load_hardware, load_model
from stage_dse.cost.batching import continuous_batching
from stage_dse.cost.requests import output_length_classes
from stage_dse.cost.serving import evaluate_serving_table
from stage_dse.errors import ConfigError
from stage_dse.runner.serving import serving_row
from stage_dse.spec import DType
from stage_dse.spec.serving import ServingSpec


def serving_rows(model="llama3_8b", hardware="h100_sxm", tp=1, prompt=2048, out=256, pp=1, **hw):
    serving = ServingSpec(prompt_len=prompt, output_tokens=out, batch_size=1)
    m, h = load_model(model), load_hardware(hardware, **hw)
    row, key = serving_row(m, serving, h, load_cluster("dgx_h100"), tp, pp)
    return pd.DataFrame([row]), [key]


@pytest.mark.parametrize(
    ("model", "tp", "prompt"), [("llama3_8b", 1, 2048), ("llama3_70b", 8, 1000)]
)
def test_one_running_request_with_a_whole_prompt_budget_is_the_static_batch_of_one(
    model, tp, prompt
):
    table, keys = serving_rows(model, tp=tp, prompt=prompt)
    static = evaluate_serving_table(table, keys).iloc[0]
    cb = continuous_batching(table, keys, max_running=1, prefill_budget=prompt).iloc[0]
    assert cb["cb_ttft_s"] == pytest.approx(static["serve_ttft_s"], rel=1e-12)
    assert cb["cb_tpot_s"] == pytest.approx(static["serve_tpot_s"], rel=1e-12)
    # one request at a time: its prefill, then its 256 decode steps
    per_request = static["serve_ttft_s"] + 256 * static["serve_tpot_s"]
    assert cb["cb_requests_per_s"] == pytest.approx(1 / per_request, rel=1e-12)


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_stages_run_one_batch_in_flight_each(pp):
    """With pp stages and pp running requests, each stage's batch is one request: its TTFT
    and TPOT are the static batch of one passing through every stage (the hops included),
    and the stages complete pp requests in the time one takes."""
    table, keys = serving_rows("llama3_70b", tp=2, prompt=1000, pp=pp)
    static = evaluate_serving_table(table, keys).iloc[0]
    cb = continuous_batching(table, keys, max_running=pp, prefill_budget=1000).iloc[0]
    assert cb["cb_ttft_s"] == pytest.approx(static["serve_ttft_s"], rel=1e-12)
    assert cb["cb_tpot_s"] == pytest.approx(static["serve_tpot_s"], rel=1e-12)
    per_request = static["serve_ttft_s"] + 256 * static["serve_tpot_s"]
    assert cb["cb_requests_per_s"] == pytest.approx(pp / per_request, rel=1e-12)
    assert cb["cb_running"] == pytest.approx(pp, rel=1e-9)


def test_pipeline_stages_share_the_running_slots_and_the_clients():
    """A replica of pp stages is pp batches in flight, each with its share of the running
    limit and of the clients: N clients run N requests (pp batches of N / pp decoding), and
    by Little's law N over the replica's rate is one request's latency; a limit below N
    holds each batch to its share and the rest wait."""
    table, keys = serving_rows("llama3_70b", tp=2, prompt=1000, pp=4)
    free = continuous_batching(table, keys, 64, 2048, clients=np.array([32.0])).iloc[0]
    assert free["cb_running"] == pytest.approx(32.0, rel=1e-9)
    assert free["cb_decode_batch"] == pytest.approx(8.0, rel=0.01)
    latency = free["cb_ttft_s"] + 255 * free["cb_tpot_s"]
    assert 32.0 / free["cb_requests_per_s"] == pytest.approx(latency, rel=0.02)
    capped = continuous_batching(table, keys, 16, 2048, clients=np.array([32.0])).iloc[0]
    assert capped["cb_running"] == pytest.approx(16.0, rel=1e-9)
    assert capped["cb_ttft_s"] > free["cb_ttft_s"] and capped["cb_tpot_s"] < free["cb_tpot_s"]
    # one client keeps one batch in flight: the other stages idle
    one = continuous_batching(table, keys, 64, 2048, clients=np.array([1.0])).iloc[0]
    assert one["cb_running"] == pytest.approx(1.0, rel=1e-9)
    latency = one["cb_ttft_s"] + 255 * one["cb_tpot_s"]
    assert 1.0 / one["cb_requests_per_s"] == pytest.approx(latency, rel=0.02)


def test_an_engine_profile_says_whether_its_running_limit_is_per_stage():
    from stage_dse.config import load_engine
    from stage_dse.config.presets import engine_from_dict

    assert load_engine("trtllm").running_limit_per_stage
    assert not load_engine("vllm").running_limit_per_stage
    with pytest.raises(ConfigError, match=r"engine\.running_limit_per_stage must be true or false"):
        engine_from_dict({"running_limit_per_stage": "sometimes"})


def test_tpot_grows_with_the_running_requests_and_so_does_throughput():
    table, keys = serving_rows()
    runs = [continuous_batching(table, keys, r, 2048).iloc[0] for r in (1, 2, 8, 32, 64)]
    tpot = [r["cb_tpot_s"] for r in runs]
    rate = [r["cb_tokens_per_s_per_gpu"] for r in runs]
    assert all(a < b for a, b in itertools.pairwise(tpot))
    assert all(a < b for a, b in itertools.pairwise(rate))


def test_ttft_grows_with_the_arrival_rate_and_diverges_at_saturation():
    table, keys = serving_rows()
    saturated = continuous_batching(table, keys, 64, 512).iloc[0]
    mu = saturated["cb_requests_per_s"]
    runs = [
        continuous_batching(table, keys, 64, 512, rate).iloc[0]
        for rate in (0.25 * mu, 0.5 * mu, 0.9 * mu, 0.99 * mu)
    ]
    ttft = [r["cb_ttft_s"] for r in runs]
    assert all(a < b for a, b in itertools.pairwise(ttft))
    # below saturation the engine completes what arrives
    for rate, r in zip((0.25, 0.5, 0.9, 0.99), runs):
        assert r["cb_requests_per_s"] == pytest.approx(rate * mu, rel=1e-6)
    over = continuous_batching(table, keys, 64, 512, mu).iloc[0]
    assert np.isinf(over["cb_ttft_s"])
    assert over["cb_requests_per_s"] == pytest.approx(mu)


def test_the_offered_load_fixed_point_tends_to_batch_one_and_to_saturation():
    table, keys = serving_rows()
    static = evaluate_serving_table(table, keys).iloc[0]
    saturated = continuous_batching(table, keys, 64, 4096).iloc[0]
    mu = saturated["cb_requests_per_s"]
    idle = continuous_batching(table, keys, 64, 4096, 1e-6 * mu).iloc[0]
    # almost no load: one request alone, its prompt whole (the budget holds it) and then
    # decoding by itself
    assert idle["cb_tpot_s"] == pytest.approx(static["serve_tpot_s"], rel=1e-3)
    assert idle["cb_ttft_s"] == pytest.approx(static["serve_ttft_s"], rel=1e-3)
    assert idle["cb_running"] < 1e-3
    # nearly saturated: the saturated batch and step (up to the tagged request's own slot)
    busy = continuous_batching(table, keys, 64, 4096, 0.999 * mu).iloc[0]
    assert busy["cb_running"] == pytest.approx(saturated["cb_running"], rel=0.02)
    assert busy["cb_tpot_s"] == pytest.approx(saturated["cb_tpot_s"], rel=0.03)
    # TPOT rises with the load in between
    tpot = [
        continuous_batching(table, keys, 64, 4096, x * mu).iloc[0]["cb_tpot_s"]
        for x in (1e-6, 0.3, 0.6, 0.9)
    ]
    assert all(a < b for a, b in itertools.pairwise(tpot))


def test_short_prompts_share_a_step_and_packing_never_exceeds_the_budget():
    table, keys = serving_rows(prompt=128, out=128)
    for budget in (256, 1024, 8192):
        cb = continuous_batching(table, keys, 1024, budget).iloc[0]
        per_step = cb["cb_chunk_tokens"] + cb["cb_decode_batch"]
        assert per_step <= budget * (1 + 1e-9)
    # 8192 tokens per step: many 128-token prompts ride in each step, so completions per
    # step exceed one prompt per step
    cb = continuous_batching(table, keys, 1024, 8192).iloc[0]
    assert cb["cb_chunk_tokens"] > 4 * 128
    assert cb["cb_requests_per_s"] * cb["cb_step_s"] > 1


@pytest.mark.parametrize("clients", [1, 8, 32])
def test_closed_loop_clients_are_littles_law(clients):
    table, keys = serving_rows(prompt=1024, out=256)
    cb = continuous_batching(table, keys, 64, 4096, clients=clients).iloc[0]
    assert cb["cb_running"] == pytest.approx(clients, rel=1e-9)
    # N clients in the system, each request held TTFT + the decode of its other tokens
    latency = cb["cb_ttft_s"] + 256 * cb["cb_tpot_s"]
    assert clients / cb["cb_requests_per_s"] == pytest.approx(latency, rel=0.05)
    more = continuous_batching(table, keys, 16, 4096, clients=64).iloc[0]
    capped = continuous_batching(table, keys, 16, 4096).iloc[0]
    # beyond the running limit the others queue: the saturated rate, a longer TTFT
    assert more["cb_requests_per_s"] == pytest.approx(capped["cb_requests_per_s"])
    assert more["cb_ttft_s"] > capped["cb_ttft_s"]


def test_one_client_is_one_request_at_a_time():
    table, keys = serving_rows(prompt=2048)
    static = evaluate_serving_table(table, keys).iloc[0]
    one = continuous_batching(table, keys, 64, 2048, clients=1).iloc[0]
    assert one["cb_tpot_s"] == pytest.approx(static["serve_tpot_s"], rel=1e-9)
    assert one["cb_ttft_s"] == pytest.approx(static["serve_ttft_s"], rel=1e-9)


def test_a_burst_drains_at_the_saturated_rate_and_its_ttft_grows_with_its_size():
    table, keys = serving_rows(prompt=512, out=256)
    saturated = continuous_batching(table, keys, 64, 2048).iloc[0]
    bursts = [continuous_batching(table, keys, 64, 2048, burst=n).iloc[0] for n in (1, 64, 4096)]
    ttft = [b["cb_ttft_s"] for b in bursts]
    assert all(a < b for a, b in itertools.pairwise(ttft))
    # a long burst runs mostly saturated
    assert bursts[-1]["cb_requests_per_s"] == pytest.approx(
        saturated["cb_requests_per_s"], rel=0.05
    )
    # one request alone: its prefill, then its decode
    assert bursts[0]["cb_makespan_s"] == pytest.approx(
        bursts[0]["cb_ttft_s"] + 256 * bursts[0]["cb_tpot_s"], rel=0.02
    )


def test_engine_costs_lengthen_every_step():
    table, keys = serving_rows()
    plain = continuous_batching(table, keys, 32, 2048).iloc[0]
    slow = table.assign(step_overhead_s=1e-3, request_overhead_s=1e-5)
    cb = continuous_batching(slow, keys, 32, 2048).iloc[0]
    assert cb["cb_decode_step_s"] == pytest.approx(
        plain["cb_decode_step_s"] + 1e-3 + 1e-5 * plain["cb_running"], rel=1e-9
    )
    assert cb["cb_requests_per_s"] < plain["cb_requests_per_s"]


def test_the_kv_cache_caps_the_running_requests():
    table, keys = serving_rows()
    big = continuous_batching(table, keys, 100_000, 2048).iloc[0]
    assert big["cb_running"] == big["cb_kv_capacity_seqs"] > 50
    small_table, small_keys = serving_rows(hbm_gib=40)
    small = continuous_batching(small_table, small_keys, 100_000, 2048).iloc[0]
    assert 0 < small["cb_running"] == small["cb_kv_capacity_seqs"] < big["cb_running"]
    # capacity x bytes per sequence fits in what weights and the working set leave
    per_seq = evaluate_serving_table(table, keys).iloc[0]["serve_kv_cache_bytes"]
    assert big["cb_running"] * per_seq <= table["usable_memory"].iloc[0]


@pytest.mark.parametrize("ratio", [0.0, 0.7, 1.0])
def test_a_running_request_holds_its_prompt_half_its_output_and_the_engines_reserve(ratio):
    # vLLM allocates blocks as tokens arrive (0), SGLang admits at its new-token ratio (0.7),
    # TensorRT-LLM reserves the whole request (1, also what a table without the column gets)
    table, keys = serving_rows(prompt=512, out=2048)
    got = continuous_batching(table.assign(kv_reserve_ratio=ratio), keys, 100_000, 8192).iloc[0]
    held = table.assign(output_tokens=2048 * (1 + ratio) / 2)
    costs = evaluate_serving_table(held, keys).iloc[0]
    free = table["usable_memory"].iloc[0] - costs["serve_weights_bytes"] - got["cb_working_bytes"]
    assert got["cb_kv_capacity_seqs"] == np.floor(free / costs["serve_kv_cache_bytes"])
    whole = continuous_batching(table, keys, 100_000, 8192).iloc[0]
    assert load_engine("vllm").kv_reserve_ratio == 0.0
    with pytest.raises(ConfigError, match=r"engine\.kv_reserve_ratio must be a fraction"):
        load_engine("vllm", kv_reserve_ratio=1.5)
    if ratio == 1.0:
        assert got["cb_kv_capacity_seqs"] == whole["cb_kv_capacity_seqs"]
    else:  # more requests fit, up to (512 + 2048) / (512 + 1024) times as many
        assert whole["cb_kv_capacity_seqs"] < got["cb_kv_capacity_seqs"]
        assert got["cb_kv_capacity_seqs"] <= whole["cb_kv_capacity_seqs"] * 2560 / 1536 + 1


def test_fp8_prefill_attention_speeds_up_prefill_attention_only():
    table, keys = serving_rows(model="llama3_70b", tp=8, prompt=16_384, out=256)
    slow = evaluate_serving_table(table, keys).iloc[0]
    fast = evaluate_serving_table(table.assign(context_attention_speed=2.0), keys).iloc[0]
    attention = slow["serve_prefill_attention_s"]
    assert fast["serve_prefill_attention_s"] == pytest.approx(attention / 2)
    assert fast["serve_ttft_s"] == pytest.approx(slow["serve_ttft_s"] - attention / 2)
    assert fast["serve_tpot_s"] == slow["serve_tpot_s"]
    # TensorRT-LLM on FP8 layers or an FP8 cache, at the GPU's measured FP8 attention speedup
    trt, vllm = load_engine("trtllm"), load_engine("vllm")
    fp8, bf16 = DType.FP8, DType.BF16
    h100 = load_hardware("h100_sxm").fp8_attention_speedup
    assert h100 > 1.0 == load_hardware("a100_80gb").fp8_attention_speedup
    assert trt.context_attention_speed(fp8, bf16, h100) == h100
    assert trt.context_attention_speed(bf16, fp8, h100) == h100
    assert trt.context_attention_speed(DType.NVFP4, bf16, h100) == h100
    assert trt.context_attention_speed(bf16, bf16, h100) == 1.0
    assert vllm.context_attention_speed(fp8, fp8, h100) == 1.0
    with pytest.raises(ConfigError, match=r"hardware\.fp8_attention_speedup must be"):
        load_hardware("h100_sxm", fp8_attention_speedup=0.5)


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_kv_bound_rows_reported_cache_is_what_its_running_requests_hold(ratio):
    from stage_dse.runner.serving import _continuous

    table, keys = serving_rows(model="qwen3_32b", prompt=512, out=2048)
    hbm = load_hardware("h100_sxm").hbm_bytes
    loads = dict.fromkeys(("arrival_rate", "draft_tokens", "acceptance", "clients", "burst"), 0.0)
    t = table.assign(
        micro_batch=100_000.0,
        prefill_budget=8192.0,
        kv_reserve_ratio=ratio,
        **loads,
        **load_engine("vllm").kv_pool_columns(hbm, 1),
    )
    out = _continuous(t, keys, evaluate_serving_table(t, keys)).iloc[0]
    # bound by the pool (0.9 of the GPU for weights, activations and cache), not by requests
    assert out["serve_kv_capacity_seqs"] < 100_000
    assert out["serve_mem_total_bytes"] <= 0.9 * hbm * (1 + 1e-9)
    assert out["serve_mem_headroom_bytes"] >= 0


GIB = 2.0**30


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_each_engine_sizes_its_kv_pool_by_its_own_rule(engine):
    from stage_dse.config import load_engine
    from stage_dse.cost.batching import kv_pool_bytes

    table, keys = serving_rows(model="qwen3_32b")
    hbm = load_hardware("h100_sxm").hbm_bytes
    spec = load_engine(engine)
    base = continuous_batching(table, keys, 100_000, 8192).iloc[0]
    ruled = table.assign(**spec.kv_pool_columns(hbm, 1))
    got = continuous_batching(ruled, keys, 100_000, 8192).iloc[0]
    weights = evaluate_serving_table(table, keys).iloc[0]["serve_weights_bytes"]
    working = got["cb_working_bytes"]
    free = table["usable_memory"].iloc[0] - weights - working
    pool = {
        # gpu_memory_utilization 0.9 of the GPU holds weights, activations and cache
        "vllm": 0.9 * hbm - weights - working,
        # SGLang leaves 9.5 GiB + 0.5 GiB per rank outside weights and cache on an 80 GB GPU
        "sglang": hbm - 10.0 * GIB - weights,
        # TensorRT-LLM: 0.9 of what is free after weights and activation buffers
        "trtllm": 0.9 * free,
    }[engine]
    assert kv_pool_bytes(ruled, [weights], [working])[0] == pytest.approx(min(pool, free))
    assert got["cb_kv_capacity_seqs"] < base["cb_kv_capacity_seqs"]
    # a 32B model in bf16 on one 80 GB GPU: the engine's pool, not 80 GB less weights
    per_seq = evaluate_serving_table(table, keys).iloc[0]["serve_kv_cache_bytes"]
    assert got["cb_kv_capacity_seqs"] == np.floor(min(pool, free) / per_seq)


def test_a_stated_memory_fraction_comes_from_the_record_or_its_command():
    from stage_dse.config import load_engine
    from stage_dse.validation.resolve import stated_kv_memory_fraction

    vllm, sglang = load_engine("vllm"), load_engine("sglang")
    command = {"details": {"command": "vllm serve m -tp 8 --gpu-memory-utilization 0.85"}}
    assert stated_kv_memory_fraction(command, vllm) == 0.85
    assert stated_kv_memory_fraction(command, sglang) is None  # not SGLang's flag
    assert stated_kv_memory_fraction({"kv_memory_fraction": 0.7, **command}, vllm) == 0.7
    assert stated_kv_memory_fraction({"details": {"command": "vllm serve m"}}, vllm) is None
    hbm = load_hardware("h100_sxm").hbm_bytes
    stated = sglang.kv_pool_columns(hbm, 8, fraction=0.8)["engine_static_bytes"]
    assert stated == pytest.approx(0.8 * hbm)
    # the default reserve grows with the ranks and with DP attention
    assert sglang.kv_pool_columns(hbm, 8)["engine_static_bytes"] == pytest.approx(hbm - 13.5 * GIB)
    assert sglang.kv_pool_columns(hbm, 8, attention_dp=True)[
        "engine_static_bytes"
    ] == pytest.approx(hbm - 17.5 * GIB)
    with pytest.raises(ConfigError, match="kv_memory_fraction"):
        vllm.kv_pool_columns(hbm, 1, fraction=1.5)


def test_a_larger_prefill_budget_shortens_ttft_when_prefill_bound():
    table, keys = serving_rows()
    ttft = [continuous_batching(table, keys, 256, c).iloc[0]["cb_ttft_s"] for c in (256, 512, 2048)]
    assert ttft[0] > ttft[1] > ttft[2]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_running": 0}, "serving.max_running"),
        ({"prefill_budget": 0.5}, "serving.prefill_budget"),
        ({"arrival_rate": -1}, "serving.arrival_rate"),
        ({"clients": 1.5}, "serving.clients"),
        ({"burst": -3}, "serving.burst"),
        ({"clients": 4, "arrival_rate": 1.0}, "one load per row"),
    ],
)
def test_bad_batching_inputs_name_the_field(kwargs, field):
    table, keys = serving_rows()
    args = {"max_running": 8, "prefill_budget": 512, **kwargs}
    with pytest.raises(ConfigError, match=field):
        continuous_batching(table, keys, **args)


def static_at(model="llama3_8b", hardware="h100_sxm", tp=1, batch=1, prompt=2048, out=256):
    serving = ServingSpec(prompt_len=prompt, output_tokens=out, batch_size=batch)
    m, h = load_model(model), load_hardware(hardware)
    row, key = serving_row(m, serving, h, load_cluster("dgx_h100"), tp)
    return evaluate_serving_table(pd.DataFrame([row]), [key])


def test_kv_transfer_bytes_are_the_cache_layouts_bytes():
    from stage_dse.cost.disagg import kv_transfer_bytes

    prefill = static_at("llama3_8b", prompt=3000)
    # Llama-3-8B: 32 layers x 2 (keys, values) x 8 kv heads x 128 dims x 2 bytes per token
    assert kv_transfer_bytes(prefill, 3000)[0] == 3000 * 32 * 2 * 8 * 128 * 2


def test_disaggregated_on_a_free_network_is_two_independent_pools():
    from stage_dse.cost.disagg import best_ratio, disaggregated

    prefill, decode = static_at(tp=1, batch=1), static_at(tp=2, batch=64)
    per = disaggregated(
        prefill, decode, prompt=2048, output_tokens=256, prefill_batch=1, decode_batch=64,
        prefill_gpus=1, decode_gpus=2, link_bytes_per_s=np.inf,
    )  # fmt: skip
    row = per.iloc[0]
    assert row["dis_ttft_s"] == prefill["serve_ttft_s"].iloc[0]
    assert row["dis_tpot_s"] == decode["serve_tpot_s"].iloc[0]
    mu_p = 1 / prefill["serve_ttft_s"].iloc[0]
    mu_d = 64 / (256 * decode["serve_tpot_s"].iloc[0])
    best = best_ratio(per, 256).iloc[0]
    x, y = best["dis_prefill_replicas"], best["dis_decode_replicas"]
    assert best["dis_requests_per_s"] == pytest.approx(min(x * mu_p, y * mu_d))
    assert best["dis_gpus"] == x * 1 + y * 2
    # no other pair of up to 8 replicas each gives more tokens/s per GPU
    for a in range(1, 9):
        for b in range(1, 9):
            assert (
                min(a * mu_p, b * mu_d) * 256 / (a + 2 * b)
                <= best["dis_tokens_per_s_per_gpu"] + 1e-9
            )
    # a real network adds the transfer of the prompt's cache to TTFT
    slow = disaggregated(
        prefill, decode, prompt=2048, output_tokens=256, prefill_batch=1, decode_batch=64,
        prefill_gpus=1, decode_gpus=2, link_bytes_per_s=50e9, link_latency_s=1e-5,
    ).iloc[0]  # fmt: skip
    assert slow["dis_ttft_s"] - row["dis_ttft_s"] == pytest.approx(2048 * 131072 / 50e9 + 1e-5)


def test_speculative_decoding_pays_for_itself_only_when_drafts_are_accepted():
    table, keys = serving_rows()
    plain = continuous_batching(table, keys, 32, 2048).iloc[0]
    none = continuous_batching(table, keys, 32, 2048, draft_tokens=0, acceptance=0.9).iloc[0]
    assert none["cb_tpot_s"] == plain["cb_tpot_s"]  # no drafts: acceptance is moot
    rejected = continuous_batching(table, keys, 32, 2048, draft_tokens=1, acceptance=0.0).iloc[0]
    accepted = continuous_batching(table, keys, 32, 2048, draft_tokens=1, acceptance=0.8).iloc[0]
    assert rejected["cb_tpot_s"] > plain["cb_tpot_s"]  # verification and drafting, no gain
    # 1.8 tokens per step for a step that costs far less than twice as much (memory bound)
    assert accepted["cb_tpot_s"] < 0.8 * plain["cb_tpot_s"]
    assert accepted["cb_tokens_per_s_per_gpu"] > plain["cb_tokens_per_s_per_gpu"]
    with pytest.raises(ConfigError, match=r"serving\.acceptance must be in \[0, 1\)"):
        continuous_batching(table, keys, 32, 2048, draft_tokens=1, acceptance=1.0)


def test_a_request_mix_of_one_class_is_that_class_and_longer_prompts_wait_longer():
    table, keys = serving_rows()
    alone = continuous_batching(table, keys, 32, 1024).iloc[0]
    one = continuous_batching(table, keys, 32, 1024, mix=[(2048, 256, 3.0)]).iloc[0]
    twice = continuous_batching(table, keys, 32, 1024, mix=[(2048, 256, 1), (2048, 256, 1)])
    for col in ("cb_ttft_s", "cb_tpot_s", "cb_requests_per_s", "cb_kv_capacity_seqs"):
        assert one[col] == pytest.approx(alone[col], rel=1e-12)
        assert twice.iloc[0][col] == pytest.approx(alone[col], rel=1e-12)
    mixed = continuous_batching(table, keys, 32, 1024, mix=[(2048, 256, 0.5), (8192, 256, 0.5)])
    row = mixed.iloc[0]
    # the long prompts take 8 chunks, the short 2: the mean waits 5 chunk steps, the longest 8
    assert row["cb_ttft_longest_s"] / row["cb_ttft_s"] == pytest.approx(8 / 5)
    assert row["cb_ttft_s"] > alone["cb_ttft_s"]
    assert row["cb_requests_per_s"] < alone["cb_requests_per_s"]
    with pytest.raises(ConfigError, match=r"serving\.request_mix"):
        continuous_batching(table, keys, 32, 1024, mix=[(2048, 256)])


@settings(max_examples=60, deadline=None)
@given(
    mean=st.floats(2.0, 4000.0),
    cap_over_mean=st.one_of(st.just(np.inf), st.floats(2.05, 50.0)),
    requests=st.floats(2.0, 1e5),
)
def test_output_length_classes_keep_the_mean_stay_ordered_and_under_the_cap(
    mean, cap_over_mean, requests
):
    cap = mean * cap_over_mean
    classes = output_length_classes(np.array([mean]), np.array([cap]), np.array([requests]))
    lengths = np.array([float(o[0]) for o, _ in classes])
    weights = np.array([float(np.asarray(w).ravel()[0]) for _, w in classes])
    assert weights.sum() == pytest.approx(1.0, rel=1e-12)
    assert float(np.sum(lengths * weights)) == pytest.approx(mean, rel=1e-4)
    assert np.all(np.diff(lengths) > 0)
    assert lengths[-1] <= cap * (1 + 1e-9)
    # the last class is the longest of the burst's requests: it holds one of them
    assert weights[-1] == pytest.approx(1.0 / requests, rel=1e-9)


def test_spread_output_lengths_stretch_a_bursts_drain_but_not_the_steady_state():
    table, keys = serving_rows(prompt=200, out=200)
    fixed = continuous_batching(table, keys, 1024, 8192, burst=1000).iloc[0]
    same = continuous_batching(table, keys, 1024, 8192, burst=1000, output_lengths=["fixed"]).iloc[
        0
    ]
    assert same["cb_makespan_s"] == fixed["cb_makespan_s"]
    spread = continuous_batching(
        table, keys, 1024, 8192, burst=1000, output_lengths="exponential", max_total_tokens=2048
    ).iloc[0]
    # the same tokens, but the longest requests decode on with a shrinking batch
    assert spread["cb_makespan_s"] > 1.2 * fixed["cb_makespan_s"]
    assert spread["cb_tokens_per_s"] < fixed["cb_tokens_per_s"] / 1.2
    # short requests finish during the heavy steps, long ones decode on in the light tail
    # (over longer contexts): the mean per-request TPOT stays between the batch-1 step and
    # not far above the fixed-length run's
    one = continuous_batching(table, keys, 1, 200).iloc[0]
    assert one["cb_tpot_s"] < spread["cb_tpot_s"] < fixed["cb_tpot_s"] * 1.3
    # saturated throughput depends on the mean lengths only (Little's law)
    sat_fixed = continuous_batching(table, keys, 64, 8192).iloc[0]
    sat_spread = continuous_batching(table, keys, 64, 8192, output_lengths="exponential").iloc[0]
    assert sat_spread["cb_requests_per_s"] == pytest.approx(
        sat_fixed["cb_requests_per_s"], rel=0.15
    )
    with pytest.raises(ConfigError, match=r"serving\.output_lengths"):
        continuous_batching(table, keys, 64, 8192, output_lengths="zipf")
    with pytest.raises(ConfigError, match=r"serving\.max_total_tokens"):
        continuous_batching(
            table, keys, 64, 8192, output_lengths="exponential", max_total_tokens=300
        )


def test_sglang_splits_its_prefill_budget_over_dp_attention_ranks():
    """SGLang with DP attention gives each attention rank chunked_prefill_size // dp_size
    (server_args.py); TensorRT-LLM's and vLLM's ranks keep the whole budget, and without DP
    attention there is one rank."""
    from types import SimpleNamespace

    from stage_dse.validation.serving import _prefill_split

    def split(engine, **f):
        fields = {"engine": engine, "tp": 8, **f}
        return _prefill_split(fields, SimpleNamespace(fields=fields))

    assert split("sglang", attention_dp=True) == 8
    assert split("sglang", tp=1, ep=8, attention_dp=True) == 8
    assert split("sglang") == 1
    assert split("trtllm", attention_dp=True) == 1
    assert split("vllm", attention_dp=True) == 1


def test_only_sglang_splits_its_running_limit_over_dp_attention_ranks():
    """SGLang runs max_running_requests // dp_size per attention rank (model_runner.py);
    TensorRT-LLM's max_batch_size is each rank's ("in each rank") and so is vLLM's
    max_num_seqs (one engine core per data-parallel rank)."""
    from types import SimpleNamespace

    from stage_dse.validation.serving import _running_split

    def split(engine, **f):
        fields = {"engine": engine, "tp": 1, "ep": 8, "attention_dp": True, **f}
        return _running_split(fields, SimpleNamespace(fields=fields))

    assert split("sglang") == 8
    assert split("trtllm") == 1
    assert split("vllm") == 1
    assert split("sglang", ep=1, attention_dp=False) == 1


def expert_parallel_rows(ranks=8, sync=0.0, prompt=1000, out=1000):
    serving = ServingSpec(prompt_len=prompt, output_tokens=out, batch_size=1)
    model, hw = load_model("qwen3_30b_a3b"), load_hardware("h200")
    row, key = serving_row(model, serving, hw, load_cluster("dgx_h100"), 1, 1, ranks)
    row["dp_context_sync"] = sync
    return pd.DataFrame([row]), [key]


def test_unsynchronized_attention_ranks_wait_for_the_slowest_one():
    """Expert-parallel attention ranks step in lock step: with prompts admitted per rank, any
    rank's prompt stretches every rank's step (TensorRT-LLM's "ADP Balance Strategy"), so the
    steady state is slower than with prompts run together; one rank, or a prompt in every
    step, is the same either way."""
    async_t, async_k = expert_parallel_rows(sync=0.0)
    sync_t, sync_k = expert_parallel_rows(sync=1.0)
    a = continuous_batching(async_t, async_k, 64, 8192).iloc[0]
    s = continuous_batching(sync_t, sync_k, 64, 8192).iloc[0]
    assert a["cb_step_s"] > s["cb_step_s"]
    assert a["cb_tpot_s"] > s["cb_tpot_s"]
    assert a["cb_requests_per_s"] < s["cb_requests_per_s"]
    # the slowest rank costs at most its own part of a prompt step in every step
    assert a["cb_step_s"] <= s["cb_mixed_step_s"] * (1 + 1e-9)
    one_t, one_k = expert_parallel_rows(ranks=1, sync=0.0)
    one_s, one_sk = expert_parallel_rows(ranks=1, sync=1.0)
    assert continuous_batching(one_t, one_k, 64, 8192).iloc[0]["cb_step_s"] == pytest.approx(
        continuous_batching(one_s, one_sk, 64, 8192).iloc[0]["cb_step_s"], rel=1e-12
    )
    # long prompts, short outputs: every step carries prompt tokens on every rank
    full_t, full_k = expert_parallel_rows(sync=0.0, prompt=8000, out=8)
    full_s, full_sk = expert_parallel_rows(sync=1.0, prompt=8000, out=8)
    assert continuous_batching(full_t, full_k, 64, 2048).iloc[0]["cb_step_s"] == pytest.approx(
        continuous_batching(full_s, full_sk, 64, 2048).iloc[0]["cb_step_s"], rel=1e-9
    )


def test_the_routed_experts_are_their_own_part_of_each_pass():
    table, keys = expert_parallel_rows()
    out = evaluate_serving_table(table, keys).iloc[0]
    for mode in ("prefill", "decode"):
        assert out[f"serve_{mode}_expert_s"] > 0
    assert out["serve_prefill_expert_s"] < out["serve_ttft_s"]
    assert out["serve_decode_expert_s"] < out["serve_tpot_s"]
    dense, dense_keys = serving_rows()
    assert evaluate_serving_table(dense, dense_keys).iloc[0]["serve_decode_expert_s"] == 0


@settings(max_examples=50, deadline=None)
@given(k=st.integers(1, 6), alpha=st.floats(0.0, 0.98))
def test_draft_acceptance_inverts_the_tokens_a_step_keeps(k, alpha):
    from stage_dse.cost.batching import draft_acceptance

    length = sum(alpha**j for j in range(k + 1))
    assert draft_acceptance(length, k) == pytest.approx(alpha, abs=1e-6)


def test_an_accepted_length_beyond_the_drafts_names_the_bound():
    from stage_dse.cost.batching import draft_acceptance

    with pytest.raises(ConfigError, match=r"draft_tokens \+ 1 = 4"):
        draft_acceptance(4.5, 3)
