"""One rank of tests/test_horovod_ranks.py: Horovod's documented behaviour,
checked on real ranks through `tfscale.horovod` (and `.keras`).

    tfscale-run -np 2 -H localhost:2 python tests/workers/horovod_semantics.py OUT

Each rank writes OUT/rank-R.json: the measured quantities (differences
from references computed here in plain TensorFlow), for the test to judge.
Runs with Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tfscale.horovod as hvd
import tfscale.horovod.keras as hvdk

LR = 0.1


def data_of(rank, batches, batch=4, seed=7):
    """Every rank's (x, y), the same in every process."""
    rng = np.random.default_rng(seed + rank)
    x = rng.normal(size=(batches * batch, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
         + 0.1 * rng.normal(size=(batches * batch, 1)).astype(np.float32))
    return x, y


def dense_model(seed):
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([tf.keras.Input((3,)),
                                 tf.keras.layers.Dense(4, activation="tanh"),
                                 tf.keras.layers.Dense(1)])
    return model


def collectives(r, n, out):
    x = tf.constant([1.0, 2.0, 3.0]) * (r + 1)
    out["average"] = hvd.allreduce(x).numpy().tolist()
    out["sum"] = hvd.allreduce(x, op=hvd.Sum).numpy().tolist()
    out["average_flag"] = hvd.allreduce(x, average=False).numpy().tolist()
    out["min"] = hvd.allreduce(x, op=hvd.Min).numpy().tolist()
    out["max"] = hvd.allreduce(x, op=hvd.Max).numpy().tolist()
    out["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                  postscale_factor=0.5).numpy().tolist()
    out["int_sum"] = hvd.allreduce(tf.constant([r + 1, 10]),
                                   op=hvd.Sum).numpy().tolist()
    grouped = hvd.grouped_allreduce(
        [x, tf.constant([[r]], tf.int64), tf.constant([0.5], tf.float16)],
        op=hvd.Sum)
    out["grouped"] = [g.numpy().tolist() for g in grouped]
    out["allgather"] = hvd.allgather(
        tf.fill([r + 1, 2], float(r))).numpy().tolist()
    out["allgather_int"] = hvd.allgather(tf.range(r + 2)).numpy().tolist()
    out["broadcast"] = hvd.broadcast(tf.constant([r, 10 * r]),
                                     root_rank=1).numpy().tolist()
    out["broadcast_object"] = hvd.broadcast_object({"from": r}, root_rank=1)
    out["allgather_object"] = hvd.allgather_object(f"rank{r}")

    @tf.function
    def in_graph(v):
        return (hvd.allreduce(v, op=hvd.Sum), hvd.allgather(v[:r + 1]),
                hvd.broadcast(v, 1))
    out["in_tf_function"] = [t.numpy().tolist() for t in in_graph(x)]

    values = [np.random.default_rng(k).normal(size=1000).astype(np.float32)
              for k in range(n)]
    exact = hvd.allreduce(values[r])
    compressed = hvd.allreduce(values[r], compression=hvd.Compression.fp16)
    out["fp16_dtype"] = compressed.dtype.name
    # float16 rounds each input and the sum to 11 bits: the mean is off by
    # at most 2^-10 * mean(|inputs|).
    bound = 2.0 ** -10 * np.mean(np.abs(values), axis=0)
    out["fp16_error_over_bound"] = float(np.max(
        np.abs(compressed.numpy() - exact.numpy()) / bound))
    out["fp16_max_abs_error"] = float(np.max(np.abs(
        compressed.numpy() - exact.numpy())))

    v = tf.Variable(tf.ones([3]) * (r + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum) * [1.0, 2.0, 3.0])
    out["allreduce_grad"] = tape.gradient(loss, v).numpy().tolist()


def gradient_tape(r, n, out):
    """DistributedGradientTape in a tf.function == the 1-process gradient
    of the concatenated batch."""
    model = dense_model(seed=1)        # the same weights on every rank
    loss_fn = tf.keras.losses.MeanSquaredError()
    xs, ys = zip(*(data_of(k, 1) for k in range(n)))

    @tf.function
    def distributed(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        return tape.gradient(loss, model.trainable_variables)

    def single(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    got = distributed(xs[r], ys[r])
    want = single(np.concatenate(xs), np.concatenate(ys))
    out["tape_max_diff"] = max(float(tf.reduce_max(tf.abs(a - b)))
                               for a, b in zip(got, want))
    with tf.GradientTape() as tape:
        loss = loss_fn(ys[r], model(xs[r], training=True))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16,
                                       gradient_predivide_factor=2.0)
    got = tape.gradient(loss, model.trainable_variables)
    out["tape_fp16_predivide_max_diff"] = max(
        float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(got, want))


def fit_with_accumulation(r, n, out):
    """DistributedOptimizer(backward_passes_per_step=2,
    average_aggregated_gradients=True) + fit == one SGD update per 2
    micro-batches of every rank, by hand."""
    batches, batch = 4, 4
    model = dense_model(seed=100 + r)  # different on each rank: broadcast
    initial = hvd.broadcast_object(model.get_weights(), root_rank=0)
    optimizer = hvdk.DistributedOptimizer(
        tf.keras.optimizers.SGD(LR), backward_passes_per_step=2,
        average_aggregated_gradients=True)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = data_of(r, batches, batch)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["fit_iterations"] = int(np.asarray(optimizer.iterations.numpy()))

    # By hand: the same model, plain SGD, mean gradient of 2 micro-batches
    # of every rank.
    reference = dense_model(seed=0)
    reference.set_weights(initial)
    loss_fn = tf.keras.losses.MeanSquaredError()
    data = [data_of(k, batches, batch) for k in range(n)]
    for update in range(batches // 2):
        total = None
        for k in range(n):
            for micro in (2 * update, 2 * update + 1):
                xb = data[k][0][micro * batch:(micro + 1) * batch]
                yb = data[k][1][micro * batch:(micro + 1) * batch]
                with tf.GradientTape() as tape:
                    loss = loss_fn(yb, reference(xb, training=True))
                grads = tape.gradient(loss, reference.trainable_variables)
                total = grads if total is None else [
                    a + b for a, b in zip(total, grads)]
        for w, g in zip(reference.trainable_variables, total):
            w.assign_sub(LR * g / (2 * n))
    out["fit_accumulation_max_diff"] = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(model.get_weights(), reference.get_weights()))
    gathered = hvd.allgather_object(model.get_weights())
    out["fit_ranks_max_diff"] = max(
        float(np.max(np.abs(a - b))) for a, b in zip(*gathered))


class _Record(tf.keras.callbacks.Callback):
    """Logs before MetricAverageCallback, learning rates per batch."""

    def __init__(self):
        super().__init__()
        self.epoch_logs = []
        self.batch_rates = []

    def on_train_batch_begin(self, batch, logs=None):
        rate = self.model.optimizer.learning_rate
        self.batch_rates.append(float(np.asarray(rate.numpy())))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict((k, float(v)) for k, v in logs.items()))


def fit_with_callbacks(r, n, out):
    """MetricAverageCallback and LearningRateWarmupCallback."""
    steps, epochs, warmup = 4, 3, 2
    model = dense_model(seed=200 + r)
    model.compile(optimizer=hvdk.DistributedOptimizer(
        tf.keras.optimizers.SGD(LR)), loss="mse", metrics=["mae"])
    x, y = data_of(r, steps)
    record = _Record()
    callbacks = [hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvdk.callbacks.LearningRateWarmupCallback(
                     initial_lr=LR, warmup_epochs=warmup, verbose=1),
                 record,
                 hvdk.callbacks.MetricAverageCallback()]
    history = model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=callbacks)
    local = record.epoch_logs
    everyone = hvd.allgather_object(local)
    out["metric_history"] = {k: [float(v) for v in vs]
                             for k, vs in history.history.items()}
    out["metric_local"] = local
    out["metric_mean_of_ranks"] = {
        key: [float(np.mean([ranks[e][key] for ranks in everyone]))
              for e in range(epochs)] for key in ("loss", "mae")}
    out["warmup_epoch_lr"] = out["metric_history"].get("lr")
    out["warmup_batch_lr"] = record.batch_rates
    out["warmup_expected_batch_lr"] = [
        LR / n * ((e + (b + 1) / steps) * (n - 1) / warmup + 1)
        if e < warmup else LR
        for e in range(epochs) for b in range(steps)]


def checkpoint_broadcast(r, n, out, workdir):
    """A checkpoint restored on rank 0 only, then broadcast, reaches all."""
    path = os.path.join(workdir, "ckpt")
    if r == 0:
        saved = dense_model(seed=300)
        tf.train.Checkpoint(model=saved).write(path)
        want = [w.tolist() for w in saved.get_weights()]
    else:
        want = None
    hvd.broadcast_object(None, root_rank=0)   # the file exists now
    model = dense_model(seed=400 + r)
    if r == 0:
        tf.train.Checkpoint(model=model).read(path).assert_consumed()
    hvd.broadcast_variables(model.variables, root_rank=0)
    want = hvd.broadcast_object(want, root_rank=0)
    out["checkpoint_max_diff"] = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(model.get_weights(), want))


def join_check(r, n, out):
    """Rank 1 runs out of data first: rank 0's allreduces still complete,
    the joined rank adding zeros; join returns the last rank to join."""
    if r == 0:
        out["join_sums"] = [hvd.allreduce(tf.ones([2]), op=hvd.Sum)
                            .numpy().tolist() for _ in range(2)]
        out["join_average"] = hvd.allreduce(tf.ones([2])).numpy().tolist()
    out["join_last"] = hvd.join()


def main(argv):
    workdir = argv[0]
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r, "size": n, "local_rank": hvd.local_rank(),
           "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
           "keras": tf.keras.__name__ if hasattr(tf.keras, "__name__")
           else "?", "keras_version": getattr(tf.keras, "__version__", "?")}
    collectives(r, n, out)
    gradient_tape(r, n, out)
    fit_with_accumulation(r, n, out)
    fit_with_callbacks(r, n, out)
    checkpoint_broadcast(r, n, out, workdir)
    join_check(r, n, out)
    opt = tf.keras.optimizers.Adam()
    opt.build(dense_model(seed=5).trainable_variables)
    out["optimizer_variables_callable"] = len(opt.variables()) > 0
    with open(os.path.join(workdir, f"rank-{r}.json"), "w") as f:
        json.dump(out, f)
    print(f"rank {r}: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
