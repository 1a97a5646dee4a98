r"""BERT on one GPU: the defaults, each lever alone and all together, timed
one at a time, in one call of about 7 minutes.

    python -m benchmarks.gpu.check --output_dir OUT --levers          # a GPU host
    python -m benchmarks.gpu.check --output_dir OUT --levers --tiny   # the same, small, on a CPU

Each run is `run_pretraining.py`'s job (`benchmarks/gpu/lever_worker.py`):
sequence 128, 20 predictions, LAMB, mixed_bfloat16, global batch 256
(`--batch`), records in Google's format, `--timed_steps_per_log=0` (every
timed step inside a call: the part-by-part steps of the default would
cost their own ms), calls of up to 1,000 steps bounded at the default 2 s.
Runs start in waves of `--parallel` (their tracing, compilation and XLA's
autotuning overlap, with one autotune cache shared); once every run of a
wave is past its warm-up, each is timed alone (the others waiting at the
gate, nothing compiling), then leaves. The levers (`LEVERS`):

    default      the job's defaults
    launch4      --steps_per_launch=4: 4 steps in one XLA program
    dropout16    --dropout_bits=16: masks from 16 random bits an element
    cublaslt     XLA's cuBLASLt GEMMs with their bias/GELU epilogues
                 (--xla_gpu_enable_cublaslt=true; off by default)
    no_merger    XLA's dot merger off (--xla_gpu_dot_merger_threshold_mb=0;
                 32 by default): no concatenated dq/dk/dv for merged GEMMs
    no_graphs    CUDA graphs off (--xla_gpu_enable_command_buffer=): what
                 updating them at each launch costs or saves
    all          launch4 + dropout16 + cublaslt + no_merger

BERT-base runs every lever; BERT-large the defaults and `all`. The call
after BERT-base `all`'s timing (all levers: the run expected fastest) is
profiled (CUDA graphs kept on in the profile:
--xla_enable_command_buffers_during_profiling=true) and summed per step as
GPU idle and kernel time by kind (`xplane_top.step_summary`).
A share of peak counts `launch.gpu_check.figures.flops_per_sequence` (6 x the
non-embedding parameters' multiply-adds x 128 tokens plus the attention's
matmuls: 67.0 GFLOP a BERT-base sequence, 236.8 BERT-large) against 989
TFLOP/s of dense bf16 (an H100 SXM's and an H200's). Writes levers.json
and levers.md in --output_dir.
"""

import glob
import json
import os
import sys
import time

from benchmarks import harness
from benchmarks.harness import BERT_BASE, Job

# name -> (run_pretraining flags, XLA flags)
LEVERS = {
    "default": ([], []),
    "launch4": (["--steps_per_launch=4"], []),
    "dropout16": (["--dropout_bits=16"], []),
    "cublaslt": ([], ["--xla_gpu_enable_cublaslt=true"]),
    "no_merger": ([], ["--xla_gpu_dot_merger_threshold_mb=0"]),
    "no_graphs": ([], ["--xla_gpu_enable_command_buffer="]),
    "all": (["--steps_per_launch=4", "--dropout_bits=16"],
            ["--xla_gpu_enable_cublaslt=true",
             "--xla_gpu_dot_merger_threshold_mb=0"]),
}
PROFILE_FLAG = "--xla_enable_command_buffers_during_profiling=true"


def model_configs(args, out: str) -> dict:
    """{"base": path, "large": path} (BERT-tiny-sized with --tiny)."""
    base = json.load(open(BERT_BASE))
    large = dict(base, hidden_size=1024, num_hidden_layers=24,
                 num_attention_heads=16, intermediate_size=4096)
    if args.tiny:
        base.update(hidden_size=128, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=512)
        large = dict(base, num_hidden_layers=4)
    paths = {}
    for name, config in (("base", base), ("large", large)):
        paths[name] = os.path.join(out, f"levers_bert_{name}.json")
        json.dump(config, open(paths[name], "w"))
    return paths


def worker_job(args, out: str, gates: str, model: str, lever: str,
               config: str, profile: bool) -> Job:
    run_flags, xla = LEVERS[lever]
    name = f"{model}-{lever}"
    xla = [*xla, "--xla_gpu_per_fusion_autotune_cache_dir="
           + os.path.join(out, "xla_autotune"),
           *([PROFILE_FLAG] if profile else [])]
    command = [
        sys.executable, "-m", "benchmarks.gpu.lever_worker",
        f"--gate_dir={gates}", f"--run_name={name}",
        f"--gate_after_steps={args.warmup_steps}",
        f"--timed_steps={args.timed_steps}",
        *(["--profile"] if profile else []), "--",
        f"--input_file={args.records}/bert-*.tfrecord",
        f"--output_dir={os.path.join(out, 'levers', name)}",
        f"--bert_config_file={config}", "--max_seq_length=128",
        "--max_predictions_per_seq=20", f"--train_batch_size={args.batch}",
        "--optimizer=lamb", "--learning_rate=1e-4",
        "--num_train_steps=1000000", "--num_warmup_steps=100",
        "--iterations_per_loop=1000", "--timed_steps_per_log=0",
        "--save_checkpoints_steps=0", *args.precision, *run_flags]
    env = {"TF_FORCE_GPU_ALLOW_GROWTH": "true",
           "XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""), *xla])}
    return Job(name, command, out, env)


def run_waves(parallel: int) -> list:
    """The runs, (model, lever) each once, in waves of at most `parallel`
    (BERT-base's levers, then BERT-large's two runs together)."""
    base = [("base", lever) for lever in LEVERS]
    large = [("large", "default"), ("large", "all")]
    return [base[i:i + parallel]
            for i in range(0, len(base), parallel)] + [large]


def run_wave(jobs, gates: str, timeout: float) -> dict:
    """Starts `jobs`, waits until each is at its gate (or ended), then
    opens the gates one at a time. {name: result or the exit}."""
    path = lambda job, ending: os.path.join(gates, job.name + ending)  # noqa: E731
    for job in jobs:
        for ending in (".ready", ".go", ".json", ".done"):
            if os.path.exists(path(job, ending)):  # (a run before this one)
                os.remove(path(job, ending))
        job.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
            job.running() and not os.path.exists(path(job, ".ready"))
            for job in jobs):
        time.sleep(0.2)
    results = {}
    for job in jobs:
        if os.path.exists(path(job, ".ready")) and job.running():
            open(path(job, ".go"), "w").close()
            job.wait(max(1.0, deadline - time.monotonic()))
        else:
            job.wait(1.0)
        if os.path.exists(path(job, ".json")):
            results[job.name] = json.load(open(path(job, ".json")))
        else:
            results[job.name] = {"exit_code": job.code,
                                 "tail": job.text()[-1500:]}
    return results


def profile_summary(folder: str, steps: int) -> dict:
    from benchmarks.gpu import xplane_top
    planes = xplane_top.profile_planes(folder)
    return {plane.name: {k: round(v, 3) for k, v in
                         xplane_top.step_summary(plane, steps).items()}
            for plane in planes}


def main(args, out: str) -> int:
    from launch.gpu_check.figures import PEAK_TFLOPS, flops_per_sequence
    from input_pipelines.synthetic_bert import write_records
    PEAK_BF16_TFLOPS = PEAK_TFLOPS["H100"]  # the H200's is the same
    # (--tiny: XLA forced on the CPU, where its default is off, so the
    # step is one program as on a GPU.)
    args.precision = (["--xla"] if args.tiny
                      else ["--precision=mixed_bfloat16"])
    args.batch = 16 if args.tiny else args.lever_batch
    args.warmup_steps, args.timed_steps = ((24, 24) if args.tiny else
                                           (args.warmup_steps,
                                            args.timed_steps))
    if not glob.glob(os.path.join(args.records, "bert-*.tfrecord")):
        os.makedirs(args.records, exist_ok=True)
        write_records(args.records, 4096, 4)
    configs = model_configs(args, out)
    gates = os.path.join(out, "gates")
    os.makedirs(gates, exist_ok=True)
    waves = run_waves(args.parallel)
    plan = [run for wave in waves for run in wave]
    results = {}
    for wave in waves:
        jobs = [worker_job(args, out, gates, model, lever, configs[model],
                           profile=(model, lever) == ("base", "all"))
                for model, lever in wave]
        results.update(run_wave(jobs, gates, args.timeout))
    rows = {}
    for (model, lever) in plan:
        row = results.get(f"{model}-{lever}", {})
        config = json.load(open(configs[model]))
        rate = row.get("examples_per_second")
        if rate:
            flops = flops_per_sequence(config)
            row.update(step_ms=round(args.batch * 1000 / rate, 2),
                       gflop_per_sequence=round(flops / 1e9, 1),
                       share_of_peak=round(rate * flops
                                           / (PEAK_BF16_TFLOPS * 1e12), 4))
            base = results.get(f"{model}-default", {}).get(
                "examples_per_second")
            if base:
                row["speedup"] = round(rate / base, 3)
        rows[f"{model}-{lever}"] = row
    profiled = results.get("base-all", {})
    summary = {"rows": rows}
    if profiled.get("profiled_steps"):
        summary["profile"] = profile_summary(
            os.path.join(gates, "base-all-profile"),
            profiled["profiled_steps"])
    with open(os.path.join(out, "levers.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = ["# BERT on one GPU: the levers" + (" (--tiny, CPU)" if args.tiny
                                                 else ""), "",
             harness.table(
                 ["run", "examples/s", "step (ms)", "share of peak",
                  "speedup", "the step"],
                 [[name, f"failed (exit {row.get('exit_code')})", "", "", "",
                   ""] if "examples_per_second" not in row else
                  [name, f"{row['examples_per_second']:.1f}",
                   f"{row['step_ms']:.1f}", f"{row['share_of_peak']:.1%}",
                   f"{row.get('speedup', float('nan')):.3f}",
                   row.get("step_layout", "")]
                  for name, row in rows.items()], align="lrrrrl")]
    for plane, values in summary.get("profile", {}).items():
        lines += ["", f"Profile of base-all, {plane}, per step "
                  f"({profiled['profiled_steps']} steps): " + ", ".join(
                      f"{k} {v:.2f} ms" for k, v in values.items())]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out, "levers.md"), "w") as f:
        f.write(table)
    print(table)
    return 0
