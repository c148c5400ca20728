"""Hybrid sharding (``ParallelPlan.dp_replicate``): ZeRO states sharded over a group of the
data-parallel ranks, replicated across groups; gradients reduce-scattered in the group, then
the shard all-reduced across the replicas."""

from __future__ import annotations

import pytest

from stage_dse.config import load_cluster, load_hardware, load_model
from stage_dse.cost.bind import evaluate_plan
from stage_dse.errors import ConfigError
from stage_dse.graph import OpKind, build_graphs
from stage_dse.graph.ir import CollKind
from stage_dse.spec import MeshAxis, ParallelPlan, TrainingSpec, validate_plan
from stage_dse.trace.mesh import Mesh

LLAMA = load_model("llama2_7b")
STEP = TrainingSpec(seq_len=4096, global_batch_size=512)
A100 = load_hardware("a100_80gb")


def costs(plan: ParallelPlan, gpus: int) -> dict[str, float]:
    cluster = load_cluster("dgx_a100", num_gpus=gpus)
    return evaluate_plan(LLAMA, STEP, plan, hardware=A100, cluster=cluster)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_states_per_gpu_are_those_of_one_sharding_group(zero):
    """Weights, gradients and optimizer states per GPU depend on the sharding group's size
    only: 64 ranks in groups of 8 hold what 8 ranks sharding over all of them hold."""
    hybrid = costs(ParallelPlan(dp=64, dp_replicate=8, zero_stage=zero, micro_batch_size=1), 64)
    alone = costs(ParallelPlan(dp=8, zero_stage=zero, micro_batch_size=1), 8)
    full = costs(ParallelPlan(dp=64, zero_stage=zero, micro_batch_size=1), 64)
    for part in ("mem_weights_bytes", "mem_grads_bytes", "mem_optimizer_bytes"):
        assert hybrid[part] == pytest.approx(alone[part], rel=1e-12)
    assert hybrid["mem_optimizer_bytes"] == pytest.approx(8 * full["mem_optimizer_bytes"])


def test_replicas_all_reduce_the_scattered_shard():
    """ZeRO-3: every micro-batch's gradients are reduce-scattered over the group (the same
    buffers as sharding over all ranks) and the group's shard all-reduced across replicas."""
    plan = ParallelPlan(dp=64, dp_replicate=8, zero_stage=3, micro_batch_size=1)
    hybrid, full = costs(plan, 64), costs(plan.replace(dp_replicate=1), 64)
    m = STEP.global_batch_size // plan.dp
    assert hybrid["comm_reduce_scatter_bytes"] == pytest.approx(full["comm_reduce_scatter_bytes"])
    assert full["comm_all_reduce_bytes"] == 0
    assert hybrid["comm_all_reduce_bytes"] == pytest.approx(m * hybrid["mem_grads_bytes"])
    # ZeRO-1: gradients accumulate whole and the step's reduce-scatter leaves one shard of
    # dp / dp_replicate to all-reduce across the replicas
    z1 = costs(plan.replace(zero_stage=1), 64)
    assert z1["comm_all_reduce_bytes"] == pytest.approx(z1["mem_grads_bytes"] / plan.dp_shard)


def test_reduce_scatter_runs_before_the_replicas_all_reduce():
    plan = ParallelPlan(dp=16, dp_replicate=2, zero_stage=3)
    block = build_graphs(LLAMA, plan, STEP).block
    colls = [op for op in block.ops if op.kind is OpKind.COLLECTIVE and op.group == {MeshAxis.DR}]
    assert colls and all(op.coll is CollKind.ALL_REDUCE for op in colls)
    for op in colls:  # its input is the reduce-scatter's output: one shard
        producer = block.producer[op.inputs[0]]
        assert producer.coll is CollKind.REDUCE_SCATTER
        assert MeshAxis.DR not in producer.group


def test_sharding_inside_a_node_gathers_over_nvlink():
    """ZeRO-3 parameter gathers inside a node (groups of 8) beat gathers over 128 ranks across
    nodes: the published reason for hybrid sharding (PyTorch FSDP HYBRID_SHARD)."""
    plan = ParallelPlan(dp=128, zero_stage=3, micro_batch_size=2)
    hybrid, full = costs(plan.replace(dp_replicate=16), 128), costs(plan, 128)
    assert hybrid["zero_comm_s"] < full["zero_comm_s"]


def test_mesh_places_replicas_after_the_sharding_group():
    plan = ParallelPlan(dp=8, tp=2, dp_replicate=2, zero_stage=1)
    mesh = Mesh(plan)
    kinds = [frozenset({MeshAxis.DS}), frozenset({MeshAxis.DR}), frozenset({MeshAxis.TP})]
    mesh.register(kinds)
    assert mesh.members(frozenset({MeshAxis.DS}), 0) == [0, 2, 4, 6]
    assert mesh.members(frozenset({MeshAxis.DR}), 0) == [0, 8]
    assert mesh.members(frozenset({MeshAxis.TP}), 9) == [8, 9]
    assert mesh.world == 16


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dp": 8, "dp_replicate": 3, "zero_stage": 1}, "dp_replicate(3) does not divide dp(8)"),
        ({"dp": 8, "dp_replicate": 2}, "needs zero_stage >= 1"),
        ({"dp": 8, "dp_replicate": 0, "zero_stage": 1}, "dp_replicate"),
        ({"dp": 8, "zero_stage": 1, "rank_order": "tp-cp-ep-ds-dr-pp"}, "names ds or dr"),
    ],
)
def test_bad_hybrid_plans_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelPlan(**fields)


def test_expert_group_must_fit_a_sharding_group():
    mixtral = load_model("mixtral_8x7b")
    plan = ParallelPlan(dp=8, ep=8, dp_replicate=2, zero_stage=1)
    with pytest.raises(ConfigError, match="does not fit a sharding group"):
        validate_plan(mixtral, TrainingSpec(seq_len=4096, global_batch_size=64), plan)
    validate_plan(mixtral, TrainingSpec(seq_len=4096, global_batch_size=64), plan.replace(ep=4))


def test_sweep_over_shard_groups_stores_rows_whose_traces_check(tmp_path):
    """A sweep over ``shard_group`` stores hybrid plans as rows (the replicas in
    ``dp_replicate``), and a hybrid row's trace set passes the checker: every collective of
    the replicas' groups is issued on each member."""
    from conftest import gpt

    from stage_dse.results import ResultStore, load
    from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
    from stage_dse.search import SearchSpace
    from stage_dse.trace import check_trace_dir
    from stage_dse.trace.select import select_and_write

    spec = SweepSpec(
        name="hsdp",
        models=(gpt(layers=4, hidden=256, heads=4, vocab=1024),),
        training=TrainingSpec(seq_len=128, global_batch_size=8),
        hardware=(load_hardware("h100_sxm"),),
        cluster=load_cluster("dgx_h100"),
        gpu_counts=(8,),
        space=SearchSpace(
            tp=(1,),
            pp=(1,),
            micro_batch_size=(1,),
            zero_stage=(0, 3),
            shard_group=(0, 2),
            recompute=("none",),
            sequence_parallel=(False,),
        ),
    )
    store = ResultStore(tmp_path / "hsdp")
    run_grid(spec, LocalExecutor(), store, batch_size=100, progress=False)
    rows = load(store.root)
    # zero 0, zero 3 over all 8 ranks, zero 3 in groups of 2 (4 replicas); zero 0 with a
    # group is rejected
    assert sorted(zip(rows["zero_stage"], rows["dp_replicate"])) == [(0, 1), (3, 1), (3, 4)]
    hybrid = rows.loc[rows["dp_replicate"] == 4, "config_hash"].tolist()
    chosen = select_and_write(store.root, hashes=hybrid, log=lambda s: None)
    assert chosen == hybrid
    traced = load(store.root).set_index("config_hash").loc[hybrid[0], "trace_dir"]
    assert check_trace_dir(store.root / traced) == []
