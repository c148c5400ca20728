"""Bad input raises ConfigError whose message names the field, the values and the relation."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import gpt

from stage_dse.config import load_model
from stage_dse.errors import ConfigError, StageDseError
from stage_dse.spec import ModelSpec, ParallelPlan, TrainingSpec, validate_plan

LLAMA70 = load_model("llama3_70b")
T8K = TrainingSpec(seq_len=8192, global_batch_size=1000)


def check(plan_kwargs, message, model=LLAMA70, training=T8K, num_gpus=None):
    with pytest.raises(ConfigError) as info:
        validate_plan(model, training, ParallelPlan(**plan_kwargs), num_gpus)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("plan_kwargs", "num_gpus", "message"),
    [
        ({"tp": 3}, None, "tp(3) does not divide heads(64)"),
        ({"tp": 16}, None, "tp(16) does not divide kv_heads(8)"),
        ({"dp": 2, "tp": 4, "pp": 3}, 32, "dp(2)*tp(4)*pp(3)*cp(1)=24 != num_gpus(32)"),
        ({"pp": 96}, None, "pp(96) > layers(80)"),
        (
            {"dp": 64, "micro_batch_size": 4},
            None,
            "global_batch(1000) not divisible by dp(64)*micro_batch(4)=256",
        ),
        ({"cp": 3}, None, "cp(3) does not divide seq(8192)"),
        ({"ep": 4}, None, "ep(4) > 1 needs a mixture-of-experts model"),
        (
            {"pp": 40, "schedule": "interleaved", "virtual_stages": 4},
            None,
            "pp(40)*virtual_stages(4)=160 > layers(80)",
        ),
        (
            {"dp": 8, "pp": 8, "schedule": "interleaved", "virtual_stages": 2},
            None,
            "num_microbatches(125) not divisible by pp(8)",
        ),
    ],
)
def test_plan_against_model(plan_kwargs, num_gpus, message):
    check(plan_kwargs, message, num_gpus=num_gpus)


def test_vocab_divisibility():
    check(
        {"tp": 3},
        "tp(3) does not divide vocab(50000)",
        model=gpt(heads=12, hidden=768, vocab=50000),
    )


def test_sequence_parallel_needs_divisible_sequence():
    training = TrainingSpec(seq_len=1004, global_batch_size=8)
    check(
        {"tp": 8, "sequence_parallel": True},
        "tp(8)*cp(1)=8 does not divide seq(1004)",
        training=training,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "plan.tp must be > 0, got 0"),
        ({"dp": -2}, "plan.dp must be > 0, got -2"),
        ({"zero_stage": 4}, "plan.zero_stage must be 0, 1, 2 or 3, got 4"),
        ({"recompute": "some"}, "plan.recompute='some' is not one of: none, selective, full"),
        ({"sequence_parallel": True}, "plan.sequence_parallel=true needs tp > 1"),
        (
            {"schedule": "interleaved", "pp": 1, "virtual_stages": 2},
            "plan.schedule=interleaved needs pp > 1",
        ),
        ({"pp": 2, "virtual_stages": 2}, "plan.virtual_stages(2) > 1 needs schedule=interleaved"),
        (
            {"rank_order": "tp-dp-pp"},
            "plan.rank_order=tp-dp-pp must name each of tp, cp, ep, dp, pp",
        ),
        ({"micro_batch_size": 1.5}, "plan.micro_batch_size must be an integer, got 1.5"),
    ],
)
def test_plan_fields(kwargs, message):
    with pytest.raises(ConfigError) as info:
        ParallelPlan(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "model.num_layers must be > 0, got 0"),
        (
            {"num_heads": 12, "hidden_size": 1200, "num_kv_heads": 5},
            "model.num_kv_heads(5) does not divide model.num_heads(12)",
        ),
        ({"num_heads": 7}, "model.num_heads(7) does not divide model.hidden_size(1024)"),
        ({"norm": "batchnorm"}, "model.norm='batchnorm' is not one of: layernorm, rmsnorm"),
    ],
)
def test_model_fields(kwargs, message):
    base = {
        "name": "m",
        "num_layers": 2,
        "hidden_size": 1024,
        "ffn_hidden_size": 4096,
        "num_heads": 16,
        "vocab_size": 1000,
    }
    with pytest.raises(ConfigError) as info:
        ModelSpec(**{**base, **kwargs})
    assert message in str(info.value)


def test_training_fields():
    with pytest.raises(ConfigError, match=r"training.seq_len must be > 0, got -1"):
        TrainingSpec(seq_len=-1, global_batch_size=8)
    with pytest.raises(ConfigError, match=r"training.params_dtype='int3' is not one of"):
        TrainingSpec(seq_len=8, global_batch_size=8, params_dtype="int3")


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        load_model("llama5_1t")
    assert "unknown model preset 'llama5_1t'; valid: " in str(info.value)
    assert "llama3_70b" in str(info.value)


def test_errors_share_one_root():
    assert issubclass(ConfigError, StageDseError)
    assert issubclass(ConfigError, ValueError)


def test_attention_dp_records_split_experts_over_their_tensor_parallel_ranks():
    from stage_dse.validation.serving import _layout

    assert _layout({"tp": 8, "attention_dp": True}) == (1, 1, 8)
    assert _layout({"tp": 4, "ep": 4, "attention_dp": True}) == (4, 1, 4)  # ep stated: as given
    assert _layout({"tp": 8}) == (8, 1, 1)


def test_a_record_s_own_reading_of_a_tool_default_yields_to_the_tool_s_rule():
    """Limits a source states stand; limits a record derived from the tool's default
    (listed unstated) give way to the heuristic run for the KV cache format of the row
    (the record's derivation assumed one format); without a heuristic the record's value,
    then the engine's default, applies."""
    from stage_dse.config import load_engine
    from stage_dse.validation.serving import _limits

    engine = load_engine("trtllm")
    f = {"max_batch": 128, "max_num_tokens": 2048}
    tuned = (384.0, 4096.0)
    assert _limits(f, engine, tuned) == (128.0, 2048.0)
    assert _limits(f, engine, tuned, ("max_batch",)) == (384.0, 2048.0)
    assert _limits(f, engine, tuned, ("max_batch", "max_num_tokens")) == (384.0, 4096.0)
    assert _limits(f, engine, (np.nan, np.nan), ("max_batch",)) == (128.0, 2048.0)
    assert _limits({}, engine) == (float(engine.max_running), float(engine.prefill_budget))


def test_trtllm_bench_limits_follow_the_kv_cache_the_engine_leaves():
    from stage_dse.config import load_hardware, load_model
    from stage_dse.validation.serving import total_params, trtllm_bench_limits

    bench = {"details": {"benchmark_client": "trtllm-bench throughput (offline)"}}
    model = load_model("llama3_70b")
    assert total_params(model) == pytest.approx(70.6e9, rel=0.01)
    h100, h200 = load_hardware("h100_sxm"), load_hardware("h200")
    got = []
    for hw in (h100, h200):
        f = {**bench, "tp": 2, "isl": 1000, "osl": 1000}
        batch, tokens = trtllm_bench_limits(model, f, hw, "fp8", "fp8")
        assert batch >= 64 and batch % 32 == 0
        assert 2048 <= tokens <= 32768 and tokens % 256 == 0
        got.append(batch)
    assert got[1] > got[0]  # more memory, more requests in the cache
    # long prompts: the token budget grows with 1 + isl / osl (rounded to 1,024 above 8,192)
    long = trtllm_bench_limits(
        model, {**bench, "tp": 8, "isl": 20000, "osl": 200}, h200, "fp8", "fp8"
    )
    assert 8192 <= long[1] <= 32768 and long[1] % 1024 == 0 and long[1] > tokens
    # other clients: not this heuristic
    other = {"details": {"benchmark_client": "vllm bench serve"}, "tp": 2, "isl": 1, "osl": 1}
    assert np.isnan(trtllm_bench_limits(model, other, h100, "fp8", "fp8")[0])
    # latent attention, read from config.json as tuning.py reads it: 128 key-value heads of
    # 7168 // 128 = 56 dims over 61 layers, FP8 cache, half a byte per NVFP4 parameter
    dsv3, b200 = load_model("deepseek_v3"), load_hardware("b200")
    f = {**bench, "tp": 8, "isl": 128, "osl": 2048}
    batch, tokens = trtllm_bench_limits(dsv3, f, b200, "fp8", "fp4")
    gib = 2.0**30
    free_gib = 8 * b200.hbm_bytes / gib - total_params(dsv3) * 0.5 / gib
    requests = 0.95 * free_gib / (2 * 61 * 128 * 56 / gib * (128 + 2048))
    assert 256 <= requests < 1024  # so rounded up to a multiple of 128
    assert batch == 128 * np.ceil(requests / 128)
    assert tokens == 2048  # batch x (1 + 128 / 2048) is below 4,096: at least 2,048


def test_trtllm_bench_takes_build_defaults_for_a_quantization_it_does_not_tune():
    """gpt-oss's MXFP4 experts are not among the formats trtllm-bench's heuristic sizes for;
    it then runs with BuildConfig's 2,048 requests and 8,192 tokens, on any GPU and whatever
    the table's label, while a bf16 checkpoint of the same model is tuned."""
    from stage_dse.config import load_hardware, load_model
    from stage_dse.validation.serving import UNTUNED_LIMITS, trtllm_bench_limits

    bench = {"details": {"benchmark_client": "trtllm-bench throughput (offline)"}}
    oss = load_model("gpt_oss_120b")
    for hw, label in (("h200", "fp8"), ("b200", "fp4"), ("h100_sxm", "fp8")):
        f = {**bench, "tp": 1, "isl": 1024, "osl": 1024}
        assert trtllm_bench_limits(oss, f, load_hardware(hw), "bf16", label) == UNTUNED_LIMITS
    assert UNTUNED_LIMITS == (2048.0, 8192.0)
    f = {**bench, "tp": 2, "isl": 1024, "osl": 1024}
    tuned = trtllm_bench_limits(oss, f, load_hardware("h200"), "bf16", "bf16")
    assert tuned != UNTUNED_LIMITS and tuned[0] % 32 == 0


def test_a_stated_capacity_scheduler_sets_the_kv_room_per_request(tmp_path):
    """TensorRT-LLM's MAX_UTILIZATION policy (NVIDIA's MLPerf harness default) allocates KV
    blocks as tokens arrive: room 0 per request where GUARANTEED_NO_EVICT, the engine's
    default, reserves the whole request; more requests then run at once. An unknown policy
    is a corpus error naming the field when the corpus is read."""
    import dataclasses

    import yaml

    from stage_dse.validation.corpus import CorpusError, corpus_root, load_corpus
    from stage_dse.validation.serving import evaluate_serving, prepare

    case = next(c for c in load_corpus("serving") if c.id.startswith("mlperf_inf_v51_llama2_70b_b"))
    assert case.fields["capacity_scheduler"] == "max_utilization"
    fields = {k: v for k, v in case.fields.items() if k != "capacity_scheduler"}
    no_evict = dataclasses.replace(case, fields=fields)
    assert prepare([case]).table["kv_reserve_ratio"].tolist() == [0.0]
    assert prepare([no_evict]).table["kv_reserve_ratio"].tolist() == [1.0]
    greedy, reserved = evaluate_serving([case]), evaluate_serving([no_evict])
    assert greedy["predicted"].iloc[0] >= reserved["predicted"].iloc[0]
    doc = yaml.safe_load(
        (corpus_root() / "serving" / "mlperf_inference_llama2_70b.yaml").read_text()
    )
    run = next(r for r in doc["runs"] if r["id"] == case.id)
    doc["source"]["id"], run["id"] = "mine", "mine_1"
    doc["runs"] = [{**run, "capacity_scheduler": "fifo"}]
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(CorpusError, match="capacity_scheduler='fifo'"):
        load_corpus("serving", tmp_path)
