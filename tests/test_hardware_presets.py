"""The GPU and cluster presets added for Blackwell, Blackwell Ultra, Grace Hopper and PCIe
servers: each loads, and evaluates a small training and serving table."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.config.presets import read_preset
from stage_dse.cost.table import evaluate_plans, plans_table
from stage_dse.errors import ConfigError
from stage_dse.kernels.tables import data_root, table_set
from stage_dse.results import ResultStore, load
from stage_dse.runner.serving import ServingSweepSpec, run_serving
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.spec.hardware import even_domain_share

PAIRS = {  # hardware preset -> its cluster preset
    "gb200": "gb200_nvl72",
    "gb300": "gb300_nvl72",
    "gh200": "gh200_nvl32",
    "l40s": "l40s_server",
    "rtx_pro_6000": "rtx_pro_6000_server",
}
FP4 = {"gb200": 10000, "gb300": 15000, "rtx_pro_6000": 2015.2, "gh200": 0, "l40s": 0}
"""Dense FP4 peaks, TFLOP/s (0: no FP4 tensor cores)."""
NEW_CLUSTERS = ("gb300_nvl72", "gh200_nvl32", "l40s_server", "rtx_pro_6000_server", "dgx_h800")


def one_domain(name: str):
    """A cluster preset sized to one scale-up domain (gb200_nvl72's own 1,024 GPUs are not a
    whole number of racks)."""
    return load_cluster(name, num_gpus=read_preset("cluster", name)["gpus_per_node"])


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_hardware_preset_loads_with_dense_peaks(name):
    hw = load_hardware(name)
    assert hw.name == name
    assert 0 < hw.peak_flops < hw.peak_fp8_flops == pytest.approx(2 * hw.peak_flops, rel=0.02)
    assert hw.peak_fp4_flops == pytest.approx(FP4[name] * 1e12)
    for f in ("gemm_efficiency", "fp8_gemm_efficiency", "fp4_gemm_efficiency"):
        assert 0 < getattr(hw, f) <= 1
    assert hw.usable_bytes > 40 * 2**30


@pytest.mark.parametrize("name", NEW_CLUSTERS)
def test_cluster_preset_loads_on_its_own(name):
    cluster = load_cluster(name)
    assert cluster.num_gpus % cluster.gpus_per_node == 0
    assert cluster.inter_bandwidth_bytes_per_s > 0


def test_the_h800_cluster_is_the_h100s_with_a_narrower_nvlink():
    h100, h800 = load_cluster("dgx_h100"), load_cluster("dgx_h800")
    # 400 GB/s per GPU both directions against 900 (DeepSeek-V3 report sec. 3.2.2 measures 160)
    assert h800.intra_bandwidth_bytes_per_s == 200e9
    assert h800.inter_bandwidth_bytes_per_s == h100.inter_bandwidth_bytes_per_s == 50e9
    same = dataclasses.replace(h800, intra_bandwidth_bytes_per_s=h100.intra_bandwidth_bytes_per_s)
    assert dataclasses.replace(same, num_gpus=h100.num_gpus, name=h100.name) == h100


def test_pcie_servers_have_no_nvlink_one_shot_and_pcie_rates():
    for name, rate in (("rtx_pro_6000_server", 64e9), ("l40s_server", 32e9)):
        cluster = load_cluster(name)
        assert cluster.oneshot_latency_s == 0 and cluster.gpus_per_node == 8
        assert cluster.intra_bandwidth_bytes_per_s == rate


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_each_preset_evaluates_a_small_training_table(name):
    hw, cluster = load_hardware(name), load_cluster(PAIRS[name], num_gpus=16)
    model = load_model("llama3_8b")
    training = TrainingSpec(seq_len=4096, global_batch_size=32, gemm_dtype="fp8")
    plans = [ParallelPlan(dp=16 // (tp * pp), tp=tp, pp=pp) for tp, pp in ((1, 1), (2, 2), (8, 1))]
    out = evaluate_plans(plans_table(model, training, plans, hw, cluster))
    assert np.isfinite(out["step_s"]).all() and (out["step_s"] > 0).all()
    assert ((out["mfu"] > 0.05) & (out["mfu"] < 1)).all()


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_each_preset_evaluates_a_small_serving_table(name, tmp_path):
    hw = load_hardware(name)
    weights = "nvfp4" if hw.peak_fp4_flops > 0 else "fp8"
    spec = ServingSweepSpec(
        name="presets",
        model=load_model("llama3_8b"),
        hardware=(hw,),
        cluster=one_domain(PAIRS[name]),
        tp=(1, 2, 8),
        batch_sizes=(1, 32),
        prompt_lens=(1024,),
        weights_dtype=weights,
        kv_dtype="fp8",
    )
    report = run_serving(spec, ResultStore(tmp_path / name), log=lambda s: None)
    df = load(tmp_path / name)
    assert len(df) == report.valid == 6
    assert (df["tpot_s"] > 0).all() and (df["status"] == "ok").all()
    assert set(df["param_bytes"]) == {0.5625 if weights == "nvfp4" else 1.0}


def test_pcie_tensor_parallel_decode_pays_for_the_missing_nvlink(tmp_path):
    """The same decode at tp 8 over PCIe (RTX PRO Server) spends far more of its time in the
    tensor-parallel all-reduces than over NVLink (B200 NVL8)."""
    rows = {}
    for hw, cluster in (("rtx_pro_6000", "rtx_pro_6000_server"), ("b200", "hgx_b200")):
        spec = ServingSweepSpec(
            name="tp",
            model=load_model("llama3_70b"),
            hardware=(load_hardware(hw),),
            cluster=load_cluster(cluster),
            tp=(8,),
            batch_sizes=(32,),
            prompt_lens=(1024,),
            weights_dtype="fp8",
        )
        run_serving(spec, ResultStore(tmp_path / hw), log=lambda s: None)
        rows[hw] = load(tmp_path / hw).iloc[0]
    assert rows["rtx_pro_6000"]["tpot_s"] > 2 * rows["b200"]["tpot_s"]


@pytest.mark.skipif(data_root() is None, reason="measured tables (aiconfigurator-core) absent")
@pytest.mark.parametrize(
    "name, tables",
    [
        ("gb200", "gb200"),
        ("gb300", "gb300"),
        ("l40s", "l40s"),
        ("rtx_pro_6000", "rtx_pro_6000_server"),
    ],
)
def test_measured_table_sets_exist_for_the_presets_that_name_one(name, tables):
    assert table_set(load_hardware(name)) == tables
    assert (data_root() / tables).is_dir()
    assert table_set(load_hardware("gh200")) is None  # no GH200 tables


@given(st.integers(1, 4096), st.integers(1, 128))
def test_an_even_domain_share_fills_the_fewest_domains_equally(num_gpus, domain_gpus):
    share = even_domain_share(num_gpus, domain_gpus)
    if num_gpus <= domain_gpus or num_gpus % domain_gpus == 0:
        assert share == 0  # one domain, or whole domains: nothing to spread
    elif share:
        assert share <= domain_gpus and num_gpus % share == 0
        assert num_gpus // share == -(-num_gpus // domain_gpus)


def test_a_job_that_is_no_whole_number_of_nvl72_racks_is_told_its_even_split():
    assert even_domain_share(256, 72) == 64  # 4 racks of 64 GPUs
    assert even_domain_share(100, 72) == 50
    assert even_domain_share(146, 72) == 0  # 3 domains cannot hold 146 equally
    with pytest.raises(ConfigError, match=r"gpus_per_node\(72\) does not divide.*(256).*"
                       r"evenly over 4 domains set cluster.gpus_per_node=64"):  # fmt: skip
        load_cluster("gb200_nvl72", num_gpus=256)
    assert load_cluster("gb200_nvl72", num_gpus=256, gpus_per_node=64).gpus_per_node == 64


def _llama3_8b_steps_on_eight(*hardware) -> list[float]:
    """Step time of one Llama 3 8B plan (8 GPUs, data-parallel, 8K tokens) per hardware."""
    model, training = load_model("llama3_8b"), TrainingSpec(seq_len=8192, global_batch_size=64)
    plans = [ParallelPlan(dp=8, micro_batch_size=2)]
    cluster = load_cluster("mi300x_8", num_gpus=8)
    return [
        evaluate_plans(plans_table(model, training, plans, hw, cluster))["step_s"].iloc[0]
        for hw in hardware
    ]


def test_mi325x_is_the_mi300x_die_at_the_clock_its_power_limit_sustains():
    """MI325X: the MI300X's peaks and die with more, faster HBM; its GEMMs run 843 / 708 times
    the MI300X's kernel benchmark (AMD's measured max-achievable bf16 FLOPs, 1,447 against
    1,207 MHz), and a compute-bound step on it is faster by no more than that. Both presets
    are AMD's own builds of the stack; FP8 is compared at the presets' 0.8 of bf16."""
    mi325x = load_hardware("mi325x")
    mi300x = load_hardware("mi300x").replace(fp8_gemm_efficiency=0.4)
    assert mi325x.peak_flops == pytest.approx(mi300x.peak_flops, rel=1e-3)
    assert mi325x.peak_fp8_flops == pytest.approx(mi300x.peak_fp8_flops, rel=1e-3)
    assert mi325x.hbm_bytes > mi300x.hbm_bytes
    assert mi325x.hbm_bandwidth_bytes_per_s > mi300x.hbm_bandwidth_bytes_per_s
    ratio = 843 / 708
    assert mi325x.gemm_efficiency / mi300x.gemm_efficiency == pytest.approx(ratio, rel=0.01)
    assert mi325x.attention_efficiency / mi300x.attention_efficiency == pytest.approx(
        ratio, rel=0.01
    )
    steps = _llama3_8b_steps_on_eight(mi300x, mi325x)
    assert 1.0 < steps[0] / steps[1] <= ratio * 1.001


def test_mi300x_upstream_is_the_same_gpu_with_slower_training_gemms():
    """Upstream PyTorch on ROCm and AMD's builds run on the same MI300X: the datasheet, memory,
    kernels other than GEMMs and the network are one; only the GEMMs' sustained rates in a
    training step differ (the FP8 kernels' own rate is one), and the same step is slower under
    upstream PyTorch."""
    tuned, upstream = load_hardware("mi300x"), load_hardware("mi300x_upstream")
    differ = {
        f.name
        for f in dataclasses.fields(tuned)
        if getattr(tuned, f.name) != getattr(upstream, f.name)
    }
    # FP4 and W4A16 expert GEMMs default to shares of the bf16 GEMM efficiency
    derived = {"fp4_gemm_efficiency", "w4a16_moe_efficiency"}
    assert differ - derived == {"name", "gemm_efficiency", "fp8_step_efficiency"}
    assert upstream.fp8_gemm_efficiency == tuned.fp8_gemm_efficiency
    assert upstream.gemm_efficiency < tuned.gemm_efficiency
    assert upstream.fp8_step_efficiency < tuned.fp8_step_efficiency
    steps = _llama3_8b_steps_on_eight(tuned, upstream)
    assert steps[1] > 1.3 * steps[0]
