r"""BERT-large on one GPU, and the multi-worker GPU step on a real GPU, in
one call of about 10 minutes.

    python -m benchmarks.gpu_check --output_dir OUT          # on a GPU host
    python -m benchmarks.gpu_check --output_dir OUT --tiny   # the same, small, on a CPU

1. BERT-large (sequence 128, 20 predictions: the phase-1 shape) through
   run_pretraining.py with the default flags at `--large_batch`: examples/s
   over the steady interval and the share of the GPU's bf16 peak, counting
   6 x the non-embedding parameters x 128 tokens plus the attention's
   12 x layers x 128^2 x hidden multiply-adds (forward and backward) a
   sequence; BERT-base beside it.
2. The multi-worker GPU step: BERT-base at one global batch and
   `--deterministic` on 1 worker, on 2 workers sharing the GPU over gRPC
   (`launch.local --share_gpus`, `--all_reduce_alg=ring`: NCCL refuses two
   ranks on one GPU) and on 2 MPI ranks sharing it; each run's last
   interval loss and its checkpoint against the 1-worker run's (the CPU
   tests' check: the same records per global batch, the same weights
   within float summation order).
3. SIGTERM to worker 1 of the 2-worker gRPC run once it passes
   `--signal_step`: the job must save and exit 143; its rerun resumes and
   must end bit-identical to the uninterrupted 2-worker run.

Writes results.json and table.md in --output_dir (and each run's log).
"""

import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERVAL = re.compile(r"step (\d+): loss ([\d.]+), ([\d.]+) examples/s, step "
                      r"([\d.]+) ms")
PEAK_BF16_TFLOPS = 989.0  # H100 SXM dense bf16; the H200 has the same


def flops_per_sequence(config: dict, seq: int = 128) -> float:
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    inner = config["intermediate_size"]
    per_layer = 4 * hidden * hidden + 2 * hidden * inner
    dense = 6 * layers * per_layer * seq
    attention = 3 * 2 * 2 * layers * seq * seq * hidden
    return dense + attention


def job(args, out_dir: str, steps: int, batch: int, config: str,
        extra=()) -> list:
    return [sys.executable, "run_pretraining.py",
            f"--input_file={args.records}/bert-*.tfrecord",
            f"--output_dir={out_dir}", f"--bert_config_file={config}",
            "--max_seq_length=128", "--max_predictions_per_seq=20",
            f"--train_batch_size={batch}", "--optimizer=lamb",
            "--learning_rate=1e-4", f"--num_train_steps={steps}",
            "--num_warmup_steps=10", f"--iterations_per_loop={args.loop}",
            f"--save_checkpoints_steps={steps}", *args.precision, *extra]


def launched(workers: int, command, backend: str = "mwms") -> list:
    mpi = ["--backend", "mpi"] if backend == "mpi" else []
    return [sys.executable, "-m", "launch.local", "--num_workers",
            str(workers), "--share_gpus", *mpi, "--", *command,
            f"--backend={backend}",
            *(["--all_reduce_alg=ring"] if backend == "mwms" else [])]


def run(command, log: str, timeout: float) -> tuple:
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            code = subprocess.run(command, cwd=REPO, stdout=f,
                                  stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return code, time.monotonic() - start


def intervals(log: str) -> dict:
    text = open(log, errors="replace").read()
    return {int(m[0]): (float(m[1]), float(m[2]), float(m[3]))
            for m in INTERVAL.findall(text)}


def weights(out_dir: str) -> dict:
    import tensorflow as tf
    path = tf.train.latest_checkpoint(os.path.join(out_dir, "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in
            reader.get_variable_to_dtype_map() if k.startswith("model/")
            and reader.get_variable_to_dtype_map()[k] != tf.string}


def compare(a: dict, b: dict) -> dict:
    worst = max(float(np.max(np.abs(a[k] - b[k])) /
                      (float(np.max(np.abs(a[k]))) + 1e-12)) for k in a)
    same = all(np.array_equal(a[k], b[k]) for k in a)
    return {"max_relative_difference": worst, "bit_identical": same}


def signalled_run(command, log: str, out_dir: str, step: int,
                  timeout: float) -> dict:
    """The 2-worker run, SIGTERM to worker 1 after step `step`."""
    with open(log, "w") as f:
        proc = subprocess.Popen(command, cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        sent = None
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            if sent is None and any(s >= step for s in intervals(log)):
                for pid in _pids(out_dir):
                    if b"TFSCALE_WORKER_INDEX=1" in open(
                            f"/proc/{pid}/environ", "rb").read():
                        os.kill(pid, signal.SIGTERM)
                        sent = time.monotonic()
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
    text = open(log, errors="replace").read()
    saved = re.search(r"preempted: checkpoint at step (\d+) saved", text)
    return {"exit_code": code, "saved_step": int(saved.group(1))
            if saved else None,
            "signal_to_exit_seconds": (time.monotonic() - sent)
            if sent else None}


def _pids(marker: str) -> list:
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if marker.encode() in command and b"launch.local" not in command:
            found.append(int(pid))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--tiny", action="store_true",
                        help="BERT-tiny-sized configs and few steps (a CPU "
                        "try of the script)")
    parser.add_argument("--large_batch", type=int, default=128)
    parser.add_argument("--base_batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=120,
                        help="steps of the BERT-large and -base runs")
    parser.add_argument("--worker_steps", type=int, default=60)
    parser.add_argument("--signal_step", type=int, default=20)
    parser.add_argument("--records", default=None)
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    configs = {"large": os.path.join(out, "bert_large.json"),
               "base": os.path.join(REPO, "benchmarks", "bert_base.json")}
    large = json.load(open(configs["base"]))
    large.update(hidden_size=1024, num_hidden_layers=24,
                 num_attention_heads=16, intermediate_size=4096)
    if args.tiny:
        large.update(hidden_size=128, num_hidden_layers=4,
                     num_attention_heads=2, intermediate_size=512)
        base = dict(large, num_hidden_layers=2)
        configs["base"] = os.path.join(out, "bert_tiny.json")
        json.dump(base, open(configs["base"], "w"))
        args.large_batch, args.base_batch = 16, 16
        args.steps, args.worker_steps, args.signal_step = 24, 24, 8
    json.dump(large, open(configs["large"], "w"))
    # 1 worker against 2 at one global batch: no dropout (its masks differ
    # with the replica count), as in the CPU tests.
    still = dict(json.load(open(configs["base"])), hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)
    configs["still"] = os.path.join(out, "bert_base_no_dropout.json")
    json.dump(still, open(configs["still"], "w"))
    args.loop = max(4, args.steps // 4)
    args.precision = ([] if args.tiny else ["--precision=mixed_bfloat16"])
    args.records = args.records or os.path.join(out, "records")
    if not glob.glob(os.path.join(args.records, "bert-*.tfrecord")):
        os.makedirs(args.records, exist_ok=True)
        subprocess.run([sys.executable, "-c",
                        "from benchmarks.input_pipeline import write_records;"
                        f"write_records({args.records!r}, 4096, 4)"],
                       cwd=REPO, check=True)
    results = {"tiny": args.tiny}
    # 1. BERT-large and -base on one GPU, the default flags.
    for name, batch in (("large", args.large_batch),
                        ("base", args.base_batch)):
        run_dir = os.path.join(out, f"one-{name}")
        code, seconds = run(job(args, run_dir, args.steps, batch,
                                configs[name]),
                            os.path.join(out, f"one-{name}.log"),
                            args.timeout)
        found = intervals(os.path.join(out, f"one-{name}.log"))
        steady = [v for s, v in sorted(found.items()) if s > args.loop]
        config = json.load(open(configs[name]))
        row = {"exit_code": code, "seconds": seconds, "batch": batch,
               "gflop_per_sequence": flops_per_sequence(config) / 1e9}
        if steady:
            rate = steady[-1][1]
            row.update(examples_per_second=rate, step_ms=steady[-1][2],
                       share_of_peak=rate * flops_per_sequence(config)
                       / (PEAK_BF16_TFLOPS * 1e12))
        results[f"bert_{name}"] = row
        print(json.dumps({name: row}), flush=True)
    # 2. One global batch on 1 worker, 2 gRPC workers, 2 MPI ranks.
    steps, batch = args.worker_steps, args.base_batch
    flags = ["--deterministic", "--seed=7", f"--iterations_per_loop={args.loop}"]
    single = os.path.join(out, "w1")
    runs = {"1 worker": (run(job(args, single, steps, batch, configs["still"],
                                 flags), single + ".log", args.timeout),
                         single)}
    for name, backend in (("2 workers, gRPC", "mwms"),
                          ("2 MPI ranks", "mpi")):
        run_dir = os.path.join(out, backend)
        runs[name] = (run(launched(2, job(args, run_dir, steps, batch,
                                          configs["still"], flags), backend),
                          run_dir + ".log", args.timeout), run_dir)
    reference = weights(single) if runs["1 worker"][0][0] == 0 else None
    for name, ((code, seconds), run_dir) in runs.items():
        row = {"exit_code": code, "seconds": seconds}
        found = intervals(run_dir + ".log")
        if found:
            row["last_loss"] = found[max(found)][0]
        if code == 0 and reference is not None:
            row.update(compare(reference, weights(run_dir)))
        results[name] = row
        print(json.dumps({name: row}), flush=True)
    # 3. SIGTERM to worker 1, then the rerun.
    run_dir = os.path.join(out, "preempted")
    command = launched(2, job(args, run_dir, steps, batch, configs["still"],
                              flags), "mwms")
    row = signalled_run(command, run_dir + "-1.log", run_dir,
                        args.signal_step, args.timeout)
    code, seconds = run(command, run_dir + "-2.log", args.timeout)
    row["rerun_exit_code"] = code
    if code == 0 and runs["2 workers, gRPC"][0][0] == 0:
        row.update(compare(weights(runs["2 workers, gRPC"][1]),
                           weights(run_dir)))
    results["sigterm"] = row
    print(json.dumps({"sigterm": row}), flush=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["| check | result |", "|---|---|"]
    for name, row in results.items():
        if isinstance(row, dict):
            lines.append(f"| {name} | " + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in row.items()) + " |")
    open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
