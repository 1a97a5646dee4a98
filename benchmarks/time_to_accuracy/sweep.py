r"""Time to accuracy: what each global batch costs in steps and examples.

    python -m benchmarks.time_to_accuracy --task fashion_mnist      # ~30 min
    python -m benchmarks.time_to_accuracy --task bert_tiny \
        --records='runs/demo/records/train-*.tfrecord'              # make demo

Each run is a job on tfscale's skeleton (`tfscale.jobs.run`, a `StudyRun`
task: the study's model and data, stopped at the target by a callback).
Steps to a target do not depend on the hardware, so every run is one process
with 2 accumulation steps (the global record order makes that the same run
as 2 workers; two micro-batches also let the Trainer measure the gradient
noise scale). For each optimizer (SGD with momentum, AdamW, LAMB; linear
warmup, then constant) and global batch (powers of 4), a small
learning-rate search (3 rates a factor 3 apart, and up to 2 more outward
when the best is at the grid's edge; one seed; a second for every rate of a
tie, which the sum over both seeds breaks, and at the batch nearest the
knee) runs until the target is reached or an example cap. The best rate
per batch gives steps S and examples E to the target; a fit of


S = S_min (1 + B_crit / B) gives S_min, E_min = S_min B_crit and B_crit
(McCandlish et al. 2018), with the range of leave-one-batch-out fits, against
the B_simple the Trainer measured in the same runs: at every evaluation
(with its 95% interval, and whether its EMA window had filled), so B_simple
at the target and along the run can both be set against B_crit. SGD runs
measure the plain noise scale; AdamW and LAMB the preconditioned one (the
direction they move in). The noise scale's window is WINDOW_EXAMPLES
examples at every batch, so the large batches fill it too.

A study's definition (`Study.definition`: the data's content, target, the
model in words and its code, the optimizers' settings and rate grid, the
data pipeline's and evaluation's code, the seeds, the window, the library
versions) has a digest; its runs go to `benchmarks/results/time_to_accuracy_<study>-<digest>
.jsonl` (one line per run, each with the definition's digest and the git
commit it ran on), and the markdown and plot next to it are built from that
file alone. A rerun reuses only runs of the same digest; another data
directory or target writes its own file. Data: Fashion-MNIST from Debian's
`dataset-fashion-mnist` (60,000 training and 10,000 test images, IDX files);
BERT-tiny masked-LM on the demo corpus's records, the last shard held out.
"""

import argparse
import dataclasses
import json
import math
import os

from benchmarks import harness
from benchmarks.time_to_accuracy.analysis import (
    analyse, append_result, best_per_batch, fit_curve, load_results,
    rates_for, ties)
from benchmarks.time_to_accuracy.study import (
    EXTRA_RATES, GIVE_UP, OPTIMIZERS, RATE_STEPS, SEEDS, run_one)
from benchmarks.time_to_accuracy.tasks import (
    bert_task, digits_task, fashion_task)
from input_pipelines import idx

RESULTS = harness.RESULTS


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("fashion_mnist", "digits",
                                           "bert_tiny"),
                        default="fashion_mnist",
                        help="the study's task")
    parser.add_argument("--fashion_dir", default=idx.FASHION_MNIST_DIR,
                        help="Fashion-MNIST's IDX files (Debian's dataset-"
                             "fashion-mnist)")
    parser.add_argument("--records", default="runs/demo/records/train-*",
                        help="BERT records of the bert_tiny task (a glob)")
    parser.add_argument("--bert_config",
                        default="runs/demo/corpus/bert_config.json",
                        help="BERT config JSON of the bert_tiny task")
    parser.add_argument("--target", type=float, default=None,
                        help="default: 0.85 accuracy (Fashion-MNIST), 0.97 "
                             "(digits) / 5.6 MLM loss")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                        help="optimizers studied, comma-separated")
    parser.add_argument("--batches", default=None,
                        help="comma list (default: the study's)")
    parser.add_argument("--analyse_only", action="store_true",
                        help="only analyse the results already written")
    args = parser.parse_args()
    if args.task == "fashion_mnist":
        if not os.path.isdir(args.fashion_dir):
            raise SystemExit(f"--fashion_dir: {args.fashion_dir} not found "
                             "(apt-get install dataset-fashion-mnist)")
        study = fashion_task(args.fashion_dir, args.target or 0.85)
    elif args.task == "digits":
        study = digits_task(args.target or 0.97)
    else:
        study = bert_task(args.records, args.bert_config, args.target or 5.6)
    if args.batches:
        study = dataclasses.replace(
            study, batches=tuple(int(b) for b in args.batches.split(",")))
    stem = os.path.join(RESULTS, f"time_to_accuracy_{study.name}-"
                                 f"{study.digest()}")
    with open(stem + ".definition.json", "w") as f:
        json.dump(dict(study.definition(), digest=study.digest(),
                       read_from=study.source), f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"definition {study.digest()}: {stem}.jsonl", flush=True)
    results = load_results(stem + ".jsonl", study.digest())
    optimizers = args.optimizers.split(",")
    if not args.analyse_only:
        def run(optimizer, batch, rate, seed):
            for r in results:
                if (r["optimizer"], r["batch"], r["rate"], r["seed"]) == (
                        optimizer, batch, rate, seed):
                    return r
            # A rate that needs GIVE_UP times the examples of this batch's
            # best so far is not the tuned one: stop it there.
            best = best_per_batch(results, optimizer, seed).get(batch)
            budget = GIVE_UP * best["examples"] if best else None
            result = run_one(study, optimizer, batch, rate, seed,
                             budget)
            results.append(result)
            append_result(stem + ".jsonl", result)
            print(json.dumps(result), flush=True)
            return result

        for optimizer in optimizers:
            for batch in study.batches:
                low, middle, high = rates_for(study, optimizer, batch)
                runs = [run(optimizer, batch, rate, SEEDS[0])
                        for rate in (middle, high, low)]
                # The best rate at an edge of the grid: one more step
                # outward (at most EXTRA_RATES), so a tuned rate is never
                # just the grid's end.
                for _ in range(EXTRA_RATES):
                    reached = [r for r in runs if r["reached"]]
                    if not reached:
                        break
                    best = min(reached, key=lambda r: r["steps"])
                    ordered = sorted(runs, key=lambda r: r["rate"])
                    if best is ordered[-1]:
                        rate = float(f"{best['rate'] * RATE_STEPS[-1]:.3g}")
                    elif best is ordered[0]:
                        rate = float(f"{best['rate'] * RATE_STEPS[0]:.3g}")
                    else:
                        break
                    runs.append(run(optimizer, batch, rate, SEEDS[0]))
            # The second seed: every rate of a tie (the tuned rate is the one
            # with the fewest steps over both seeds), and the tuned rate at
            # the batch nearest the knee.
            for batch, rate in ties(results, optimizer):
                run(optimizer, batch, rate, SEEDS[1])
            best = best_per_batch(results, optimizer)
            fit = fit_curve(sorted(best), [best[b]["steps"]
                                           for b in sorted(best)])
            if fit:
                batch = min(best, key=lambda b: abs(math.log(b / fit[1])))
                run(optimizer, batch, best[batch]["rate"], SEEDS[1])
    section = analyse(study, results, stem + ".png")
    with open(stem + ".md", "w") as f:
        f.write(section + "\n")
    print(section)


if __name__ == "__main__":
    main()
