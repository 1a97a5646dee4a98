r"""How often deleting a tf.data iterator stalls, with autotune on and off.

    python -m benchmarks.pipelines.iterator_deletion --runs 6 \
        --output_dir runs/iterator_deletion

TensorFlow 2.21 sometimes blocks the thread that deletes a `tf.data`
iterator for tens of seconds when tf.data's autotune is on. In a
multi-worker job the other workers wait for that worker in their next
collective, which is why the Trainer deletes finished iterators on a
background thread (`tfscale/step/feed.py`). This reproduces the stall
without the Trainer: `--runs` runs of 2 workers through launch.local for
each autotune setting (see `iterator_deletion_worker.py`), each timing the
deletion of its iterator on the main thread. Run it after a TensorFlow
upgrade to see whether the workaround is still needed.

Output: report.md and results.json in --output_dir.
"""

import argparse
import glob
import json
import os
import sys

from benchmarks import harness
from benchmarks.pipelines.image_pipeline import make_records

STALL_SECONDS = 1.0  # a deletion slower than this counts as a stall


def one_run(records: str, autotune: int, run: int, out_dir: str,
            args) -> list:
    """Deletion seconds of each worker in one 2-worker run."""
    result = os.path.join(out_dir, f"run-autotune{autotune}-{run}.json")
    for stale in glob.glob(result + ".*"):
        os.remove(stale)
    harness.run(harness.on_workers(2, harness.python(
        "benchmarks.pipelines.iterator_deletion_worker", "--records", records,
        "--autotune", autotune, "--steps", args.steps,
        "--busy_seconds", args.busy_seconds,
        "--checkpoint_dir", os.path.join(out_dir, "checkpoints"),
        "--result_file", result)), timeout=args.timeout,
        what=f"autotune={autotune} run {run}")
    seconds = []
    for path in sorted(glob.glob(result + ".*")):
        with open(path) as f:
            seconds.append(json.load(f)["delete_seconds"])
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=6,
                        help="runs per autotune setting")
    parser.add_argument("--steps", type=int, default=40,
                        help="steps each worker trains")
    parser.add_argument("--busy_seconds", type=float, default=1.0,
                        help="CPU work per step on each worker")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds before a run is held to hang")
    parser.add_argument("--output_dir", default="runs/iterator_deletion",
                        help="folder for report.md and results.json")
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    records = make_records(args.output_dir, num_classes=10, per_class=8)
    results = {}
    # Interleaved, so both settings see the same machine.
    for run in range(args.runs):
        for autotune in (1, 0):
            seconds = one_run(records, autotune, run, args.output_dir, args)
            results.setdefault(autotune, []).append(seconds)
            print(f"autotune={autotune} run {run}: deletion "
                  + ", ".join(f"{s:.3f}" for s in seconds) + " s",
                  flush=True)
    command = " ".join(["python -m benchmarks.pipelines.iterator_deletion",
                        *sys.argv[1:]])
    lines = ["# Deleting a tf.data iterator: stalls with autotune on and off",
             "", f"`{command}`: 2 workers, {args.steps} steps, "
             f"{args.busy_seconds} s of CPU work per step, {args.runs} runs "
             "per setting, interleaved.", "",
             harness.table(
                 ["autotune", "runs with a stall (> 1 s on any worker)",
                  "longest deletion (s)"],
                 (["on" if autotune else "off",
                   f"{sum(max(r) > STALL_SECONDS for r in results[autotune])}"
                   f" of {len(results[autotune])}",
                   f"{max(max(r) for r in results[autotune]):.2f}"]
                  for autotune in (1, 0)))]
    report = "\n".join(lines) + "\n"
    with open(os.path.join(args.output_dir, "report.md"), "w") as f:
        f.write(report)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"on" if k else "off": v for k, v in results.items()}, f,
                  indent=2)
    print(report)


if __name__ == "__main__":
    main()
