r"""MLPerf Training results as planning/published.json holds them.

    git clone https://github.com/mlcommons/training_results_v3.0
    python -m benchmarks.mlperf_rows training_results_v3.0 \
        --submitters NVIDIA,NVIDIA_CoreWeave --systems h100 --benchmarks bert,resnet

Reads each result folder's MLLOG lines (`result_N.txt`: run_start,
run_stop and its status, global_batch_size, the last evaluation's
epoch_num) and prints one JSON row per folder: GPUs, global batch, MLPerf's
score in minutes (the runs sorted by time, a run that did not converge
counted as the slowest; the fastest and the slowest dropped; the mean of
the rest, as the results tables compute it) and the examples those runs
saw on average (the last evaluation's epoch_num: BERT counts it in
samples; ResNet in epochs of 1,281,167 images).
"""

import argparse
import glob
import json
import os
import re
import statistics

IMAGENET_TRAIN_IMAGES = 1_281_167


def read_run(path: str, benchmark: str) -> dict:
    """One result file's start, stop, status, batch and examples."""
    run = {}
    with open(path, errors="replace") as f:
        for line in f:
            if ":::MLLOG" not in line:
                continue
            entry = json.loads(line.split(":::MLLOG", 1)[1])
            key, meta = entry["key"], entry.get("metadata") or {}
            if key in ("run_start", "run_stop") and key not in run:
                run[key] = entry["time_ms"]
                if key == "run_stop":
                    run["converged"] = meta.get("status") == "success"
            elif key in ("global_batch_size", "submission_platform"):
                run[key] = entry["value"]
            elif key == "eval_accuracy":
                run["last_eval"] = meta.get("epoch_num")
    run["minutes"] = (run["run_stop"] - run["run_start"]) / 60000
    run["examples"] = run["last_eval"] * (
        IMAGENET_TRAIN_IMAGES if benchmark == "resnet" else 1)
    return run


def score(runs: list) -> tuple:
    """(MLPerf's minutes, the mean examples of the runs it averages)."""
    ordered = sorted(runs, key=lambda r: (not r["converged"], r["minutes"]))
    kept = ordered[1:-1]
    return (statistics.mean(r["minutes"] for r in kept),
            statistics.mean(r["examples"] for r in kept))


def gpus_of(platform: str) -> int:
    """GPUs of an MLLOG platform such as '64xNVIDIA DGX H100' (8 a node)."""
    nodes = re.match(r"(\d+)x", platform)
    return 8 * (int(nodes.group(1)) if nodes else 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout")
    parser.add_argument("--submitters", default="NVIDIA,NVIDIA_CoreWeave",
                        help="submitter folders read, comma-separated")
    parser.add_argument("--systems", default="h100",
                        help="a word the result folder's name holds")
    parser.add_argument("--benchmarks", default="bert,resnet",
                        help="benchmarks read, comma-separated")
    args = parser.parse_args()
    for submitter in args.submitters.split(","):
        for benchmark in args.benchmarks.split(","):
            pattern = os.path.join(args.checkout, submitter, "results",
                                   f"*{args.systems}*", benchmark)
            for folder in sorted(glob.glob(pattern)):
                runs = [read_run(p, benchmark) for p in sorted(
                    glob.glob(os.path.join(folder, "result_*.txt")))]
                minutes, examples = score(runs)
                print(json.dumps({
                    "benchmark": benchmark,
                    "gpus": gpus_of(runs[0]["submission_platform"]),
                    "global_batch": runs[0]["global_batch_size"],
                    "minutes": round(minutes, 4),
                    "examples": round(examples),
                    "runs": len(runs),
                    "converged": sum(r["converged"] for r in runs),
                    "folder": os.path.relpath(folder, args.checkout)}))


if __name__ == "__main__":
    main()
