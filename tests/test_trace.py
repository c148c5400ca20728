"""Chakra traces: encoding, golden trace set, checker, flops totals, determinism, selection."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gpt, llama

from stage_dse.cli.trace import estimate_trace_bytes, parse_bytes, select_and_write
from stage_dse.cli.trace import main as trace_main
from stage_dse.config import load_cluster, load_hardware
from stage_dse.cost.bind import evaluate_plan
from stage_dse.errors import ConfigError
from stage_dse.results import ResultStore, load
from stage_dse.runner import LocalExecutor, SweepSpec, run_grid
from stage_dse.search import SearchSpace
from stage_dse.spec import MeshAxis, ParallelPlan, TrainingSpec
from stage_dse.trace import TraceConfig, check_trace_dir, stage_layers, write_trace_set
from stage_dse.trace import encode as enc
from stage_dse.trace import et_def_pb2 as pb
from stage_dse.trace.mesh import ASTRA_SIM_MAX_GROUP_ID, EMBEDDING, Mesh

H100 = load_hardware("h100_sxm")
GOLDEN = Path(__file__).parent / "golden"
TINY_TRAIN = TrainingSpec(seq_len=128, global_batch_size=8)


def tiny_cfg(plan: ParallelPlan, model=None, training=TINY_TRAIN, **kw) -> TraceConfig:
    return TraceConfig(
        model=model or gpt(layers=4, hidden=256, heads=4, vocab=1024),
        training=training,
        plan=plan,
        hardware=H100,
        cluster=load_cluster("dgx_h100", num_gpus=max(8, plan.num_gpus)),
        **kw,
    )


def decode(path: Path) -> tuple[pb.GlobalMetadata, list[pb.Node]]:
    meta, nodes = enc.read_trace(path)
    return meta, list(nodes)


def attrs(node: pb.Node) -> dict:
    return {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}


def rewrite(path: Path, meta: pb.GlobalMetadata, nodes: list[pb.Node]) -> None:
    data = enc.frame(meta.SerializeToString())
    data += b"".join(enc.frame(n.SerializeToString()) for n in nodes)
    path.write_bytes(data)


# ---------------------------------------------------------------------------- encoding
def test_encoder_matches_protobuf_serialization():
    a = (
        enc.attr_bool("is_cpu_op", False)
        + enc.attr_int64("num_ops", 123456789012)
        + enc.attr_uint64("tensor_size", 42)
        + enc.attr_int32("comm_tag", 7)
        + enc.attr_string("pg_name", "17")
    )
    ours = enc.node(
        300,
        "fc1",
        enc.NodeType.COMP_NODE,
        data_deps=[1, 299],
        ctrl_deps=[5],
        duration_micros=1234,
        attrs=a,
    )
    ref = pb.Node(
        id=300,
        name="fc1",
        type=pb.COMP_NODE,
        data_deps=[1, 299],
        ctrl_deps=[5],
        duration_micros=1234,
    )
    ref.attr.add(name="is_cpu_op", bool_val=False)
    ref.attr.add(name="num_ops", int64_val=123456789012)
    ref.attr.add(name="tensor_size", uint64_val=42)
    ref.attr.add(name="comm_tag", int32_val=7)
    ref.attr.add(name="pg_name", string_val="17")
    assert ours == ref.SerializeToString()
    assert enc.metadata() == pb.GlobalMetadata(version=enc.SCHEMA_VERSION).SerializeToString()
    assert enc.node(0, "", enc.NodeType.COMP_NODE) == pb.Node(type=pb.COMP_NODE).SerializeToString()


def test_generated_module_matches_the_proto():
    pytest.importorskip("grpc_tools")
    here = Path(__file__).parents[1] / "stage_dse" / "trace"
    out = Path(pytest.importorskip("tempfile").mkdtemp())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{here}",
            f"--python_out={out}",
            "et_def.proto",
        ],
        check=True,
    )
    assert (out / "et_def_pb2.py").read_text() == (here / "et_def_pb2.py").read_text()


def test_enum_values_match_the_chakra_schema():
    assert [
        pb.NodeType.Value(n)
        for n in ("COMP_NODE", "COMM_SEND_NODE", "COMM_RECV_NODE", "COMM_COLL_NODE")
    ] == [4, 5, 6, 7]
    assert pb.CollectiveCommType.Value("REDUCE_SCATTER") == 7
    assert pb.CollectiveCommType.Value("ALL_TO_ALL") == 6
    field = pb.AttributeProto.DESCRIPTOR.fields_by_name
    assert (field["int64_val"].number, field["uint64_val"].number, field["string_val"].number) == (
        9,
        13,
        29,
    )


# ---------------------------------------------------------------------------- mesh
def test_mesh_group_ids_are_dense_and_closed_form():
    mesh = Mesh(ParallelPlan(dp=4, tp=2, pp=2, cp=2))
    kinds = [
        frozenset({MeshAxis.TP}),
        frozenset({MeshAxis.DP, MeshAxis.CP}),
        frozenset({MeshAxis.CP}),
    ]
    mesh.register(kinds)
    groups = mesh.groups_json()
    assert sorted(int(k) for k in groups) == list(range(1, mesh.num_group_ids + 1))
    for rank in range(mesh.world):
        for kind in kinds:
            gid = mesh.group_id(kind, rank)
            assert groups[str(gid)] == mesh.members(kind, rank)
            assert len(groups[str(gid)]) == mesh.group_size(kind)


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "pp-tp-cp-ep-dp"])
def test_embedding_groups_join_the_two_ends_of_each_pipeline(order):
    plan = ParallelPlan(dp=2, tp=2, pp=4, rank_order=tuple(order.split("-")))
    mesh = Mesh(plan)
    mesh.register([frozenset({MeshAxis.TP}), EMBEDDING])
    groups = mesh.groups_json()
    assert sorted(int(k) for k in groups) == list(range(1, mesh.num_group_ids + 1))
    assert mesh.num_groups(EMBEDDING) == 4 and mesh.group_size(EMBEDDING) == 2
    seen = set()
    for rank in range(mesh.world):
        stage = mesh.coords(rank)[MeshAxis.PP]
        members = mesh.members(EMBEDDING, rank)
        if stage in (0, 3):
            assert rank in members and groups[str(mesh.group_id(EMBEDDING, rank))] == members
            assert sorted(mesh.coords(r)[MeshAxis.PP] for r in members) == [0, 3]
            peer = next(r for r in members if r != rank)
            other = {a: c for a, c in mesh.coords(peer).items() if a is not MeshAxis.PP}
            assert other == {a: c for a, c in mesh.coords(rank).items() if a is not MeshAxis.PP}
            seen.update(members)
        else:
            assert rank not in members
    assert seen == {r for r in range(mesh.world) if mesh.coords(r)[MeshAxis.PP] in (0, 3)}


def test_group_id_limit_is_reported():
    mesh = Mesh(ParallelPlan(dp=4096, tp=2))
    mesh.register([frozenset({MeshAxis.TP}), frozenset({MeshAxis.DP, MeshAxis.CP})])
    assert mesh.num_group_ids == 4096 + 2 > ASTRA_SIM_MAX_GROUP_ID


@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [(4, 2, [2, 2]), (6, 4, [1, 2, 2, 1]), (126, 16, [7] + [8] * 14 + [7]), (5, 4, [1, 1, 2, 1])],
)
def test_uneven_stage_layers(layers, pp, expected):
    got = stage_layers(layers, pp)
    assert got == expected and sum(got) == layers


# ---------------------------------------------------------------------------- trace sets
def test_golden_trace_set(tmp_path):
    """dp=tp=pp=2 on a 4-layer GPT: decoded field by field against the committed golden."""
    ts = write_trace_set(tiny_cfg(ParallelPlan(dp=2, tp=2, pp=2)), tmp_path)
    assert ts.ranks == 8 and ts.files == 8
    assert check_trace_dir(tmp_path) == []
    groups = json.loads((tmp_path / "comm_groups.json").read_text())
    rendering = {"groups": groups, "ranks": {}}
    for rank in (0, 3, 4, 7):
        meta, nodes = decode(tmp_path / f"trace.{rank}.et")
        assert meta.version == "0.0.4"
        rendering["ranks"][str(rank)] = [
            [n.id, n.name, pb.NodeType.Name(n.type), list(n.data_deps), sorted(attrs(n).items())]
            for n in nodes
        ]
    golden = GOLDEN / "trace_dp2_tp2_pp2.json"
    if not golden.exists():  # first run writes it; review it, then it is the reference
        golden.write_text(json.dumps(rendering, indent=0, sort_keys=True))
    assert json.loads(json.dumps(rendering, sort_keys=True)) == json.loads(golden.read_text())
    # spot checks that do not depend on the golden: TP groups are {0,1}, {2,3}, ...; rank 0's
    # first collective is the embedding all-reduce on its TP group; stage 0 sends to stage 1
    tp = {tuple(v) for v in groups.values() if len(v) == 2 and v[1] - v[0] == 1}
    assert {(0, 1), (2, 3), (4, 5), (6, 7)} <= tp
    _, nodes = decode(tmp_path / "trace.0.et")
    first_coll = next(n for n in nodes if n.type == pb.COMM_COLL_NODE)
    a = attrs(first_coll)
    assert a["comm_type"] == pb.ALL_REDUCE and groups[a["pg_name"]] == [0, 1]
    assert a["comm_size"] == 1 * 128 * 256 * 2  # micro-batch x seq x hidden x bf16
    sends = [attrs(n) for n in nodes if n.type == pb.COMM_SEND_NODE]
    assert all(s["comm_dst"] == 4 for s in sends) and [s["comm_tag"] for s in sends] == [0, 2, 4, 6]


@pytest.mark.parametrize(
    "plan",
    [
        ParallelPlan(dp=2, tp=2, pp=2),
        ParallelPlan(dp=2, tp=2, pp=2, sequence_parallel=True, zero_stage=1, recompute="selective"),
        ParallelPlan(dp=2, cp=2, pp=2, zero_stage=3, recompute="full"),
        ParallelPlan(dp=4, pp=2, zero_stage=2, attention="materialized"),
        ParallelPlan(dp=2, tp=2, cp=2, zero_stage=3, sequence_parallel=True),
        # Megatron-Core's refinements: one of each chunk's two layers; two modules
        ParallelPlan(dp=2, pp=2, zero_stage=1, recompute="full:1"),
        ParallelPlan(dp=2, tp=2, pp=2, sequence_parallel=True, recompute="selective:layernorm+mlp"),
        # hybrid sharding: states sharded over 2 ranks, 2 replicas of each shard
        ParallelPlan(dp=4, pp=2, zero_stage=3, dp_replicate=2),
        ParallelPlan(dp=4, tp=2, zero_stage=1, dp_replicate=2, sequence_parallel=True),
    ],
)
def test_comp_flops_equal_the_analytic_total(tmp_path, plan):
    cfg = tiny_cfg(
        plan, model=llama(layers=4, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=1024)
    )
    write_trace_set(cfg, tmp_path)
    assert check_trace_dir(tmp_path) == []
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["comp_flops_total"] == manifest["analytic_flops_total"]
    # and, independently, against the compiled cost model: the per-GPU stage flops of every
    # micro-batch on every GPU, plus the optimizer step
    costs = evaluate_plan(cfg.model, cfg.training, plan)
    m = costs["stage_microbatches"]
    per_stage = plan.num_gpus // plan.pp
    last = costs["stage_last_flops"] if plan.pp > 1 else 0.0  # pp=1: the first stage is all
    stage_flops = per_stage * m * (costs["stage_first_flops"] + last)
    opt = manifest["analytic_flops_total"] - stage_flops
    # the optimizer step: 12 flops per parameter per replica of the optimizer state (norm
    # weights are also replicated over tensor-parallel ranks, a few percent at these sizes)
    replicas = plan.dp * plan.cp if plan.zero_stage == 0 else plan.dp_replicate
    assert 1.0 <= opt / (12 * costs["params"] * replicas) <= 1.05


def test_uneven_split_places_embedding_first_and_loss_last(tmp_path):
    model = gpt(layers=6, hidden=256, heads=4, vocab=1024)
    write_trace_set(tiny_cfg(ParallelPlan(dp=1, pp=4), model=model, granularity="op"), tmp_path)
    assert check_trace_dir(tmp_path) == []
    names = {r: [n.name for n in decode(tmp_path / f"trace.{r}.et")[1]] for r in range(4)}
    assert "word_embedding" in names[0] and all("word_embedding" not in names[r] for r in (1, 2, 3))
    assert "loss" in names[3] and all("loss" not in names[r] for r in (0, 1, 2))
    counts = [sum(1 for n in names[r] if n == "fc1") for r in range(4)]
    m = TINY_TRAIN.global_batch_size
    assert counts == [1 * m, 2 * m, 2 * m, 1 * m]


def test_two_runs_are_byte_identical(tmp_path):
    cfg = tiny_cfg(ParallelPlan(dp=2, tp=2, pp=2, zero_stage=1))
    write_trace_set(cfg, tmp_path / "a", config_hash="x")
    write_trace_set(cfg, tmp_path / "b", config_hash="x")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)
    assert not mismatch and not errors and len(match) == 8 + 2


def test_interleaved_trace_set(tmp_path):
    """pp=2 with 2 chunks of one layer each: chunk 1 of stage 0 receives from stage 1."""
    cfg = tiny_cfg(ParallelPlan(dp=2, tp=2, pp=2, schedule="interleaved", virtual_stages=2))
    write_trace_set(cfg, tmp_path)
    assert check_trace_dir(tmp_path) == []
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["comp_flops_total"] == manifest["analytic_flops_total"]
    _, nodes = decode(tmp_path / "trace.0.et")
    recvs = [attrs(n) for n in nodes if n.type == pb.COMM_RECV_NODE]
    # stage 0 receives from stage 1 (rank 4): chunk 1's activations (wrapping from the last
    # stage), and the gradients of both its chunks: 3 messages per micro-batch
    m = TINY_TRAIN.global_batch_size // 2
    assert recvs and all(r["comm_src"] == 4 for r in recvs)
    assert len(recvs) == 3 * m
    # chunks of unequal size (6 layers over 2 x 2 virtual stages: 1, 2, 2, 1) are traced too
    uneven = tiny_cfg(
        ParallelPlan(dp=1, pp=2, schedule="interleaved", virtual_stages=2),
        model=gpt(layers=6, hidden=256, heads=4, vocab=1024),
        training=TrainingSpec(seq_len=128, global_batch_size=8),
    )
    write_trace_set(uneven, tmp_path / "uneven")
    assert check_trace_dir(tmp_path / "uneven") == []
    manifest = json.loads((tmp_path / "uneven" / "manifest.json").read_text())
    assert manifest["stage_layers"] == [3, 3]
    assert manifest["comp_flops_total"] == manifest["analytic_flops_total"]


@pytest.mark.parametrize(("pp", "m", "v"), [(4, 8, 1), (4, 8, 2), (2, 4, 3), (4, 4, 2)])
def test_schedule_orders_cover_every_microbatch_chunk_once(pp, m, v):
    from stage_dse.trace.schedule import schedule_order

    for stage in range(pp):
        order = schedule_order(stage, pp, m, v)
        for phase in "FB":
            got = sorted((mb, c) for p, mb, c in order if p == phase)
            assert got == sorted((mb, c) for mb in range(m) for c in range(v))
        # a backward never precedes its forward
        seen = set()
        for p, mb, c in order:
            if p == "F":
                seen.add((mb, c))
            else:
                assert (mb, c) in seen


# ---------------------------------------------------------------------------- checker
@pytest.fixture
def good_set(tmp_path):
    write_trace_set(tiny_cfg(ParallelPlan(dp=2, tp=2, pp=2)), tmp_path)
    assert check_trace_dir(tmp_path) == []
    return tmp_path


def _mutate(path: Path, fn) -> None:
    meta, nodes = decode(path)
    nodes = fn(nodes)
    rewrite(path, meta, nodes)


def _colls(nodes):
    return [i for i, n in enumerate(nodes) if n.type == pb.COMM_COLL_NODE]


def test_checker_rejects_a_dangling_dependency(good_set):
    _mutate(good_set / "trace.1.et", lambda ns: [*ns[:-1], _with(ns[-1], data_deps=[999999])])
    assert any("missing node 999999" in p for p in check_trace_dir(good_set))


def test_checker_rejects_a_cycle(good_set):
    def cyc(ns):
        ns[0].data_deps.append(ns[1].id)
        return ns

    _mutate(good_set / "trace.2.et", cyc)
    assert any("cycle" in p for p in check_trace_dir(good_set))


def test_checker_rejects_an_unmatched_send(good_set):
    _mutate(
        good_set / "trace.0.et",
        lambda ns: (
            [n for n in ns if n.type != pb.COMM_SEND_NODE][:]
            + [n for n in ns if n.type == pb.COMM_SEND_NODE][1:]
        ),
    )
    assert any("send/recv without a match" in p for p in check_trace_dir(good_set))


def test_checker_rejects_a_collective_missing_on_one_member(good_set):
    def drop(ns):
        i = _colls(ns)[3]
        removed = ns[i].id
        out = [n for j, n in enumerate(ns) if j != i]
        for n in out:
            if removed in n.data_deps:
                deps = [d for d in n.data_deps if d != removed]
                del n.data_deps[:]
                n.data_deps.extend(deps)
        return out

    _mutate(good_set / "trace.1.et", drop)
    assert any("different collective sequences" in p for p in check_trace_dir(good_set))


def test_checker_rejects_two_swapped_collectives(good_set):
    """Two collectives of one group with different sizes trade places on one member."""

    def swap(ns):
        colls = [(k, attrs(ns[k])) for k in _colls(ns)]
        i, other = next(
            (k, j)
            for k, a in colls
            for j, b in colls
            if b["pg_name"] == a["pg_name"] and b["comm_size"] != a["comm_size"]
        )
        ids = (ns[i].id, ns[other].id)
        ns[i], ns[other] = ns[other], ns[i]
        ns[i].id, ns[other].id = ids  # keep ids ascending in file order
        return ns

    _mutate(good_set / "trace.4.et", swap)
    problems = check_trace_dir(good_set)
    assert any("different collective sequences" in p for p in problems)


def test_checker_rejects_a_cross_rank_collective_cycle(tmp_path):
    """Rank 1 issues its data-parallel sync before its tensor-parallel collectives while its
    TP peer does the opposite: the orders form a cycle through the groups."""
    write_trace_set(tiny_cfg(ParallelPlan(dp=2, tp=2)), tmp_path)
    assert check_trace_dir(tmp_path) == []

    def dp_first(ns):
        colls = _colls(ns)
        groups = json.loads((tmp_path / "comm_groups.json").read_text())
        dp = [i for i in colls if groups[attrs(ns[i])["pg_name"]] in ([1, 3], [0, 2])]
        tp = [i for i in colls if i not in dp]
        order = dp + tp  # every dp collective first, then the tp ones
        moved = [ns[i] for i in order]
        ids = sorted(ns[i].id for i in colls)
        for node, nid in zip(moved, ids):
            node.id = nid
            del node.data_deps[:]
        rest = [n for k, n in enumerate(ns) if k not in set(colls)]
        for n in rest:
            del n.data_deps[:]
        return sorted(rest + moved, key=lambda n: n.id)

    _mutate(tmp_path / "trace.1.et", dp_first)
    _mutate(tmp_path / "trace.2.et", dp_first)
    problems = check_trace_dir(tmp_path)
    assert any("cycle across ranks" in p or "different collective sequences" in p for p in problems)


def test_checker_rejects_an_unsupported_collective(good_set):
    def bcast(ns):
        for at in ns[_colls(ns)[0]].attr:
            if at.name == "comm_type":
                at.int64_val = pb.BROADCAST
        return ns

    _mutate(good_set / "trace.0.et", bcast)
    assert any("unsupported collective type 5" in p for p in check_trace_dir(good_set))


def test_checker_rejects_a_float_where_an_integer_is_required(good_set):
    def floaty(ns):
        node = next(n for n in ns if n.type == pb.COMP_NODE)
        for at in node.attr:
            if at.name == "num_ops":
                value = at.int64_val
                at.double_val = float(value)
        return ns

    _mutate(good_set / "trace.3.et", floaty)
    assert any(
        "attr num_ops is double_val, needs int64_val" in p for p in check_trace_dir(good_set)
    )


def _with(node: pb.Node, **fields) -> pb.Node:
    new = pb.Node()
    new.CopyFrom(node)
    for k, v in fields.items():
        del getattr(new, k)[:]
        getattr(new, k).extend(v)
    return new


# ---------------------------------------------------------------------------- selection
@pytest.fixture
def small_results(tmp_path):
    spec = SweepSpec(
        name="sel",
        models=(gpt(layers=4, hidden=256, heads=4, vocab=1024),),
        training=TINY_TRAIN,
        hardware=(H100,),
        cluster=load_cluster("dgx_h100"),
        gpu_counts=(8,),
        space=SearchSpace(micro_batch_size=(1,), virtual_stages=(1,)),
    )
    store = ResultStore(tmp_path / "sel")
    run_grid(spec, LocalExecutor(), store, batch_size=100, progress=False)
    return store.root


def test_selection_fills_trace_dir_for_exactly_the_selected_rows(small_results):
    store = ResultStore(small_results)
    before = load(store.root)
    chosen = select_and_write(store.root, top=3, log=lambda s: None)
    after = load(store.root)
    assert len(after) == len(before) and after["config_hash"].is_unique
    marked = after[after["trace_dir"].notna()]
    assert sorted(marked["config_hash"]) == sorted(chosen) and len(chosen) == 3
    best3 = before[before.status == "ok"].sort_values("step_s").head(3)["config_hash"]
    assert set(chosen) == set(best3)
    for h, d in zip(marked["config_hash"], marked["trace_dir"]):
        assert d == f"_traces/{h}"
        assert check_trace_dir(store.root / d) == []
    # each traced row records its replayed step time (this model's kernels last a few
    # microseconds, the trace's time unit, so only its presence is checked here)
    assert (marked["trace_replay_s"] > 0).all()
    assert after.loc[after["trace_dir"].isna(), "trace_replay_s"].isna().all()
    cols = [c for c in before.columns if c not in ("trace_dir", "trace_replay_s")]
    key = before.sort_values("config_hash").reset_index(drop=True)[cols]
    import pandas as pd

    pd.testing.assert_frame_equal(
        key, after.sort_values("config_hash").reset_index(drop=True)[cols]
    )


def test_trace_cli_config_check_and_json(tmp_path, capsys):
    out = tmp_path / "t"
    rc = trace_main(
        ["config", str(out), "model=llama3_8b", "num_gpus=[8]", "plan.tp=[2]", "plan.pp=[2]",
         "plan.micro_batch_size=[1]", "plan.zero_stage=[1]", "plan.recompute=[full]",
         "plan.sequence_parallel=[true]", "training.global_batch_size=8", "training.seq_len=1024"]
    )  # fmt: skip
    assert rc == 0
    assert trace_main(["check", str(out)]) == 0
    assert "ok: 8 ranks" in capsys.readouterr().out
    assert trace_main(["json", str(out / "trace.0.et")]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = json.loads(lines[1])
    # ZeRO-1 with overlap_param_gather: the step opens with the embedding's parameter gather
    assert json.loads(lines[0]) == {"version": "0.0.4"} and first["type"] == "COMM_COLL_NODE"
    assert first["id"] == "0" and first["dataDeps"] == []  # defaults are printed too
    # piped into a reader that stops early (`| head`): no traceback, exit 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "stage_dse.cli.trace", "json", str(out / "trace.0.et")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline().startswith(b'{"version"')
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 0 and "Traceback" not in err and "BrokenPipe" not in err
    assert trace_main(["config", str(out), "plan.tp=[1,2]"]) == 2
    assert "give exactly one value" in capsys.readouterr().err


# ---------------------------------------------------------------------------- simulator semantics
def test_all_gather_size_is_each_ranks_input(tmp_path):
    """ASTRA-sim's ring all-gather sends ``comm_size`` at every step and ends with
    ``comm_size x group size`` (Ring.cc: final_data_size = data_size * nodes_in_ring): the
    sequence-parallel gather of the layer input carries one rank's shard, b x s/tp x h x 2."""
    plan = ParallelPlan(dp=1, tp=2, sequence_parallel=True)
    write_trace_set(tiny_cfg(plan), tmp_path)
    assert check_trace_dir(tmp_path) == []
    _, nodes = decode(tmp_path / "trace.0.et")
    sizes = {
        kind: {attrs(n)["comm_size"] for n in nodes if attrs(n).get("comm_type") == kind}
        for kind in (pb.ALL_GATHER, pb.REDUCE_SCATTER)
    }
    shard = 1 * (128 // 2) * 256 * 2
    assert sizes[pb.ALL_GATHER] == {shard}
    # reduce-scatters name their full input buffer
    assert sizes[pb.REDUCE_SCATTER] == {2 * shard}


def test_every_comp_node_is_timeable_by_a_roofline_simulator(tmp_path):
    write_trace_set(tiny_cfg(ParallelPlan(dp=2, tp=2, pp=2)), tmp_path)
    _, nodes = decode(tmp_path / "trace.0.et")
    comps = [attrs(n) for n in nodes if n.type == pb.COMP_NODE]
    assert all(c["num_ops"] > 0 and c["tensor_size"] > 0 for c in comps)
    # the embedding lookup does no arithmetic: one operation, timed by its bytes
    _, first = decode(tmp_path / "trace.0.et")
    assert attrs(first[0])["num_ops"] == 1 and first[0].name == "word_embedding"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_ops", 0, "COMP node needs num_ops > 0"),
        ("tensor_size", 0, "COMP node needs num_ops > 0 and tensor_size > 0"),
        ("comm_size", 0, "collective of 0 bytes"),
    ],
)
def test_checker_rejects_what_a_simulator_cannot_time(tmp_path, field, value, message):
    write_trace_set(tiny_cfg(ParallelPlan(dp=2, tp=2, pp=2)), tmp_path)
    path = tmp_path / "trace.0.et"
    meta, nodes = decode(path)
    for n in nodes:
        hit = [a for a in n.attr if a.name == field]
        if hit:
            kind = hit[0].WhichOneof("value")
            setattr(hit[0], kind, value)
            break
    rewrite(path, meta, nodes)
    problems = check_trace_dir(tmp_path)
    assert any(message in p for p in problems), problems


def test_checker_rejects_all_gathers_sized_as_their_output(tmp_path):
    """A writer that puts the gathered buffer in ``comm_size`` (what ASTRA-sim would send at
    every ring step) is caught: every all-gather of rank 0 made group-size times larger."""
    plan = ParallelPlan(dp=2, tp=2, sequence_parallel=True)
    write_trace_set(tiny_cfg(plan), tmp_path)
    path = tmp_path / "trace.0.et"
    meta, nodes = decode(path)
    for n in nodes:
        a = {x.name: x for x in n.attr}
        if n.type == pb.COMM_COLL_NODE and a["comm_type"].int64_val == pb.ALL_GATHER:
            a["comm_size"].int64_val *= 2
    rewrite(path, meta, nodes)
    problems = check_trace_dir(tmp_path)
    assert any("rank 0: all-gathers leave" in p and "each rank's input" in p for p in problems)
    assert not any(p.startswith("rank 1:") for p in problems)


def test_check_and_json_of_missing_paths_are_one_line_errors(tmp_path, capsys):
    assert trace_main(["check", str(tmp_path / "nope")]) == 2
    assert trace_main(["json", str(tmp_path / "nope.0.et")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert err[0].startswith("stage-dse-trace: error: ") and "not a trace set" in err[0]
    assert "no trace file" in err[1]


@pytest.mark.parametrize("top", [0, -1])
def test_select_top_must_be_positive(small_results, top):
    with pytest.raises(ConfigError, match=f"--top must be >= 1, got {top}"):
        select_and_write(small_results, top=top, log=lambda s: None)


def test_select_refuses_above_max_bytes_before_writing(small_results):
    lines = []
    with pytest.raises(ConfigError, match="above --max-bytes"):
        select_and_write(small_results, top=50, max_bytes=10_000, log=lines.append)
    assert not (small_results / "_traces").exists()
    assert "50 trace sets selected, about" in lines[0]
    df = load(small_results)
    ok = df[df.status == "ok"].sort_values("step_s").head(3)
    estimate = sum(estimate_trace_bytes(r) for _, r in ok.iterrows())
    written = select_and_write(small_results, top=3, log=lambda s: None)
    actual = sum(
        f.stat().st_size for h in written for f in (small_results / "_traces" / h).glob("*.et")
    )
    assert actual / 2 < estimate < actual * 2  # the estimate is within 2x


def test_interrupted_select_keeps_finished_sets_and_removes_the_partial_one(
    small_results, monkeypatch
):
    import stage_dse.trace.select as trace_select

    real = trace_select.write_trace_set
    calls = []

    def interrupted(cfg, out, **kw):
        calls.append(out)
        if len(calls) == 2:
            Path(out).mkdir(parents=True)
            (Path(out) / "trace.0.et").write_bytes(b"partial")
            raise KeyboardInterrupt
        return real(cfg, out, **kw)

    monkeypatch.setattr(trace_select, "write_trace_set", interrupted)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        select_and_write(small_results, top=3, log=lines.append)
    df = load(small_results)
    marked = df[df["trace_dir"].notna()]
    assert len(marked) == 1 and marked["trace_replay_s"].notna().all()
    assert Path(calls[0]).is_dir() and not Path(calls[1]).exists()
    assert "interrupted: 1 trace sets written and recorded" in lines[-1]


def test_select_by_run_id(small_results):
    df = load(small_results)
    (run_id,) = set(df["run_id"].astype(str))
    assert f"-{os.getpid()}-" in run_id
    assert select_and_write(small_results, top=1, run="latest", log=lambda s: None)
    with pytest.raises(ConfigError, match="--run 'nope': no rows of that run"):
        select_and_write(small_results, top=1, run="nope", log=lambda s: None)


def test_trace_config_takes_options_before_or_after_the_overrides(tmp_path, capsys):
    common = ["workload=serving", "model=llama3_8b", "serving.tp=[2]", "serving.pp=[1]",
              "serving.batch_size=[2]", "serving.prompt_len=[128]"]  # fmt: skip
    after = tmp_path / "after"
    assert trace_main(["config", str(after), *common, "--steps", "2"]) == 0
    before = tmp_path / "before"
    assert trace_main(["config", str(before), "--steps", "2", *common]) == 0
    a = json.loads((after / "manifest.json").read_text())
    b = json.loads((before / "manifest.json").read_text())
    assert a["decode_steps"] == b["decode_steps"] == 2
    assert a["plan"] == b["plan"] and a["serving"] == b["serving"]
    assert sorted(p.name for p in after.iterdir()) == sorted(p.name for p in before.iterdir())
    capsys.readouterr()
    assert trace_main(["config", str(tmp_path / "x"), *common, "--stpes", "2"]) == 2
    assert "unrecognized arguments: --stpes" in capsys.readouterr().err


# ---------------------------------------------------------------------------- bad trace inputs
CONFIG_TRAINING = ["model=llama3_8b", "num_gpus=[8]", "plan.tp=[2]", "plan.pp=[2]",
                   "plan.micro_batch_size=[1]", "plan.zero_stage=[1]", "plan.recompute=[full]",
                   "plan.sequence_parallel=[true]",
                   "training.global_batch_size=8", "training.seq_len=1024"]  # fmt: skip
CONFIG_SERVING = ["workload=serving", "model=llama3_8b", "serving.tp=[2]", "serving.pp=[1]",
                  "serving.batch_size=[2]", "serving.prompt_len=[128]"]  # fmt: skip


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stage-dse-trace: error: "), err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize("overrides", [CONFIG_TRAINING, CONFIG_SERVING], ids=["train", "serve"])
def test_trace_config_refuses_a_set_above_max_bytes(tmp_path, capsys, overrides):
    out = tmp_path / "t"
    assert trace_main(["config", str(out), *overrides, "--max-bytes", "10K"]) == 2
    line = _one_error_line(capsys)
    assert "above --max-bytes" in line and "raise --max-bytes" in line
    assert not out.exists()
    assert trace_main(["config", str(out), *overrides, "--max-bytes", "1G"]) == 0
    assert "1 trace set selected, about" in capsys.readouterr().out
    assert (out / "manifest.json").is_file()


@pytest.mark.parametrize("value", ["-1", "0"])
def test_trace_config_steps_must_be_positive(tmp_path, capsys, value):
    assert trace_main(["config", str(tmp_path / "t"), *CONFIG_SERVING, "--steps", value]) == 2
    assert f"--steps {value}: give the number of decode steps" in _one_error_line(capsys)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("value", ["-5", "0", "lots", "inf", "nanG"])
def test_max_bytes_must_be_a_positive_size(value):
    with pytest.raises(ConfigError, match="--max-bytes"):
        parse_bytes(value)


@pytest.mark.parametrize("text,expected", [("2G", 2**31), ("500M", 500 * 2**20), ("1.5KiB", 1536)])
def test_max_bytes_units(text, expected):
    assert parse_bytes(text) == expected


def _corrupt(good: Path, dest: Path, how: str) -> Path:
    import shutil

    shutil.copytree(good, dest)
    f = dest / "trace.0.et"
    data = f.read_bytes()
    if how == "truncated":
        f.write_bytes(data[:-7])
    elif how == "cut at a node":
        meta, nodes = decode(f)
        rewrite(f, meta, nodes[:-2])
    elif how == "garbled":
        f.write_bytes(data[:20] + bytes(b ^ 0xA5 for b in data[20:60]) + data[60:])
    elif how == "empty":
        f.write_bytes(b"")
    elif how == "missing rank":
        (dest / "trace.3.et").unlink()
    elif how == "stray file":
        (dest / "trace.x.et").write_bytes(data)
    return dest


@pytest.mark.parametrize(
    "how", ["truncated", "cut at a node", "garbled", "empty", "missing rank", "stray file"]
)
def test_replay_of_a_corrupted_set_is_one_line(good_set, tmp_path, capsys, how):
    bad = _corrupt(good_set, tmp_path / "bad", how)
    assert trace_main(["replay", str(bad)]) == 2
    line = _one_error_line(capsys)
    assert "replay_step_s" not in capsys.readouterr().out
    word = {"missing rank": "missing", "stray file": "not a rank file"}.get(how, "")
    assert word in line and ("write the set again" in line or how == "stray file")
    with pytest.raises(ConfigError):
        from stage_dse.trace.replay import replay_trace_dir

        replay_trace_dir(bad, all_ranks=True)


def test_check_of_a_garbled_file_is_one_line(good_set, tmp_path, capsys):
    bad = _corrupt(good_set, tmp_path / "bad", "garbled")
    assert trace_main(["check", str(bad)]) == 2
    assert "trace.0.et: not a readable trace file" in _one_error_line(capsys)
