"""Chakra traces of serving: a number of decode steps of one configuration.

Every rank of a pipeline stage runs, per decode step: receive the previous stage's activation
(stage > 0), its layers' forward (tensor-parallel collectives included, KV cache reads and
writes as part of the attention and cache-write kernels), send to the next stage; the last
stage samples and sends the new tokens back to the first stage for the next step. Files,
groups and checks are those of training traces (:mod:`stage_dse.trace.write`).
"""

from __future__ import annotations

import json
from pathlib import Path

from stage_dse import __version__
from stage_dse.cost.bind import bind, bind_hardware
from stage_dse.cost.serving import serving_key
from stage_dse.graph.ir import Phase
from stage_dse.graph.transformer import build_serving_graphs
from stage_dse.spec import ClusterSpec, HardwareSpec, ModelSpec, ParallelPlan
from stage_dse.spec.serving import ServingSpec
from stage_dse.trace.mesh import Mesh
from stage_dse.trace.program import (
    Program,
    StageTemplate,
    consumed_ops,
    emit_ops,
    op_numbers,
    symbol_subs,
)
from stage_dse.trace.schedule import stage_sections
from stage_dse.trace.write import TraceSet, group_id_warnings, set_counts, write_all_ranks

__all__ = ["write_serving_trace"]


class _Cfg:
    """What the program builder reads of a trace configuration."""

    granularity = "segment"

    def __init__(self, plan: ParallelPlan) -> None:
        self.plan = plan


def write_serving_trace(
    model: ModelSpec,
    serving: ServingSpec,
    plan: ParallelPlan,
    hardware: HardwareSpec,
    cluster: ClusterSpec,
    out: str | Path,
    steps: int = 4,
    prefix: str = "trace",
) -> TraceSet:
    from stage_dse.trace.check import check_templates

    key = serving_key(model, serving, plan)
    graphs = build_serving_graphs(key.graph, "decode", key.kv_bytes)
    like = serving.step_like(hardware, replicas=plan.dp)
    values = {
        **bind(model, like, plan.replace(micro_batch_size=serving.batch_size)),
        **bind_hardware(hardware, cluster.replace(num_gpus=max(plan.num_gpus, 1))),
        "seq": 1,
        "context": serving.decode_context,
        "prompt": serving.prompt_len,
        "output_tokens": serving.output_tokens,
    }
    ops = [op for g in graphs.sections for op in g.ops if op.phase is Phase.FORWARD]
    cfg = _Cfg(plan)
    numbers = op_numbers(cfg, ops, values)
    consumed = {g: consumed_ops(g) for g in graphs.sections}
    subs = symbol_subs(values)

    def sections_of(s: int) -> list:
        return stage_sections(graphs, model, s, plan.pp, 1, plan.stage_layers)[0]

    boundary = int(graphs.boundary.local_bytes.xreplace(subs))
    token_bytes = serving.batch_size * 8
    pp = plan.pp
    templates = []
    for s in range(pp):
        prog = Program(cfg, numbers)
        sections = sections_of(s)
        fwd = {g: [op for op in g.ops if op.phase is Phase.FORWARD] for g, _ in sections}
        for step in range(steps):
            if s == 0 and step > 0 and pp > 1:
                prog.p2p(False, pp - 1, token_bytes, 2 * step + 1, f"recv_tokens:step{step}")
            if s > 0:
                prog.p2p(False, -1, boundary, 2 * step, f"recv_activation:step{step}")
            for g, count in sections:
                for _ in range(count):
                    emit_ops(prog, fwd[g], consumed[g])
            prog.flush()
            if s < pp - 1:
                prog.p2p(True, +1, boundary, 2 * step, f"send_activation:step{step}")
            elif pp > 1 and step < steps - 1:
                prog.p2p(
                    True, -(pp - 1), token_bytes, 2 * (step + 1) + 1, f"send_tokens:step{step}"
                )
        templates.append(
            StageTemplate(
                stage=s, pieces=prog.pieces, nodes=prog.counts, flops=prog.flops, kinds=prog.kinds
            )
        )
    mesh = Mesh(plan)
    mesh.register(set().union(*(t.kinds for t in templates)))
    problems = check_templates(templates, mesh)
    assert not problems, problems
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comm_groups.json").write_text(json.dumps(mesh.groups_json()))
    total, files, _, _ = write_all_ranks(out, prefix, mesh, templates)
    ranks_per_stage = mesh.world // pp
    # flops of the forward ops by direct substitution (not the lambdified per-op numbers)
    flops_expected = 0.0
    for s in range(pp):
        for g, count in sections_of(s):
            f = sum(
                float(op.flops.xreplace(subs))
                for op in g.ops
                if op.phase is Phase.FORWARD and not op.is_comm
            )
            flops_expected += count * f * steps * ranks_per_stage
    warnings = group_id_warnings(mesh)
    manifest = {
        "stage_dse_version": __version__,
        "workload": "serving (decode)",
        "model": model.name,
        "plan": {"tp": plan.tp, "pp": plan.pp, "ep": plan.ep, "dp": plan.dp},
        "serving": {
            "prompt_len": serving.prompt_len,
            "output_tokens": serving.output_tokens,
            "batch_size": serving.batch_size,
            "decode_context": serving.decode_context,
        },
        "decode_steps": steps,
        "hardware": hardware.name,
        **set_counts(mesh, templates, prefix, files, total),
        "analytic_flops_total": round(flops_expected),
        "send_recv_tags": "2 * step: activations; 2 * step + 1: sampled tokens (last to first)",
        "warnings": warnings,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return TraceSet(
        out, mesh.world, total, files, manifest["nodes_per_stage"], mesh.num_group_ids, warnings
    )
