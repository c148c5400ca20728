"""The parallel block, ``x + attn(ln(x)) + mlp(ln(x))`` (GPT-J, PaLM, GPT-NeoX, MegaScale):
the same GEMMs on one norm of the input; training reduces the two branches' tensor-parallel
partial sums once, serving reduces each branch."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan as _evaluate_plan
from stage_dse.cost.serving import evaluate_serving_table
from stage_dse.errors import ConfigError
from stage_dse.graph.key import graph_key
from stage_dse.graph.transformer import build_graphs, build_serving_graphs
from stage_dse.runner.serving import serving_row
from stage_dse.spec import ParallelPlan, TrainingSpec
from stage_dse.spec.plan import MeshAxis
from stage_dse.spec.serving import ServingSpec
from stage_dse.trace import check_trace_dir
from stage_dse.trace.build import TraceConfig
from stage_dse.trace.serving import write_serving_trace
from stage_dse.trace.write import write_trace_set

TRAINING = TrainingSpec(seq_len=2048, global_batch_size=16)
A100, DGX = load_hardware("a100_80gb"), load_cluster("dgx_a100")
PARALLEL = dataclasses.replace(load_model("gpt_j_6b"), num_layers=4)  # GPT-J's own block
GPTJ = dataclasses.replace(PARALLEL, parallel_block=False)  # the same layer, sequential


def evaluate_plan(model, plan):
    return _evaluate_plan(model, TRAINING, plan, hardware=A100, cluster=DGX)


@pytest.mark.parametrize("sp", [False, True])
def test_the_parallel_block_halves_the_layers_tensor_parallel_traffic(sp):
    plan = ParallelPlan(tp=4, micro_batch_size=1, sequence_parallel=sp)
    seq, par = evaluate_plan(GPTJ, plan), evaluate_plan(PARALLEL, plan)
    # one norm fewer per layer: its scale and shift, 2h parameters
    assert seq["params"] - par["params"] == 2 * GPTJ.hidden_size * GPTJ.num_layers
    # the GEMMs are the same: model flops differ by the norm's share only
    assert par["model_flops"] == pytest.approx(seq["model_flops"], rel=1e-3)
    # per layer, fewer [b, s, h] collectives (each counted as its whole buffer): without
    # sequence parallelism one all-reduce forward and one backward; with it one
    # reduce-scatter and one all-gather each way, and one re-gather of the norm's output for
    # the weight gradients; the embedding's and output layer's collectives are unchanged
    tensor_bytes = TRAINING.global_batch_size * TRAINING.seq_len * GPTJ.hidden_size * 2
    fewer = {"reduce_scatter": 2, "all_gather": 3} if sp else {"all_reduce": 2}
    for kind, n in fewer.items():
        saved = seq[f"comm_{kind}_tp"] - par[f"comm_{kind}_tp"]
        assert saved == pytest.approx(n * GPTJ.num_layers * tensor_bytes, rel=1e-9), kind
    assert par["tp_comm_s"] < seq["tp_comm_s"]
    assert par["step_s"] < seq["step_s"]
    # the second norm's input and output are no longer kept for backward
    assert par["mem_activations_bytes"] < seq["mem_activations_bytes"]


def test_without_tensor_parallelism_the_parallel_block_costs_what_the_sequential_one_does():
    plan = ParallelPlan(micro_batch_size=1)
    seq, par = evaluate_plan(GPTJ, plan), evaluate_plan(PARALLEL, plan)
    assert par["tp_comm_s"] == seq["tp_comm_s"] == 0
    assert par["step_s"] == pytest.approx(seq["step_s"], rel=0.01)


def _block_collectives(model, mode):
    plan = ParallelPlan(tp=4, micro_batch_size=1)
    key = graph_key(model, plan, TRAINING)
    graphs = build_graphs(model, plan, TRAINING) if mode is None else (
        build_serving_graphs(key, mode, 2))  # fmt: skip
    return sum(1 for op in graphs.block.ops if op.is_comm and op.group == {MeshAxis.TP})


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_serving_reduces_each_branch_as_engines_do(mode):
    # training: a forward and a backward all-reduce per layer fewer
    assert _block_collectives(PARALLEL, None) == _block_collectives(GPTJ, None) - 2
    assert _block_collectives(PARALLEL, mode) == _block_collectives(GPTJ, mode) == 2
    serving = ServingSpec(prompt_len=1024, output_tokens=128, batch_size=8)
    h100, cluster = load_hardware("h100_sxm"), load_cluster("dgx_h100")
    out = []
    for model in (GPTJ, PARALLEL):
        row, key = serving_row(model, serving, h100, cluster, 4)
        out.append(evaluate_serving_table(pd.DataFrame([row]), [key]).iloc[0])
    seq, par = out
    # one norm kernel fewer per layer, the rest alike
    for col in ("serve_ttft_s", "serve_tpot_s"):
        assert par[col] <= seq[col]
        assert par[col] == pytest.approx(seq[col], rel=0.03)


def test_a_parallel_block_decode_trace_passes_the_checker(tmp_path):
    plan = ParallelPlan(tp=2)
    write_serving_trace(
        PARALLEL,
        ServingSpec(prompt_len=512, batch_size=2),
        plan,
        load_hardware("h100_sxm"),
        load_cluster("dgx_h100", num_gpus=plan.num_gpus),
        tmp_path,
        steps=2,
    )
    assert check_trace_dir(tmp_path) == []
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["comp_flops_total"] == manifest["analytic_flops_total"]


def _training_trace(tmp_path, model):
    plan = ParallelPlan(dp=2, tp=2, pp=2, sequence_parallel=True, micro_batch_size=1)
    training = TrainingSpec(seq_len=128, global_batch_size=8)
    h100 = load_hardware("h100_sxm")
    cfg = TraceConfig(model, training, plan, h100, load_cluster("dgx_h100", num_gpus=8))
    write_trace_set(cfg, tmp_path)
    assert check_trace_dir(tmp_path) == []
    return json.loads((tmp_path / "manifest.json").read_text())


def test_a_parallel_block_training_trace_passes_the_checker_with_fewer_collectives(tmp_path):
    small = {"hidden_size": 256, "ffn_hidden_size": 1024, "num_heads": 4, "num_kv_heads": 4}
    small |= {"head_dim": 64, "vocab_size": 1024}
    par = _training_trace(tmp_path / "par", dataclasses.replace(PARALLEL, **small))
    seq = _training_trace(tmp_path / "seq", dataclasses.replace(GPTJ, **small))
    assert par["comp_flops_total"] == par["analytic_flops_total"]
    # per layer and micro-batch: one collective fewer each way (and the second norm's
    # kernels), the same compute otherwise
    assert par["total_nodes"] < seq["total_nodes"]
    assert par["analytic_flops_total"] == pytest.approx(seq["analytic_flops_total"], rel=1e-2)


@pytest.mark.parametrize("preset", ["mixtral_8x7b", "deepseek_v3"])
def test_the_parallel_block_is_refused_for_experts_and_latent_attention(preset):
    with pytest.raises(ConfigError, match=r"model\.parallel_block"):
        dataclasses.replace(load_model(preset), parallel_block=True)
