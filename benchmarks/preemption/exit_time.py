r"""How long a finished job's workers take to leave after their last line.

    python -m benchmarks.preemption.exit_time --runs 20 --output_dir runs/exit_time

Runs a short real job (`run_pretraining.py`, BERT-tiny, 2 workers through
`launch.local`, records made by the writer) `--runs` times and, for each,
times the gap between the last line any worker printed and the launcher's
exit (every worker gone). In TF 2.21 a worker could sit tens of seconds
there while Python's exit waited for a tf.data iterator's deletion; the
entry points now leave with `os._exit` once everything is flushed
(`tfscale.cli.leave`). Output: report.md and results.json in --output_dir.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import harness


def one_run(pattern: str, directory: str, run: int, steps: int) -> dict:
    out = os.path.join(directory, f"run-{run}")
    command = harness.on_workers(2, [
               sys.executable, "run_pretraining.py", f"--input_file={pattern}",
               f"--output_dir={out}",
               f"--bert_config_file={directory}/corpus/bert_config.json",
               "--max_seq_length=64", "--max_predictions_per_seq=10",
               "--train_batch_size=32", f"--num_train_steps={steps}",
               "--num_warmup_steps=2", f"--save_checkpoints_steps={steps}",
               "--log_steps=5", "--do_eval", "--max_eval_steps=2"])
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, cwd=harness.REPO,
                            stderr=subprocess.STDOUT, text=True)
    last = start
    for _ in proc.stdout:
        last = time.monotonic()
    code = proc.wait()
    end = time.monotonic()
    return {"run": run, "exit_code": code, "wall_seconds": end - start,
            "after_last_line_seconds": end - last}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20,
                        help="jobs run, each timed from its last line to the "
                             "launcher's exit")
    parser.add_argument("--steps", type=int, default=10,
                        help="steps of each job")
    parser.add_argument("--output_dir", default="runs/exit_time",
                        help="folder for report.md and results.json")
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    pattern = harness.demo_records(os.path.abspath(args.output_dir))
    results = []
    for run in range(args.runs):
        results.append(one_run(pattern, os.path.abspath(args.output_dir), run,
                               args.steps))
        print(json.dumps(results[-1]), flush=True)
    gaps = [r["after_last_line_seconds"] for r in results]
    lines = [f"# Exit time: {args.runs} runs of 2 workers, {args.steps} steps "
             "+ eval", "",
             f"- exit codes: {sorted({r['exit_code'] for r in results})}",
             f"- seconds from the last line to the launcher's exit: median "
             f"{statistics.median(gaps):.2f}, max {max(gaps):.2f}, runs over "
             f"5 s: {sum(g > 5 for g in gaps)}",
             f"- wall seconds per run: median "
             f"{statistics.median(r['wall_seconds'] for r in results):.1f}"]
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.output_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
