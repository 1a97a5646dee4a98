"""A worker for the multi-process tests: trains a small MLP with the Trainer.

Started through `launch.local` (or alone for the 1-worker baseline). It
builds its data so that every global step sees the same examples whatever
the worker count: the data is batched globally (per micro-batch), then each
worker takes its slice. It writes what it observed into --out:
weights_<worker>.npz and events_<worker>.json (callback hooks and logs).
"""

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfscale.cluster import environment as cluster_lib  # noqa: E402
from tfscale.cluster import strategies  # noqa: E402
from tfscale.cluster import collectives  # noqa: E402
from tfscale.trainer import loop as trainer_lib  # noqa: E402
from tfscale.optim import Lamb  # noqa: E402


class EventLog(keras.callbacks.Callback):
    """Records which hooks ran and with which logs."""

    def __init__(self):
        super().__init__()
        self.events = []

    def on_train_begin(self, logs=None):
        self.events.append(["train_begin"])

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(["epoch_end", epoch, dict(logs or {})])

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(["batch_end", batch, dict(logs or {})])

    def on_train_end(self, logs=None):
        self.events.append(["train_end"])


class StopAt(keras.callbacks.Callback):
    """Sets stop_training at a step, on one worker only (tests agreement)."""

    def __init__(self, step, only_worker):
        super().__init__()
        self.step, self.only_worker, self.seen = step, only_worker, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step and self.only_worker:
            self.model.stop_training = True


def make_data(n=512, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, 12).astype("float32")
    w = rng.randn(12, 2).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.randn(n, 2)).astype("float32")
    return x, y


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw", "lamb"])
    p.add_argument("--global_batch", type=int, default=32)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--xla", action="store_true")
    p.add_argument("--steps_per_execution", type=int, default=1,
                   help="> 1: calls of up to this many steps (log every 12, "
                        "1 timed step per log)")
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--shard", action="store_true",
                   help="TrainConfig(shard_optimizer_state=True)")
    p.add_argument("--checkpoint_dir", default=None)
    p.add_argument("--unshared_checkpoints", action="store_true",
                   help="worker i > 0 reads CHECKPOINT_DIR-i: a folder the "
                        "workers do not share, as on two hosts")
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--model_checkpoint", default=None)
    p.add_argument("--csv", default=None)
    p.add_argument("--stop_at", type=int, default=0)
    p.add_argument("--connect_timeout", type=float, default=60)
    p.add_argument("--collective_timeout", type=float, default=60)
    p.add_argument("--hang_at", type=int, default=0,
                   help="worker 1 stops calling collectives after this step")
    p.add_argument("--slurm_port_base", type=int, default=8888)
    p.add_argument("--backend", default="mwms", choices=["mwms", "mpi"])
    p.add_argument("--evaluate", action="store_true",
                   help="after fit, evaluate on 65 examples sharded so that "
                        "2 workers hold 3 and 2 batches")
    p.add_argument("--different_init", action="store_true",
                   help="seed each worker differently: the start must "
                        "still be the chief's weights")
    p.add_argument("--keras_fit", action="store_true",
                   help="train with model.fit + tfscale.enable_multi_worker_fit")
    p.add_argument("--dump_initial", action="store_true",
                   help="write the weights fit starts from (after restore)")
    p.add_argument("--crash_at", type=int, default=0,
                   help="exit(17) after this global step, once (marker file)")
    p.add_argument("--raise_at", type=int, default=0,
                   help="worker 1's callback raises after this global step "
                        "(first writing the time to raised_at.json)")
    p.add_argument("--tensorboard", default=None)
    p.add_argument("--backup_dir", default=None)
    p.add_argument("--gpu_branch", action="store_true",
                   help="tf.distribute's GPU branch (tests/gpu_branch.py)")
    p.add_argument("--log_steps", type=int, default=0,
                   help="the log interval (0: as --steps_per_execution says)")
    p.add_argument("--max_call_seconds", type=float, default=2.0)
    p.add_argument("--slow_input", type=float, default=0.0,
                   help="each batch this many seconds late (a step of at "
                        "least that length)")
    p.add_argument("--slow_worker", type=float, default=0.0,
                   help="worker 1's batches each this many seconds late (a "
                        "straggler)")
    p.add_argument("--progress", default=None,
                   help="a file each call's end appends its step to")
    args = p.parse_args(argv)

    tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(1)
    if args.gpu_branch:
        from tests import gpu_branch
        gpu_branch.take_gpu_branch()
    from absl import logging
    logging.set_verbosity(logging.INFO)  # the Trainer's "resumed from" lines
    try:
        info = cluster_lib.resolve_cluster(slurm_port_base=args.slurm_port_base,
                                           backend=args.backend)
    except cluster_lib.ClusterError as e:
        sys.exit(f"tfscale: error: {e}")
    if args.different_init:
        keras.utils.set_random_seed(1 + info.worker_index)
    config = cluster_lib.ClusterConfig(
        collective_timeout_seconds=args.collective_timeout or None,
        connect_timeout_seconds=args.connect_timeout,
        slurm_port_base=args.slurm_port_base, backend=args.backend)
    try:
        strategy = strategies.make_strategy(info, config)
    except cluster_lib.ClusterError as e:
        sys.exit(f"tfscale: error: {e}")
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(2)])
        if args.optimizer == "sgd":
            optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        elif args.optimizer == "adamw":
            optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.05)
            optimizer.exclude_from_weight_decay(var_names=["bias"])
        else:
            optimizer = Lamb(0.01, weight_decay_rate=0.01)
        metrics = [keras.metrics.MeanAbsoluteError(name="mae")]
    x, y = make_data()
    if args.keras_fit:
        return keras_fit(args, info, strategy, model, optimizer, x, y)
    train_config = trainer_lib.TrainConfig(
        global_batch_size=args.global_batch,
        num_accumulation_steps=args.accum, jit_compile=args.xla,
        clip_global_norm=args.clip,
        checkpoint_dir=(f"{args.checkpoint_dir}-{info.worker_index}"
                        if args.unshared_checkpoints and info.worker_index
                        else args.checkpoint_dir),
        save_checkpoints_steps=args.save_steps,
        log_steps=args.log_steps or (12 if args.steps_per_execution > 1
                                     else 2),
        timed_steps_per_log=(0 if args.log_steps else
                             1 if args.steps_per_execution > 1 else 4),
        steps_per_execution=args.steps_per_execution, verbose=2,
        max_call_seconds=args.max_call_seconds,
        shard_optimizer_state=args.shard)
    trainer = trainer_lib.Trainer(
        model=model, optimizer=optimizer,
        loss_fn=keras.losses.MeanSquaredError(), strategy=strategy,
        config=train_config, metrics=metrics,
        backend=collectives.make(args.backend, strategy,
                                 args.collective_timeout or None))

    micro = args.global_batch // args.accum

    def dataset_fn(context):
        per_replica = trainer.per_replica_batch_size
        start = context.input_pipeline_id * per_replica
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
            micro, drop_remainder=True).repeat()
        ds = ds.map(lambda a, b: (a[start:start + per_replica],
                                  b[start:start + per_replica]))
        late = args.slow_input or (
            args.slow_worker if context.input_pipeline_id == 1 else 0)
        if late:
            # tf.data's own sleep (its test op): the iterator still saves.
            from tensorflow.python.data.experimental.ops import testing
            ds = ds.apply(testing.sleep(int(late * 1e6)))
        return ds

    log = EventLog()
    callbacks = [log]
    if args.progress:
        class Progress(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                with open(args.progress, "a") as f:
                    f.write(f"{int(trainer.step.numpy())}\n")
        callbacks.append(Progress())
    if args.model_checkpoint:
        callbacks.append(keras.callbacks.ModelCheckpoint(
            args.model_checkpoint, save_weights_only=True))
    if args.csv:
        callbacks.append(keras.callbacks.CSVLogger(args.csv))
    if args.stop_at:
        callbacks.append(StopAt(args.stop_at, info.worker_index == 1))
    if args.dump_initial:
        class DumpInitial(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                np.savez(os.path.join(args.out,
                                      f"initial_{info.worker_index}.npz"),
                         *[v.numpy() for v in model.trainable_variables])
        callbacks.append(DumpInitial())
    if args.hang_at:
        class Hang(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if int(trainer.step.numpy()) == args.hang_at and \
                        info.worker_index == 1:
                    time.sleep(3600)
        callbacks.append(Hang())
    if args.crash_at:
        marker = os.path.join(args.out, "crashed")

        class Crash(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                step = int(trainer.step.numpy())
                if step == args.crash_at and not os.path.exists(marker) \
                        and info.worker_index == 1:
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
        callbacks.append(Crash())
    if args.tensorboard:
        callbacks.append(keras.callbacks.TensorBoard(args.tensorboard,
                                                     update_freq=2))
    if args.backup_dir:
        callbacks.append(keras.callbacks.BackupAndRestore(args.backup_dir))
    if args.raise_at:
        class Raise(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                step = int(trainer.step.numpy())
                if step == args.raise_at and info.worker_index == 1:
                    with open(os.path.join(args.out, "raised_at.json"),
                              "w") as f:
                        json.dump({"time": time.time(), "step": step}, f)
                    raise RuntimeError(f"injected failure at step {step}")
        callbacks.append(Raise())
    trainer.fit(dataset_fn, steps_per_epoch=args.steps, epochs=args.epochs,
                callbacks=callbacks)
    evaluation = None
    if args.evaluate:
        def eval_fn(context):
            ds = tf.data.Dataset.from_tensor_slices((x[:65], y[:65]))
            ds = ds.shard(context.num_input_pipelines,
                          context.input_pipeline_id)
            return ds.batch(context.get_per_replica_batch_size(32))
        evaluation = trainer.evaluate(eval_fn)
    index = info.worker_index
    np.savez(os.path.join(args.out, f"weights_{index}.npz"),
             *[v.numpy() for v in model.trainable_variables])
    with open(os.path.join(args.out, f"events_{index}.json"), "w") as f:
        json.dump({"events": log.events, "step": int(trainer.step.numpy()),
                   "is_chief": trainer.is_chief, "eval": evaluation,
                   "intervals": trainer.intervals}, f)


def keras_fit(args, info, strategy, model, optimizer, x, y):
    """Plain model.fit under the strategy, with tfscale's switch."""
    import tfscale
    tfscale.enable_multi_worker_fit()
    with strategy.scope():
        model.compile(optimizer=optimizer, loss="mse")
    per_worker = args.global_batch // info.num_workers
    start = info.worker_index * per_worker

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
            args.global_batch, drop_remainder=True).repeat()
        return ds.map(lambda a, b: (a[start:start + per_worker],
                                    b[start:start + per_worker]))

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    callbacks = []
    if args.raise_at:
        class Raise(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch + 1 == args.raise_at and info.worker_index == 1:
                    with open(os.path.join(args.out, "raised_at.json"),
                              "w") as f:
                        json.dump({"time": time.time(), "step": batch + 1},
                                  f)
                    raise RuntimeError(
                        f"injected failure at step {batch + 1}")
        callbacks.append(Raise())
    history = model.fit(dataset, steps_per_epoch=args.steps, epochs=1,
                        verbose=0, callbacks=callbacks)
    np.savez(os.path.join(args.out, f"weights_{info.worker_index}.npz"),
             *[v.numpy() for v in model.trainable_variables])
    with open(os.path.join(args.out, f"events_{info.worker_index}.json"),
              "w") as f:
        json.dump({"loss": history.history["loss"]}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
