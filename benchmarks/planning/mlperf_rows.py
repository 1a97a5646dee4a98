r"""MLPerf Training results as planning/published.json holds them.

    git clone https://github.com/mlcommons/training_results_v3.0
    python -m benchmarks.planning.mlperf_rows training_results_v3.0 \
        --submitters NVIDIA,NVIDIA_CoreWeave --systems h100 --benchmarks bert,resnet

Reads each result folder's MLLOG lines (`result_N.txt`: run_start,
run_stop and its status, global_batch_size, the last evaluation's
epoch_num) and prints one JSON row per folder: GPUs, global batch, MLPerf's
score in minutes (the runs sorted by time, a run that did not converge
counted as the slowest; the fastest and the slowest dropped; the mean of
the rest, as the results tables compute it), the minutes of the runs it
averages (`kept_minutes`: their largest distance from the score is the
result's run-to-run spread) and the examples those runs saw on average
(the last evaluation's epoch_num: BERT counts it in samples; ResNet in
epochs of 1,281,167 images).

`--spreads` prints instead one line per benchmark: every result's
run-to-run spread (each submitter, each system; a result re-listed in a
later round counted once), the figures published.json's
`mlperf_run_spreads` holds and tfscale-plan's default band rests on.
"""

import argparse
import glob
import json
import os
import re
import statistics

IMAGENET_TRAIN_IMAGES = 1_281_167


def read_run(path: str, benchmark: str) -> dict:
    """One result file's start, stop, status, batch and examples.

    Raises:
        ValueError: The file has no run_start or run_stop (a run cut off).
    """
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
    if "run_start" not in run or "run_stop" not in run:
        raise ValueError(f"{path}: no run_start or run_stop line")
    run["minutes"] = (run["run_stop"] - run["run_start"]) / 60000
    run["examples"] = (run.get("last_eval") or 0) * (
        IMAGENET_TRAIN_IMAGES if benchmark == "resnet" else 1)
    return run


def kept(runs: list) -> list:
    """The runs MLPerf's score averages: sorted by time (a run that did
    not converge counted as the slowest), the fastest and slowest
    dropped."""
    ordered = sorted(runs, key=lambda r: (not r["converged"], r["minutes"]))
    return ordered[1:-1]


def score(runs: list) -> tuple:
    """(MLPerf's minutes, the mean examples of the runs it averages)."""
    rest = kept(runs)
    return (statistics.mean(r["minutes"] for r in rest),
            statistics.mean(r["examples"] for r in rest))


def spread(minutes: list) -> float:
    """The largest relative distance of a run's minutes from their mean:
    how far one run lands from the score."""
    mean = statistics.mean(minutes)
    return max(abs(m / mean - 1) for m in minutes)


def gpus_of(platform: str) -> int:
    """GPUs of an MLLOG platform: '64xNVIDIA DGX H100' (8 a node unless the
    name says otherwise), '2xXE8545x4A100-SXM-40GB' (4 a node)."""
    nodes = re.match(r"(\d+)x", platform)
    rest = platform[nodes.end():] if nodes else platform
    per_node = re.search(r"x(\d+)(?=[A-Z])", rest)
    return ((int(nodes.group(1)) if nodes else 1)
            * (int(per_node.group(1)) if per_node else 8))


def row(folder: str, benchmark: str, checkout: str) -> dict:
    """published.json's row of one result folder."""
    runs = [read_run(p, benchmark) for p in sorted(
        glob.glob(os.path.join(folder, "result_*.txt")))]
    minutes, examples = score(runs)
    return {"benchmark": benchmark,
            "gpus": gpus_of(runs[0]["submission_platform"]),
            "global_batch": runs[0]["global_batch_size"],
            "minutes": round(minutes, 4),
            "examples": round(examples),
            "runs": len(runs),
            "converged": sum(r["converged"] for r in runs),
            "kept_minutes": [round(r["minutes"], 4) for r in kept(runs)],
            "folder": os.path.relpath(folder, checkout)}


def folders(checkout: str, submitters: str, systems: str, benchmark: str):
    for submitter in submitters.split(","):
        pattern = os.path.join(checkout, submitter, "results",
                               f"*{systems}*", benchmark)
        yield from sorted(glob.glob(pattern))


def spreads(checkouts: list, benchmarks: str) -> dict:
    """{benchmark: sorted spreads} of every result with three runs or more
    in `checkouts` (a result re-listed in another round counted once)."""
    found = {}
    for benchmark in benchmarks.split(","):
        seen = {}
        for checkout in checkouts:
            for folder in folders(checkout, "*", "", benchmark):
                try:
                    r = row(folder, benchmark, checkout)
                except (ValueError, KeyError, IndexError):
                    continue  # a cut-off or malformed log: not a result
                if len(r["kept_minutes"]) >= 1 and r["runs"] >= 3:
                    seen[(r["gpus"], r["global_batch"], r["minutes"])] = \
                        round(spread(r["kept_minutes"]), 4)
        found[benchmark] = sorted(seen.values())
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="+",
                        help="a clone of mlcommons/training_results_vX.Y "
                        "(several with --spreads)")
    parser.add_argument("--submitters", default="NVIDIA,NVIDIA_CoreWeave",
                        help="submitter folders read, comma-separated")
    parser.add_argument("--systems", default="h100",
                        help="a word the result folder's name holds")
    parser.add_argument("--benchmarks", default="bert,resnet",
                        help="benchmarks read, comma-separated")
    parser.add_argument("--spreads", action="store_true",
                        help="print every result's run-to-run spread per "
                        "benchmark (all submitters) instead of rows")
    args = parser.parse_args()
    for checkout in args.checkout:
        if not glob.glob(os.path.join(checkout, "*", "results")):
            parser.error(f"{checkout}: no SUBMITTER/results folders (a clone "
                         "of mlcommons/training_results_vX.Y?)")
    if args.spreads:
        for benchmark, values in spreads(args.checkout,
                                         args.benchmarks).items():
            if not values:
                parser.error(f"no {benchmark} result of three runs or more "
                             f"in {', '.join(args.checkout)}")
            print(json.dumps({"benchmark": benchmark, "results": len(values),
                              "median": statistics.median(values),
                              "spreads": values}))
        return
    found = 0
    for checkout in args.checkout:
        for benchmark in args.benchmarks.split(","):
            for folder in folders(checkout, args.submitters, args.systems,
                                  benchmark):
                try:
                    print(json.dumps(row(folder, benchmark, checkout)))
                except ValueError as e:  # a run cut off: its file named
                    parser.error(str(e))
                found += 1
    if not found:
        parser.error(f"no result folder of --submitters {args.submitters} "
                     f"--systems {args.systems} --benchmarks "
                     f"{args.benchmarks} in {', '.join(args.checkout)}")


if __name__ == "__main__":
    main()
