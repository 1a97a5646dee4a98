"""A user's Trainer script for the preemption tests of each phase of a run.

    --mode first_call   the first batch is slow to come (a stand-in for a
                        long trace and compilation: the main thread waits
                        inside TensorFlow's first call); `--out/in_first_call`
                        appears when it starts waiting, `first_batch` when
                        the batch was delivered
    --mode slow_exit    trains until signalled; a `Preempted` is caught and
                        the script then sleeps (an exit that stalls after a
                        complete save), `--out/training` appears once it
                        trains
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfscale  # noqa: E402
from tfscale.resume.preemption import Preempted  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True,
                        choices=["first_call", "slow_exit"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint_dir", default=None)
    args = parser.parse_args()
    strategy = tfscale.make_strategy(tfscale.resolve_cluster(),
                                     tfscale.ClusterConfig())
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    trainer = tfscale.Trainer.from_compiled(model, tfscale.TrainConfig(
        global_batch_size=8, checkpoint_dir=args.checkpoint_dir,
        steps_per_execution=4, max_call_seconds=0.2, verbose=0))
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")

    def mark(name):
        open(os.path.join(args.out, name), "w").close()

    def slow_first(value):
        # (tf.data calls it once per element; the first one waits.)
        if not os.path.exists(os.path.join(args.out, "in_first_call")):
            mark("in_first_call")
            time.sleep(60)
            mark("first_batch")
        return value

    def dataset_fn(context):
        data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat()
        if args.mode == "first_call":
            data = data.map(lambda a, b: (tf.numpy_function(
                slow_first, [a], tf.float32, stateful=True), b))
            data = data.map(lambda a, b: (tf.ensure_shape(a, [4]), b))
        return data.batch(trainer.per_replica_batch_size)

    class Training(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not os.path.exists(os.path.join(args.out, "training")):
                mark("training")

    try:
        trainer.fit(dataset_fn, steps_per_epoch=10**7, epochs=1,
                    callbacks=[Training()])
    except Preempted:
        if args.mode == "slow_exit":
            print("caught Preempted: sleeping", flush=True)
            time.sleep(120)
        raise
    sys.exit(0)


if __name__ == "__main__":
    main()
