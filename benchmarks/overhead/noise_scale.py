r"""What measuring the gradient noise scale costs: the Trainer with it on and off.

    python -m benchmarks.overhead.noise_scale [--steps 200] [--rounds 3]

The same model, data (one in-memory batch repeated) and Adam optimizer, one
Trainer per mode in the same process, 1 worker x 2 accumulation steps (the
noise scale needs two micro-batches per step). Rounds alternate the modes
(off, plain, preconditioned, off, ...) so drift in the machine's speed hits
each alike. Reports the median steps/s of each mode, from the Trainer's own
report (every step of the run), and each mode's cost against "off".
"""

import argparse
import statistics

import keras
import tensorflow as tf

from benchmarks import harness
from benchmarks.scaling.worker import model_and_data
from benchmarks.overhead.trainer import last_report
from tfscale.noise.scale import NoiseScaleConfig
from tfscale.trainer.loop import TrainConfig, Trainer

WORKLOADS = ("bert_tiny", "materials_mlp")
MODES = ("off", "plain", "preconditioned")


def trainer_run(strategy, workload, mode, batch_size, accumulation):
    """`run(steps) -> steps/s` of a Trainer measuring the noise scale in
    `mode`."""
    make_model, loss_fn, dataset_fn = model_and_data(
        workload, batch_size // accumulation)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model, optimizer = make_model(), keras.optimizers.Adam(1e-4)
    trainer = Trainer(
        model=model, optimizer=optimizer, loss_fn=loss_fn, strategy=strategy,
        config=TrainConfig(global_batch_size=batch_size,
                           num_accumulation_steps=accumulation,
                           verbose=0, log_steps=10**9,
                           noise_scale=NoiseScaleConfig(mode=mode)))
    report = last_report()

    def run(steps):
        trainer.fit(dataset_fn, steps_per_epoch=steps, callbacks=[report])
        trainer.step.assign(0)  # next fit: the same epoch again
        return 1.0 / report.step_time
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="workloads timed, comma-separated")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps timed in each run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of on and off, alternating")
    parser.add_argument("--batch_size", type=int, default=64,
                        help="examples a batch")
    parser.add_argument("--accumulation", type=int, default=2,
                        help="micro-batches a step (the estimate needs 2 or "
                             "more)")
    args = parser.parse_args()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    print(f"{args.steps} steps per round, global batch {args.batch_size} = "
          f"{args.batch_size // args.accumulation} x {args.accumulation} "
          f"accumulation, median of {args.rounds} alternating rounds, "
          "1 worker")
    table = harness.Table(["workload", "off steps/s", "plain steps/s",
                           "plain cost", "preconditioned steps/s",
                           "preconditioned cost"])
    for workload in args.workloads.split(","):
        runs = {mode: trainer_run(strategy, workload, mode, args.batch_size,
                                  args.accumulation) for mode in MODES}
        for run in runs.values():
            run(20)  # trace and warm up
        rates = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode, run in runs.items():
                rates[mode].append(run(args.steps))
        median = {mode: statistics.median(r) for mode, r in rates.items()}
        cost = {mode: 100 * (1 - median[mode] / median["off"])
                for mode in MODES}
        table.row(workload, f"{median['off']:.1f}", f"{median['plain']:.1f}",
                  f"{cost['plain']:+.1f}%", f"{median['preconditioned']:.1f}",
                  f"{cost['preconditioned']:+.1f}%")


if __name__ == "__main__":
    main()
