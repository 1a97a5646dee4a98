r"""The multi-worker GPU step on a real GPU, in one call of about 6 minutes.

    python -m benchmarks.gpu_check --output_dir OUT          # on a GPU host
    python -m benchmarks.gpu_check --output_dir OUT --tiny   # the same, small, on a CPU
    python -m benchmarks.gpu_check --output_dir OUT --levers # BERT on one GPU: benchmarks/gpu_levers.py

BERT-base (sequence 128, 20 predictions, LAMB, mixed_bfloat16; BERT-tiny
and float32 with `--tiny`) through `run_pretraining.py`:

1. Placement and one global batch (`--batch`), concurrently on the one GPU
   (memory growth; nothing here is timed): 1 worker; 2 gRPC workers
   sharing the GPU (`launch.local --share_gpus`, `--all_reduce_alg=ring`:
   NCCL refuses two ranks on one GPU); 2 MPI ranks sharing it; all with
   `--deterministic --seed=7` and no dropout (its masks differ with the
   replica count), `--iterations_per_loop=1000` (Google's default: one
   call runs up to 1,000 steps, bounded at 2 s). Each run's checkpoint
   against the 1 worker's (the CPU tests' check: the same records per
   global batch, the same weights within float summation order), and
   each run's placement line (where its replicas and variables are).
2. Beside them, SIGTERM to worker 1 of a third 2-worker gRPC run once its
   first periodic checkpoint is written: the seconds to the complete
   preemption checkpoint and to the exit (143); then (alone) the rerun,
   which resumes and must end bit-identical to the uninterrupted 2-worker
   run.
3. Alone, timed: 1 worker with dropout, `--deterministic` against not, at
   the same batch: examples/s over the steady intervals and the ratio
   (the goal: at most 1.5x the time).

Writes results.json and table.md in --output_dir, and each run's log.
"""

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

from benchmarks.harness import REPO, Job, compare, weights

PEAK_BF16_TFLOPS = 989.0  # H100 SXM dense bf16; the H200 has the same


def flops_per_sequence(config: dict, seq: int = 128) -> float:
    """Training FLOPs of one sequence: 6 x the non-embedding parameters'
    multiply-adds per token x `seq` tokens, plus the attention's score
    and context matmuls (forward and backward)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    inner = config["intermediate_size"]
    per_layer = 4 * hidden * hidden + 2 * hidden * inner
    dense = 6 * layers * per_layer * seq
    attention = 3 * 2 * 2 * layers * seq * seq * hidden
    return dense + attention


def job_command(args, run_dir: str, steps: int, config: str, extra=()) -> list:
    return [sys.executable, "run_pretraining.py",
            f"--input_file={args.records}/bert-*.tfrecord",
            f"--output_dir={run_dir}", f"--bert_config_file={config}",
            "--max_seq_length=128", "--max_predictions_per_seq=20",
            f"--train_batch_size={args.batch}", "--optimizer=lamb",
            "--learning_rate=1e-4", f"--num_train_steps={steps}",
            "--num_warmup_steps=10", *args.precision, *extra]


def launched(workers: int, command, backend: str = "mwms") -> list:
    """`command` as `workers` workers sharing the host's GPUs."""
    mpi = ["--backend", "mpi"] if backend == "mpi" else []
    return [sys.executable, "-m", "launch.local", "--num_workers",
            str(workers), "--share_gpus", *mpi, "--", *command,
            f"--backend={backend}",
            *(["--all_reduce_alg=ring"] if backend == "mwms" else [])]


def make_configs(args, out: str) -> dict:
    """{"base": BERT-base (BERT-tiny with --tiny), "still": it without
    dropout} config files."""
    base = json.load(open(os.path.join(REPO, "benchmarks", "bert_base.json")))
    if args.tiny:
        base.update(hidden_size=128, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=512)
    still = dict(base, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)
    paths = {}
    for name, config in (("base", base), ("still", still)):
        paths[name] = os.path.join(out, f"bert_{name}.json")
        json.dump(config, open(paths[name], "w"))
    return paths


def make_records(args) -> None:
    if not glob.glob(os.path.join(args.records, "bert-*.tfrecord")):
        os.makedirs(args.records, exist_ok=True)
        subprocess.run([sys.executable, "-c",
                        "from benchmarks.input_pipeline import write_records;"
                        f"write_records({args.records!r}, 4096, 4)"],
                       cwd=REPO, check=True)


def wait_for_line(job: Job, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while job.running() and time.monotonic() < deadline:
        if text in job.text():
            return True
        time.sleep(0.2)
    return False


def first_line_time(job: Job, text: str, since: float, timeout: float):
    """Seconds from `since` (time.monotonic()) until `text` is in the log,
    or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in job.text():
            return time.monotonic() - since
        if not job.running():
            return (time.monotonic() - since) if text in job.text() else None
        time.sleep(0.05)
    return None


def row_of(job: Job) -> dict:
    row = {"exit_code": job.code, "seconds": round(job.seconds or 0, 1),
           "placement": job.placement()}
    found = job.intervals()
    if found:
        row["last_loss"] = found[max(found)][0]
    return row


def multi_worker(args, out: str) -> dict:
    configs = make_configs(args, out)
    make_records(args)
    gpu_env = {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    steps = args.steps
    same = ["--deterministic", "--seed=7", "--iterations_per_loop=1000",
            f"--save_checkpoints_steps={args.save_steps}"]
    runs = {
        "1 worker": Job("w1", job_command(
            args, os.path.join(out, "w1"), steps, configs["still"], same),
            out, gpu_env),
        "2 workers, gRPC": Job("grpc2", launched(2, job_command(
            args, os.path.join(out, "grpc2"), steps, configs["still"], same)),
            out, gpu_env),
        "2 MPI ranks": Job("mpi2", launched(2, job_command(
            args, os.path.join(out, "mpi2"), steps, configs["still"], same),
            "mpi"), out, gpu_env),
    }
    sig_dir = os.path.join(out, "sigterm")
    sig_command = launched(2, job_command(args, sig_dir, steps,
                                          configs["still"], same))
    sig = Job("sigterm", sig_command, out, gpu_env)
    for job in (*runs.values(), sig):
        job.start()
    # 2. SIGTERM to worker 1 once the first periodic checkpoint is saved.
    preempt = {"signalled_after": f"ckpt-{args.save_steps}"}
    if wait_for_line(sig, f"ckpt-{args.save_steps}", args.timeout):
        sent = time.monotonic()
        preempt["signalled"] = sig.signal_worker(1, signal.SIGTERM)
        preempt["signal_to_complete_seconds"] = first_line_time(
            sig, "preemption checkpoint complete:", sent, args.timeout)
        sig.wait(args.timeout)
        preempt["signal_to_exit_seconds"] = round(time.monotonic() - sent, 2)
    else:
        sig.wait(args.timeout)
    preempt["exit_code"] = sig.code
    for job in runs.values():
        job.wait(args.timeout)
    results = {}
    reference = (weights(os.path.join(out, "w1"))
                 if runs["1 worker"].code == 0 else None)
    for name, job in runs.items():
        row = row_of(job)
        run_dir = os.path.join(out, job.name)
        if job.code == 0 and reference is not None:
            row.update(compare(reference, weights(run_dir)))
        results[name] = row
        print(json.dumps({name: row}), flush=True)
    # The rerun resumes and must end where the uninterrupted run ended.
    rerun = Job("sigterm-rerun", sig_command, out, gpu_env).start()
    rerun.wait(args.timeout)
    preempt["rerun_exit_code"] = rerun.code
    preempt["placement"] = sig.placement()
    if rerun.code == 0 and runs["2 workers, gRPC"].code == 0:
        preempt.update(compare(weights(os.path.join(out, "grpc2")),
                               weights(sig_dir)))
    results["SIGTERM to worker 1, resumed"] = preempt
    print(json.dumps({"sigterm": preempt}), flush=True)
    # 3. Alone, timed: --deterministic against not.
    timed = {}
    for name, extra in (("without --deterministic", []),
                        ("--deterministic", ["--deterministic"])):
        run_dir = os.path.join(out, "timed" + ("-det" if extra else ""))
        job = Job(os.path.basename(run_dir), job_command(
            args, run_dir, args.timed_steps, configs["base"],
            [*extra, f"--iterations_per_loop={args.log_steps}"]), out)
        job.start().wait(args.timeout)
        row = row_of(job)
        steady = [v for s, v in sorted(job.intervals().items())
                  if s > args.log_steps]
        if steady:
            rate = sum(v[1] for v in steady) / len(steady)
            row.update(examples_per_second=round(rate, 1),
                       step_ms=round(args.batch * 1000 / rate, 2))
        timed[name] = row
        results[f"1 worker, {name}"] = row
        print(json.dumps({name: row}), flush=True)
    rates = [timed[n].get("examples_per_second") for n in timed]
    if all(rates):
        results["deterministic step / step"] = round(rates[0] / rates[1], 3)
    return results


def write_table(out: str, results: dict, title: str) -> str:
    lines = [f"# {title}", "", "| check | result |", "|---|---|"]
    for name, row in results.items():
        if isinstance(row, dict):
            lines.append(f"| {name} | " + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in row.items()) + " |")
        elif name != "tiny":
            lines.append(f"| {name} | {row} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return table


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--tiny", action="store_true",
                        help="BERT-tiny, float32 and few steps (a CPU try "
                             "of the script)")
    parser.add_argument("--levers", action="store_true",
                        help="BERT on one GPU instead: "
                             "benchmarks/gpu_levers.py's run")
    parser.add_argument("--batch", type=int, default=64,
                        help="global batch of every run (default: 64)")
    parser.add_argument("--steps", type=int, default=120,
                        help="steps of the 1-vs-2-worker runs")
    parser.add_argument("--save_steps", type=int, default=20,
                        help="their checkpoint interval (the SIGTERM goes "
                             "after the first)")
    parser.add_argument("--timed_steps", type=int, default=300,
                        help="steps of each timed run (--levers: steps "
                             "timed)")
    parser.add_argument("--log_steps", type=int, default=50,
                        help="the timed runs' log interval")
    parser.add_argument("--lever_batch", type=int, default=256,
                        help="--levers: the global batch (default: 256)")
    parser.add_argument("--parallel", type=int, default=4,
                        help="--levers: runs compiling at once (default: 4)")
    parser.add_argument("--warmup_steps", type=int, default=60,
                        help="--levers: steps before a run is timed")
    parser.add_argument("--records", default=None)
    parser.add_argument("--timeout", type=float, default=420)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    args.records = args.records or os.path.join(out, "records")
    if args.levers:
        from benchmarks import gpu_levers
        return gpu_levers.main(args, out)
    args.precision = [] if args.tiny else ["--precision=mixed_bfloat16"]
    if args.tiny:
        args.batch, args.steps, args.save_steps = 16, 24, 8
        args.timed_steps, args.log_steps = 24, 8
    results = {"tiny": args.tiny, **multi_worker(args, out)}
    print(write_table(out, results, "The multi-worker GPU step"
                      + (" (--tiny, CPU)" if args.tiny else "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
