r"""Horovod's synthetic benchmark through tfscale.horovod against tfscale's
own Trainer with --backend=mpi: the same model, batch and ranks.

    python -m benchmarks.scaling.horovod_synthetic --image_size 96 --batch_size 16 \
        --steps 20 --repeats 3 --output_dir runs/horovod_synthetic

Each repeat runs, in turn:
  - `tfscale-run -np N python examples/horovod/synthetic_benchmark.py`
    (keras.applications ResNet-50, SGD(0.01), one random batch,
    `hvd.DistributedGradientTape`), without and with `--fp16-allreduce`;
  - `launch.local --backend mpi` + benchmarks/scaling/worker.py with
    `--model resnet50_synthetic --optimizer sgd --backend mpi`: the same
    model and data through tfscale's Trainer (one fused MPI all-reduce per
    step).
Reported: images/s (all ranks) per run, medians, and each Horovod variant
over the Trainer (the target: within 10%).
"""

import argparse
import json
import os
import statistics
import sys

from benchmarks import harness



def horovod(args, out, fp16: bool) -> float:
    iterations = max(1, args.steps // args.batches_per_iter)
    command = [*harness.python("launch.horovodrun", "-np", args.ranks),
               sys.executable, "examples/horovod/synthetic_benchmark.py",
               "--image-size", str(args.image_size),
               "--batch-size", str(args.batch_size),
               "--num-warmup-batches", str(args.warmup_steps),
               "--num-batches-per-iter", str(args.batches_per_iter),
               "--num-iters", str(iterations), "--json-out", out]
    if fp16:
        command.append("--fp16-allreduce")
    harness.run(command, what="tfscale.horovod")
    with open(out) as f:
        return json.load(f)["images_per_second"]


def trainer(args, out) -> float:
    command = harness.on_workers(args.ranks, harness.python(
               "benchmarks.scaling.worker",
               "--model", "resnet50_synthetic", "--optimizer", "sgd",
               "--backend", "mpi", "--image_size", str(args.image_size),
               "--global_batch_size", str(args.batch_size * args.ranks),
               "--steps", str(args.steps),
               "--warmup_steps", str(args.warmup_steps),
               "--timed_steps", "0", "--result_file", out),
        threads=None, launcher=["--backend", "mpi"])
    harness.run(command, what="Trainer --backend=mpi")
    with open(out) as f:
        return json.load(f)["examples_per_second"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2,
                        help="MPI ranks (tfscale-run -np)")
    parser.add_argument("--image_size", type=int, default=96,
                        help="image side in pixels")
    parser.add_argument("--batch_size", type=int, default=16,
                        help="per rank")
    parser.add_argument("--steps", type=int, default=20,
                        help="timed iterations")
    parser.add_argument("--warmup_steps", type=int, default=5,
                        help="iterations run first, untimed")
    parser.add_argument("--batches_per_iter", type=int, default=5,
                        help="batches an iteration (Horovod's synthetic "
                             "benchmark's --num-batches-per-iter)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each measurement is repeated")
    parser.add_argument("--output_dir", default="runs/horovod_synthetic",
                        help="folder for report.md and results.json")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    runs = {"trainer_mpi": [], "horovod": [], "horovod_fp16": []}
    for repeat in range(args.repeats):
        path = os.path.join(args.output_dir, f"{{}}-{repeat}.json")
        runs["horovod"].append(horovod(args, path.format("horovod"), False))
        runs["trainer_mpi"].append(trainer(args, path.format("trainer")))
        runs["horovod_fp16"].append(
            horovod(args, path.format("horovod_fp16"), True))
        print(f"repeat {repeat}: " + ", ".join(
            f"{k} {v[-1]:.1f}" for k, v in runs.items()), flush=True)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    lines = [f"ResNet-50 (keras.applications), {args.image_size}x"
             f"{args.image_size}, batch {args.batch_size} per rank, "
             f"{args.ranks} ranks, {args.steps} measured steps after "
             f"{args.warmup_steps}, {args.repeats} repeats (images/s, all "
             "ranks):", "",
             harness.table(
                 ["run", "images/s per repeat", "median", "/ Trainer mpi"],
                 ([name, ", ".join(f"{v:.1f}" for v in values),
                   f"{medians[name]:.1f}",
                   f"{medians[name] / medians['trainer_mpi']:.2f}"]
                  for name, values in runs.items()), align="llrr")]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.output_dir, "report.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"runs": runs, "medians": medians, "args": vars(args)}, f)


if __name__ == "__main__":
    main()
