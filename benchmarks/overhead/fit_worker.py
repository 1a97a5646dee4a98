"""One worker of benchmarks.overhead.fit_comparison: trains one model with one engine.

Engines, same model, data, optimizer and global batch:
    tf_keras   legacy Keras 2 (`tf_keras`) `model.fit` under MWMS
    keras3     Keras 3 `model.fit` with `tfscale.enable_multi_worker_fit()`
    trainer    `tfscale.Trainer.from_compiled(...).fit(dataset)`, defaults
               (`--steps_per_execution`, `--max_call_seconds`: the calls)
    trainer_mpi  the same with tfscale's MPI backend (`--backend mpi`: the
               ranks of one `mpirun`, gradients summed by `MPI.Allreduce`,
               shared memory on one host)
    bare       a hand-written `strategy.run` loop: one tf.function with
               forward, backward and `optimizer.apply`, loss read every step

The data is an in-memory dataset of global batches (`fit`'s input); every
engine takes its slice of each batch. The chief writes examples/s over the
steps after `--warmup_steps` (time between batch ends) to `--result_file`.
"""

import argparse
import json
import time

import numpy as np
import tensorflow as tf

EXAMPLES = 4096


def data(model_name):
    rng = np.random.RandomState(0)
    if model_name == "cnn":
        x = rng.rand(EXAMPLES, 28, 28).astype("float32")
        y = rng.randint(0, 10, EXAMPLES).astype("int64")
    else:
        x = rng.randn(EXAMPLES, 64).astype("float32")
        y = rng.randint(0, 10, EXAMPLES).astype("int64")
    return x, y


def build(keras, model_name):
    """The tutorial's CNN or a 3-layer MLP, in whichever Keras is given."""
    layers = keras.layers
    if model_name == "cnn":
        body = [layers.Reshape((28, 28, 1), input_shape=(28, 28)),
                layers.Conv2D(32, 3, activation="relu"), layers.Flatten(),
                layers.Dense(128, activation="relu"), layers.Dense(10)]
    else:
        body = [layers.Dense(256, activation="relu", input_shape=(64,)),
                layers.Dense(256, activation="relu"), layers.Dense(10)]
    model = keras.Sequential(body)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class Clock:
    """Times batch ends (the steps done at each); examples/s over the steps
    after the warm-up (a call of several steps ends several at once)."""

    def __init__(self, warmup, global_batch):
        self.warmup, self.global_batch, self.times = warmup, global_batch, []

    def tick(self, steps_done=None):
        steps_done = len(self.times) + 1 if steps_done is None else steps_done
        self.times.append((steps_done, time.perf_counter()))

    def examples_per_second(self):
        measured = [(s, t) for s, t in self.times if s >= self.warmup]
        (first, start), (last, end) = measured[0], measured[-1]
        return (last - first) * self.global_batch / (end - start)


def callback_class(keras):
    class Tick(keras.callbacks.Callback):
        def __init__(self, clock):
            super().__init__()
            self.clock = clock

        def on_train_batch_end(self, batch, logs=None):
            self.clock.tick(batch + 1)
    return Tick


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", required=True,
                        choices=["tf_keras", "keras3", "trainer",
                                 "trainer_mpi", "bare"],
                        help="the training loop this worker runs")
    parser.add_argument("--model", required=True, choices=["cnn", "mlp"],
                        help="the model it trains")
    parser.add_argument("--steps", type=int, required=True,
                        help="steps timed in each run")
    parser.add_argument("--warmup_steps", type=int, required=True,
                        help="steps run first, untimed (tracing, compilation)")
    parser.add_argument("--global_batch", type=int, default=128,
                        help="global batch a step")
    parser.add_argument("--result_file", required=True,
                        help="where this worker writes its timings as JSON "
                             "(the benchmark that starts it sets it)")
    parser.add_argument("--timed_steps_per_log", type=int, default=4,
                        help="Trainer: steps per log interval run part by "
                        "part to measure the time split")
    parser.add_argument("--steps_per_execution", type=int, default=1,
                        help="Trainer: the most steps one call runs")
    parser.add_argument("--max_call_seconds", type=float, default=2.0,
                        help="Trainer: the bound on a call's time (0: none)")
    parser.add_argument("--log_steps", type=int, default=0,
                        help="Trainer: print its line (examples/s, the time "
                        "split) every this many steps (0: silent)")
    args = parser.parse_args()

    if args.engine == "tf_keras":
        import tf_keras as keras
    else:
        import keras
    backend = "mpi" if args.engine == "trainer_mpi" else "mwms"
    strategy, worker_index = make_strategy(backend)
    x, y = data(args.model)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        args.global_batch, drop_remainder=True).repeat()
    with strategy.scope():
        model = build(keras, args.model)
    clock = Clock(args.warmup_steps, args.global_batch)
    tick = callback_class(keras)(clock)
    total = args.warmup_steps + args.steps
    if args.engine in ("tf_keras", "keras3"):
        if args.engine == "keras3":
            import tfscale
            tfscale.enable_multi_worker_fit()
        model.fit(dataset, epochs=1, steps_per_epoch=total, callbacks=[tick],
                  verbose=0)
    elif args.engine in ("trainer", "trainer_mpi"):
        import tfscale
        trainer = tfscale.Trainer.from_compiled(
            model, tfscale.TrainConfig(
                global_batch_size=args.global_batch,
                verbose=2 if args.log_steps else 0,
                log_steps=args.log_steps or 100,
                timed_steps_per_log=args.timed_steps_per_log,
                steps_per_execution=args.steps_per_execution,
                max_call_seconds=args.max_call_seconds),
            backend=backend)
        trainer.fit(dataset, epochs=1, steps_per_epoch=total, callbacks=[tick])
    else:
        bare_loop(strategy, model, dataset, total, args.global_batch, clock)
    if worker_index == 0:
        with open(args.result_file, "w") as f:
            json.dump({"examples_per_second": clock.examples_per_second()}, f)
    if args.engine in ("trainer", "trainer_mpi"):
        trainer.leave_together()


def make_strategy(backend):
    """(strategy, this worker's index): MultiWorkerMirroredStrategy from
    TF_CONFIG, or with the MPI backend one single-replica strategy per rank
    (`tfscale.cluster`)."""
    if backend == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        return strategy, strategy.cluster_resolver.task_id
    from tfscale import cluster
    from tfscale.cluster import strategies
    info = cluster.resolve_cluster(backend=backend)
    config = cluster.ClusterConfig(backend=backend)
    return strategies.make_strategy(info, config), info.worker_index


def bare_loop(strategy, model, dataset, steps, global_batch, clock):
    import keras
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    iterator = iter(strategy.experimental_distribute_dataset(
        dataset.with_options(options)))
    optimizer = model.optimizer
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)

    @tf.function
    def step(batch):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(y, model(x, training=True))) / (
                    global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss
        return strategy.run(replica, args=batch)

    for _ in range(steps):
        float(strategy.experimental_local_results(step(next(iterator)))[0])
        clock.tick()


if __name__ == "__main__":
    main()
