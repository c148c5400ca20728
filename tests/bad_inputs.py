"""Bad inputs through the console scripts: each must exit 2 with one line naming the field.

Run: ``python tests/bad_inputs.py`` (prints one line per case and a summary; exit 1 if any case
fails). ``tests/test_bad_inputs.py`` runs it under pytest. Every case runs in a fresh process,
as a user would, with the results folder in a temporary directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _serving_record(**fields) -> str:
    """A corpus file of one static serving record with ``fields`` set."""
    lines = [
        "source: {id: bad_source, citation: a test, url: 'https://example.org', kind: serving}",
        "runs:",
        "- {id: bad_fraction, where: t, model: llama3_8b, hardware: h100_sxm, cluster: dgx_h100,",
        "   n_gpus: 1, tp: 1, weights: bf16, isl: 128, osl: 128, mode: static, batch: 1,",
        "   target: {kind: tpot_ms, value: 10.0},",
        "   " + ", ".join(f"{k}: {v}" for k, v in fields.items()) + "}",
    ]
    return "\n".join(lines) + "\n"


# (console script, arguments, text the one line must contain[, files to write first: path
# under the case's folder -> text])
CASES: list[tuple] = [
    ("stage-dse", ["model=nope"], "model"),
    ("stage-dse", ["hardware=nope"], "hardware"),
    ("stage-dse", ["cluster=nope"], "cluster"),
    ("stage-dse", ["num_gpus=[-8]"], "num_gpus"),
    ("stage-dse", ["num_gpus=[0]"], "num_gpus"),
    ("stage-dse", ["num_gpus=[eight]"], "num_gpus"),
    ("stage-dse", ["num_gpus=[100000000]"], "num_gpus"),
    ("stage-dse", ["num_gpus=[4611686018427387904]"], "num_gpus"),
    ("stage-dse", ["training.seq_len=0"], "seq_len"),
    ("stage-dse", ["training.seq_len=1000000000"], "seq_len"),
    ("stage-dse", ["training.global_batch_size=-1"], "global_batch"),
    ("stage-dse", ["training.gemm_dtype=fp4"], "gemm_dtype"),
    ("stage-dse", ["training.gemm_dtype=fp8", "hardware=a100_80gb"], "fp8"),
    ("stage-dse", ["training.gemm_dtype=nvfp4"], "gemm_dtype=nvfp4 needs FP4 tensor cores"),
    ("stage-dse", ["training.fp8_recipe=rowwise"], "fp8_recipe=rowwise"),
    ("stage-dse", ["training.gemm_dtype=fp8", "training.fp8_recipe=blocks"], "fp8_recipe"),
    ("stage-dse", ["training.gemm_dtype=fp8", "training.fp8_recipe=mxfp8"], "mxfp8"),
    ("stage-dse", ["plan.tp=[3]"], "tp"),
    ("stage-dse", ["plan.micro_batch_size=[0]"], "micro_batch"),
    ("stage-dse", ["plan.zero_stage=[5]"], "zero_stage"),
    ("stage-dse", ["plan.shard_group=[-8]"], "shard_group"),
    ("stage-dse", ["plan.shard_group=[eight]"], "shard_group"),
    ("stage-dse", ["plan.cuda_graphs=[attn+bogus]"], "cuda_graphs"),
    ("stage-dse", ["plan.cuda_graphs=[full_iteration+attn]"], "cuda_graphs"),
    ("stage-dse", ["plan.recompute=[sometimes]"], "recompute"),
    ("stage-dse", ["plan.recompute=[selective:attention]"], "unknown module 'attention'"),
    ("stage-dse", ["plan.recompute=[full:some]"], "takes a layer count"),
    ("stage-dse", ["model=llama3_8b", "plan.recompute=[selective:mla_up_proj]"], "mla_up_proj"),
    ("stage-dse", ["plan.attention=[magic]"], "attention"),
    ("stage-dse", ["plan.virtual_stages=[0]"], "virtual_stages"),
    ("stage-dse", ["plan.stage_layers=[abc]"], "stage_layers"),
    ("stage-dse", ["plan.rank_order=[tp-dp]"], "rank_order"),
    ("stage-dse", ["plan.ep=[2]"], "ep"),
    ("stage-dse", ["plan.framework=[nope]"], "plan.framework"),
    ("stage-dse", ["plan.framework=[nemo,nemo]"], "plan.framework"),
    ("stage-dse", ["plan.framework=[7]"], "plan.framework"),
    ("stage-dse", ["plan.tp_comm_overlap=sometimes"], "tp_comm_overlap"),
    ("stage-dse", ["training.grads_dtype=fp8"], "grads_dtype"),
    ("stage-dse", ["runner=nope"], "runner"),
    ("stage-dse", ["runner.batch_size=0"], "batch_size"),
    ("stage-dse", ["runner.kind=slurm"], "runner.kind"),
    ("stage-dse", ["search=nope"], "search"),
    ("stage-dse", ["search=optuna", "search.n_trials=0"], "n_trials"),
    ("stage-dse", ["search=optuna", "search.sampler=annealing"], "sampler"),
    ("stage-dse", ["search=optuna", "search.objectives=[speed]"], "objectives"),
    ("stage-dse", ["mode=fast"], "mode"),
    ("stage-dse", ["timing=silicon"], "timing"),
    ("stage-dse", ["workload=serving", "serving.mode=batchy"], "serving.mode"),
    ("stage-dse", ["workload=serving", "serving.acceptance=1.5"], "serving.acceptance"),
    ("stage-dse", ["workload=serving", "serving.prefill_budget=[0]"], "serving.prefill_budget"),
    ("stage-dse", ["workload=serving", "serving.sla.tpot_ms=-5"], "serving.sla.tpot_ms"),
    ("stage-dse", ["mode=recommend"], "serving.sla"),
    ("stage-dse", ["timing=measured", "hardware.measured_gpu=tpu_v5"], "measured_gpu"),
    ("stage-dse-validate", ["timing=silicon"], "timing"),
    ("stage-dse", ["workload=inference"], "workload"),
    ("stage-dse", ["hardware.hbm_gib=-80"], "hbm_gib"),
    ("stage-dse", ["cluster.inter_gbit_s=0"], "inter"),
    ("stage-dse", ["cluster.gpus_per_node=0"], "gpus_per_node"),
    ("stage-dse", ["sweep_name=a/../../escaped"], "sweep_name"),
    ("stage-dse", ["+sweep=nope"], "sweep"),
    ("stage-dse", ["no_such_key=1"], "no_such_key"),
    ("stage-dse", ["workload=serving", "serving.batch_size=[0]"], "batch_size"),
    ("stage-dse", ["workload=serving", "serving.tp=[3]"], "tp"),
    ("stage-dse", ["workload=serving", "serving.kv_dtype=fp4"], "kv_dtype"),
    ("stage-dse", ["workload=serving", "serving.ep=[2]"], "ep"),
    ("stage-dse", ["workload=serving", "serving.prompt_len=[-1]"], "prompt_len"),
    ("stage-dse", ["runner.address=127.0.0.1:1"], "runner.address=127.0.0.1:1"),
    ("stage-dse", ["runner.address=ray://127.0.0.1:1"], "runner.address=ray://127.0.0.1:1"),
    ("stage-dse", ["runner.address=headnode"], "runner.address"),
    ("stage-dse", ["runner=ray", "runner.address=auto"], "runner.address=auto"),
    ("stage-dse", ["runner.connect_timeout_s=0"], "runner.connect_timeout_s"),
    ("stage-dse", ["top_k=0"], "top_k"),
    ("stage-dse", ["top_k=-1"], "top_k"),
    ("stage-dse", ["workload=serving", "top_k=0"], "top_k"),
    ("stage-dse", ["hardware.peak_bf16_tflops=inf"], "hardware.peak_bf16_tflops"),
    ("stage-dse", ["hardware.hbm_gib=inf"], "hardware.hbm_gib"),
    ("stage-dse", ["hardware.hbm_tb_s=inf"], "hardware.hbm_tb_s"),
    ("stage-dse", ["hardware.hbm_tb_s=nan"], "hardware.hbm_tb_s"),
    ("stage-dse", ["hardware.kernel_launch_us=nan"], "hardware.kernel_launch_us"),
    ("stage-dse", ["cluster.inter_gbit_s=inf"], "cluster.inter_gbit_s"),
    ("stage-dse", ["cluster.intra_gb_s=inf"], "cluster.intra_gb_s"),
    ("stage-dse", ["workload=serving", "hardware.peak_bf16_tflops=inf"], "peak_bf16_tflops"),
    ("stage-dse", ["sweep_name=../outside"], "sweep_name"),
    ("stage-dse", ["results_dir="], "results_dir"),
    ("stage-dse", ["results_dir=/etc/passwd/results"], "results_dir"),
    ("stage-dse", ["num_gpus=64,128"], "num_gpus=[64,128]"),
    ("stage-dse", ["-m", "num_gpus=16,0"], "num_gpus"),
    ("stage-dse", ["num_gpus=16", "-m", "model=llama3_8b,nope"], "model"),
    ("stage-dse", ["--config-dir", "{tmp}/nope"], "--config-dir"),
    ("stage-dse", ["-cd"], "-cd"),
    ("stage-dse", ["--config-name", "nope"], "--config-name"),
    (
        "stage-dse",
        ["--config-dir", "{tmp}/conf", "model=broken"],
        "broken.yaml:3:",
        {"conf/model/broken.yaml": "name: broken\nhidden_size: [1\n"},
    ),
    (
        "stage-dse",
        ["--config-dir", "{tmp}/conf", "model=half"],
        "model.hidden_size",
        {"conf/model/half.yaml": "name: half\nnum_layers: 2\n"},
    ),
    (
        "stage-dse",
        ["-m", "--config-dir", "{tmp}/conf", "model=half,llama3_8b"],
        "model.hidden_size",
        {"conf/model/half.yaml": "name: half\nnum_layers: 2\n"},
    ),
    ("stage-dse-trace", ["check", "{tmp}/missing"], "missing"),
    ("stage-dse-trace", ["replay", "{tmp}/missing"], "missing"),
    ("stage-dse-trace", ["json", "{tmp}/missing.et"], "missing.et"),
    ("stage-dse-trace", ["select", "{tmp}/missing"], "missing"),
    ("stage-dse-trace", ["config", "{tmp}/t", "plan.tp=[1,2]"], "plan.tp"),
    (
        "stage-dse-trace",
        ["config", "{tmp}/t", "plan.framework=[nemo,megatron_core]"],
        "plan.framework",
    ),
    ("stage-dse-trace", ["config", "{tmp}/t", "num_gpus=[8,16]"], "num_gpus"),
    (
        "stage-dse-trace",
        [
            "config",
            "{tmp}/t",
            "workload=serving",
            "serving.tp=1",
            "serving.batch_size=[1]",
            "serving.prompt_len=[128]",
            "serving.phase=middle",
        ],
        "serving.phase",
    ),
    ("stage-dse-plot", ["{tmp}/missing"], "missing"),
    ("stage-dse-validate", ["--hardware", "nope"], "--hardware"),
    ("stage-dse-validate", ["--kind", "inference"], "--kind"),
    ("stage-dse-validate", ["--source", "nope"], "--source nope"),
    ("stage-dse-validate", ["--group", "nope/iter_s"], "--group nope/iter_s"),
    ("stage-dse-validate", ["--out", "{tmp}/cases.csv"], "--out"),
    ("stage-dse-validate", ["--corpus", "{tmp}/missing"], "--corpus"),
    ("stage-dse-validate", ["--record", "--kind", "training"], "--record"),
    ("stage-dse", ["hardware.measured_efficiency=0"], "hardware.measured_efficiency"),
    ("stage-dse", ["hardware.measured_efficiency=1.5"], "hardware.measured_efficiency"),
    ("stage-dse", ["search=optuna", "search.batch_size=0"], "search.batch_size"),
    ("stage-dse", ["workload=serving", "serving.engine=nope"], "engine"),
    ("stage-dse", ["workload=serving", "serving.burst=-3"], "serving.burst"),
    ("stage-dse", ["workload=serving", "serving.clients=2.5"], "serving.clients"),
    (
        "stage-dse-validate",
        ["--corpus", "{tmp}/fraction.yaml"],
        "kv_memory_fraction",
        {"fraction.yaml": _serving_record(kv_memory_fraction="high")},
    ),
    (
        "stage-dse-validate",
        ["--corpus", "{tmp}/fraction.yaml"],
        "run bad_fraction: kv_memory_fraction=1.5",
        {"fraction.yaml": _serving_record(kv_memory_fraction=1.5)},
    ),
    (
        "stage-dse-validate",
        ["--corpus", "{tmp}/command.yaml"],
        "run bad_fraction: kv_memory_fraction must be in (0, 1], got 95",
        {
            "command.yaml": _serving_record(
                engine="vllm", details="{command: 'vllm serve m --gpu-memory-utilization 95'}"
            )
        },
    ),
]


def run_case(
    script: str, args: list[str], needle: str, tmp: str, files: dict | None = None
) -> str | None:
    """None when the case behaves, else what went wrong."""
    for rel, text in (files or {}).items():
        (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
        (Path(tmp) / rel).write_text(text)
    argv = [script, *(a.format(tmp=tmp) for a in args)]
    if script == "stage-dse":
        if not any(a.startswith("results_dir=") for a in args):
            argv += [f"results_dir={tmp}/results"]
        if not any(a.startswith("runner") for a in args):
            argv += ["runner=local", "runner.progress=false"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # RAY_TMPDIR: no `ray start` address file of this machine is seen
    env.update(PYTHONWARNINGS="ignore", HYDRA_FULL_ERROR="0", RAY_TMPDIR=tmp)
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, env=env, timeout=300)
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    if proc.returncode != 2:
        return f"exit {proc.returncode}"
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    if len(err) != 1:
        return f"{len(err)} lines on stderr: {' | '.join(err[:4])[:300]}"
    if needle not in err[0]:
        return f"line does not name {needle!r}: {err[0][:300]}"
    _ = lines
    return None


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        with ThreadPoolExecutor(max_workers=2) as pool:
            for i, (script, args, needle, *files) in enumerate(CASES):
                case_tmp = Path(tmp) / str(i)
                case_tmp.mkdir()
                job = pool.submit(run_case, script, args, needle, str(case_tmp), *files)
                jobs.append(job)
        failures = 0
        for (script, args, *_), job in zip(CASES, jobs):
            problem = job.result()
            failures += problem is not None
            print(f"{'FAIL' if problem else 'ok  '} {script} {' '.join(args)}: {problem or ''}")
        print(f"{len(CASES) - failures} of {len(CASES)} bad inputs give one line naming the field")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
