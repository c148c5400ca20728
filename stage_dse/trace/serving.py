"""Chakra traces of serving: the prefill of one batch, or a number of decode steps.

Every rank of a pipeline stage runs, per pass: receive the previous stage's activation
(stage > 0), its layers' forward (tensor-parallel collectives included, KV cache reads and
writes as part of the attention and cache-write kernels), send to the next stage; in decode the
last stage samples and sends the new tokens back to the first stage for the next step. Prefill
is one pass over the prompt (``seq = context = prompt``), decode one token per sequence against
the mean cache length, as the serving cost model (:mod:`stage_dse.cost.serving`) times them;
the manifest records that model's time for the same passes (``cost_step_s``: the time to first
token, or decode steps x time per output token). Files, groups and checks are those of
training traces (:mod:`stage_dse.trace.write`).
"""

from __future__ import annotations

import json
from pathlib import Path

import sympy as sp

from stage_dse import __version__
from stage_dse.cost.bind import bind, bind_hardware
from stage_dse.cost.serving import serving_key, serving_program
from stage_dse.cost.time import collective_time
from stage_dse.errors import ConfigError
from stage_dse.graph.ir import CollKind, Phase
from stage_dse.graph.transformer import build_serving_graphs
from stage_dse.spec import ClusterSpec, HardwareSpec, MeshAxis, ModelSpec, ParallelPlan
from stage_dse.spec.serving import ServingSpec
from stage_dse.trace.mesh import Mesh
from stage_dse.trace.program import (
    Program,
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
    phase: str = "decode",
) -> TraceSet:
    from stage_dse.trace.check import check_templates

    if phase not in ("decode", "prefill"):
        raise ConfigError(f"serving.phase must be decode or prefill, got {phase!r}")
    if steps < 1:
        raise ConfigError(f"steps (decode steps to write) must be >= 1, got {steps}")
    if phase == "prefill":
        steps = 1  # one pass over the prompts of the batch
    key = serving_key(model, serving, plan)
    graphs = build_serving_graphs(key.graph, phase, key.kv_bytes)
    like = serving.step_like(hardware, replicas=plan.dp)
    values = {
        **bind(model, like, plan.replace(micro_batch_size=serving.batch_size)),
        **bind_hardware(hardware.serving(), cluster.replace(num_gpus=max(plan.num_gpus, 1))),
        "seq": serving.prompt_len if phase == "prefill" else 1,
        "context": serving.prompt_len if phase == "prefill" else serving.decode_context,
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

    def hop(size: int) -> int:
        t = collective_time(CollKind.SEND_RECV, {MeshAxis.PP}, sp.Integer(size), plan.rank_order)
        return max(1, round(float(sp.sympify(t).xreplace(subs)) * 1e6))

    hop_act, hop_tok = hop(boundary), hop(token_bytes)
    pp = plan.pp
    templates = []
    for s in range(pp):
        prog = Program(cfg, numbers)
        sections = sections_of(s)
        fwd = {g: [op for op in g.ops if op.phase is Phase.FORWARD] for g, _ in sections}
        for step in range(steps):
            if s == 0 and step > 0 and pp > 1:
                name = f"recv_tokens:step{step}"
                prog.p2p(False, pp - 1, token_bytes, 2 * step + 1, name, hop_tok)
            if s > 0:
                prog.p2p(False, -1, boundary, 2 * step, f"recv_activation:step{step}", hop_act)
            for g, count in sections:
                for _ in range(count):
                    emit_ops(prog, fwd[g], consumed[g])
            prog.flush()
            if s < pp - 1:
                prog.p2p(True, +1, boundary, 2 * step, f"send_activation:step{step}", hop_act)
            elif pp > 1 and step < steps - 1:
                name = f"send_tokens:step{step}"
                prog.p2p(True, -(pp - 1), token_bytes, 2 * (step + 1) + 1, name, hop_tok)
        templates.append(prog.template(s))
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
    outputs = serving_program(key)
    pass_s = outputs["serve_ttft_s" if phase == "prefill" else "serve_tpot_s"]
    cost_s = float(sp.sympify(pass_s).xreplace(subs)) * steps
    manifest = {
        "stage_dse_version": __version__,
        "workload": f"serving ({phase})",
        "phase": phase,
        "model": model.name,
        "plan": {"tp": plan.tp, "pp": plan.pp, "ep": plan.ep, "dp": plan.dp},
        "serving": {
            "prompt_len": serving.prompt_len,
            "output_tokens": serving.output_tokens,
            "batch_size": serving.batch_size,
            "decode_context": serving.decode_context,
        },
        "decode_steps": steps if phase == "decode" else 0,
        "cost_step_s": cost_s,
        "pp_stride": mesh.stride[MeshAxis.PP],
        "hardware": hardware.name,
        **set_counts(mesh, templates, prefix, files, total),
        "analytic_flops_total": round(flops_expected),
        "send_recv_tags": "2 * step: activations; 2 * step + 1: sampled tokens (last to first)",
        "pass_time": "the cost model's time of the same passes, without the token send-back",
        "warnings": warnings,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return TraceSet(
        out, mesh.world, total, files, manifest["nodes_per_stage"], mesh.num_group_ids, warnings
    )
