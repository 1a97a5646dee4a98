r"""Trainer overhead: tfscale.Trainer versus a minimal strategy.run loop.

    python -m benchmarks.overhead.trainer [--steps 200] [--repeats 3]

Same model, same data (one in-memory batch repeated, so input costs nothing),
same optimizer, in the same process. The minimal loop is what one writes by
hand: one tf.function with forward, backward and `optimizer.apply` (which
all-reduces) inside `strategy.run`, reading the loss every step. The Trainer
adds its three dispatches (compute, sync, apply), a host sync after each (for
the time split), metrics-free logs and callbacks. Reports steps/s of each
(median over interleaved repeats) and the overhead.
"""

import argparse
import statistics
import time

from benchmarks import harness

# TensorFlow is imported by the functions that use it, after the command
# line is read: --help answers at once.


WORKLOADS = ("bert_tiny", "materials_mlp")


def build(strategy, make_model):
    import keras
    keras.utils.set_random_seed(0)
    with strategy.scope():
        return make_model(), keras.optimizers.Adam(1e-4)


def minimal_loop(strategy, make_model, loss_fn, dataset_fn, batch_size,
                 steps):
    import tensorflow as tf
    from tfscale.step.losses import unreduced
    model, optimizer = build(strategy, make_model)
    iterator = iter(strategy.distribute_datasets_from_function(
        dataset_fn))

    @tf.function
    def step(data):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(unreduced(loss_fn)(
                    y, model(x, training=True), None)) / batch_size
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss
        return strategy.run(replica, args=data)

    def run(n):
        for _ in range(n):
            float(strategy.experimental_local_results(step(next(iterator)))[0])
    return run


def last_report():
    """A Keras callback that keeps the step time (`.step_time`) of the
    Trainer's last log interval."""
    import keras

    class LastReport(keras.callbacks.Callback):
        def on_interval_end(self, step, numbers):
            self.step_time = numbers["step_time"]
    return LastReport()


def trainer_loop(strategy, make_model, loss_fn, dataset_fn, batch_size,
                 steps):
    """Steady-state steps/s of `Trainer.fit` from its own report, which
    covers every step of the run (its part-by-part timed steps included)
    but not the iterator set-up and tear-down around `fit` (about a second
    per call here, paid once in a real run)."""
    from tfscale.trainer.loop import TrainConfig, Trainer
    model, optimizer = build(strategy, make_model)
    trainer = Trainer(model=model, optimizer=optimizer, loss_fn=loss_fn,
                      strategy=strategy,
                      config=TrainConfig(global_batch_size=batch_size,
                                         log_steps=steps, verbose=0))
    report = last_report()

    def run(n):
        trainer.fit(dataset_fn, steps_per_epoch=n,
                    callbacks=[report])
        trainer.step.assign(0)  # next fit: same epoch again, no resume skip
        return 1.0 / report.step_time
    return run


def steps_per_second(run, steps):
    start = time.perf_counter()
    rate = run(steps)
    return rate or steps / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="workloads timed, comma-separated")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps timed in each run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each measurement is repeated")
    parser.add_argument("--batch_size", type=int, default=32,
                        help="examples a batch")
    args = parser.parse_args()
    import tensorflow as tf
    from benchmarks.scaling.worker import model_and_data
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    print(f"{args.steps} steps, global batch {args.batch_size}, median of "
          f"{args.repeats} interleaved repeats, 1 worker (MirroredStrategy)")
    table = harness.Table(["workload", "minimal loop steps/s",
                           "Trainer steps/s", "overhead"])
    for name in args.workloads.split(","):
        make_model, loss_fn, dataset_fn = model_and_data(name, args.batch_size)
        runs = {label: fn(strategy, make_model, loss_fn, dataset_fn,
                          args.batch_size, args.steps)
                for label, fn in (("minimal", minimal_loop),
                                  ("trainer", trainer_loop))}
        runs["minimal"](10)  # trace and warm up
        runs["trainer"](args.steps)
        rates = {label: [] for label in runs}
        for _ in range(args.repeats):
            for label, run in runs.items():
                rates[label].append(steps_per_second(run, args.steps))
        minimal = statistics.median(rates["minimal"])
        trainer = statistics.median(rates["trainer"])
        table.row(name, f"{minimal:.1f}", f"{trainer:.1f}",
                  f"{100 * (minimal / trainer - 1):+.1f}%")


if __name__ == "__main__":
    main()
