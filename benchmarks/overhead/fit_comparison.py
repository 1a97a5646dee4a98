r"""Trainer versus `model.fit` on 2 workers: tf_keras, Keras 3 + switch, bare.

    pip install -e '.[bench]'          # tf_keras, for this benchmark only
    python -m benchmarks.overhead.fit_comparison [--num_workers 2] [--repeats 3]

Each engine of `benchmarks/overhead/fit_worker.py` trains the same model on the same
data (an in-memory dataset of global batches) with the same SGD and global
batch, on N local workers through `launch.local`, one launch per
measurement. Engines alternate within each repeat; the table reports the
median examples/s over the repeats and the Trainer's ratio to each engine:
the median of the ratios within each repeat (runs of one repeat are
minutes apart, so they share the machine's current speed).

`--engines keras3,trainer,trainer_mpi` adds the Trainer on tfscale's MPI
backend (needs `pip install -e '.[mpi]'`): the same step, the gradients
summed by MPI over shared memory instead of gRPC. `trainer_calls` runs up
to 100 steps a call with the calls' default time bound (2 s),
`trainer_calls_unbounded` the same with none (`--max_call_seconds 0`):
their ratio is what the bound costs.
"""

import argparse
import json
import os
import statistics
import tempfile

from benchmarks import harness

ENGINES = ("tf_keras", "keras3", "trainer", "bare")  # the default set
# The Trainer's engines: their ratios to every other engine are reported.
OURS = ("trainer", "trainer_mpi", "trainer_calls",
        "trainer_calls_unbounded")
# Engines that are the Trainer with other settings: (engine, worker flags).
SETTINGS = {"trainer_calls": ("trainer", ["--steps_per_execution=100"]),
            "trainer_calls_unbounded": ("trainer", [
                "--steps_per_execution=100", "--max_call_seconds=0"])}
STEPS = {"cnn": (20, 100), "mlp": (100, 600)}  # (warm-up, measured)
# Calls of up to 100 steps: a warm-up past the calls' growth to their
# length (1, 1, 1, 2, 2, 4, ... steps: step/pace.py), more steps measured.
CALL_STEPS = {"cnn": (400, 400), "mlp": (1000, 1200)}


def measure(engine, model, num_workers, global_batch, threads) -> float:
    warmup, steps = (CALL_STEPS if engine in SETTINGS else STEPS)[model]
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        backend = "mpi" if engine == "trainer_mpi" else "mwms"
        worker_engine, flags = SETTINGS.get(engine, (engine, []))
        command = harness.on_workers(
            num_workers, harness.python(
                "benchmarks.overhead.fit_worker", f"--engine={worker_engine}",
                f"--model={model}", *flags, f"--steps={steps}",
                f"--warmup_steps={warmup}", f"--global_batch={global_batch}",
                f"--result_file={result}"),
            threads=threads, launcher=["--backend", backend])
        harness.run(command, timeout=900, what=f"fit_comparison: "
                    f"{engine}/{model}", env=dict(os.environ,
                                                  TF_CPP_MIN_LOG_LEVEL="2"))
        with open(result) as f:
            return json.load(f)["examples_per_second"]


def paired_ratio(rates, model, ours, engine) -> float:
    """Median over repeats of ours / engine within the same repeat."""
    return statistics.median(t / e for t, e in zip(
        rates[(model, ours)], rates[(model, engine)]))


def ratio_pairs(engines) -> list:
    """(ours, other): each Trainer engine against every engine listed
    before it or not ours (so each pair of Trainer engines appears once)."""
    return [(ours, other) for i, ours in enumerate(engines) if ours in OURS
            for j, other in enumerate(engines)
            if other != ours and (other not in OURS or j < i)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_workers", type=int, default=2,
                        help="workers of each run")
    parser.add_argument("--threads_per_worker", type=int, default=1,
                        help="TensorFlow threads a worker")
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each measurement is repeated")
    parser.add_argument("--global_batch", type=int, default=128,
                        help="global batch a step")
    parser.add_argument("--models", default="cnn,mlp",
                        help="models, comma-separated: cnn, mlp")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="training loops compared, comma-separated")
    args = parser.parse_args()
    models = args.models.split(",")
    engines = args.engines.split(",")
    rates = {(m, e): [] for m in models for e in engines}
    for repeat in range(args.repeats):
        for model in models:
            for engine in engines:
                rate = measure(engine, model, args.num_workers,
                               args.global_batch, args.threads_per_worker)
                rates[(model, engine)].append(rate)
                print(f"repeat {repeat} {model} {engine}: {rate:.0f} "
                      "examples/s", flush=True)
    pairs = ratio_pairs(engines)
    print()
    print(f"{args.num_workers} workers, global batch {args.global_batch}, "
          f"median of {args.repeats} (examples/s)")
    table = harness.Table(["model", *engines, *(
        f"{ours} / {other}" for ours, other in pairs)])
    for model in models:
        median = {e: statistics.median(rates[(model, e)]) for e in engines}
        cells = [f"{median[e]:.0f}" for e in engines]
        cells += [f"{paired_ratio(rates, model, ours, other):.2f}x"
                  for ours, other in pairs]
        table.row(model, *cells)

if __name__ == "__main__":
    main()
