"""A Trainer run with Keras's BackupAndRestore (one backup per epoch) in one
process. With --kill_at N the N-th backup's weights are written, cut to half
their bytes and the process SIGKILLs itself: a worker killed while writing
its backup. Writes {"first_step", "last_step"} to --out when it ends."""

import argparse
import json
import os
import signal

import keras
import numpy as np
import tensorflow as tf

from tfscale.trainer import TrainConfig, Trainer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backup_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill_at", type=int, default=0)
    args = p.parse_args()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.Adam(0.01)
    trainer = Trainer(model=model, optimizer=optimizer,
                      loss_fn=keras.losses.MeanSquaredError(),
                      strategy=strategy,
                      config=TrainConfig(global_batch_size=16, verbose=0))
    saves = []
    save_weights = model.save_weights

    def save(filepath, overwrite=True, **kwargs):
        saves.append(filepath)
        save_weights(filepath, overwrite=overwrite, **kwargs)
        if len(saves) == args.kill_at:
            with open(filepath, "r+b") as f:
                f.truncate(os.path.getsize(filepath) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
    model.save_weights = save
    rng = np.random.RandomState(0)
    x = rng.randn(64, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    class FirstStep(keras.callbacks.Callback):
        first = None

        def on_train_batch_begin(self, batch, logs=None):
            if FirstStep.first is None:
                FirstStep.first = int(trainer.step.numpy())

    trainer.fit(lambda context: tf.data.Dataset.from_tensor_slices(
        (x, y)).repeat().batch(16), steps_per_epoch=3, epochs=4,
        callbacks=[keras.callbacks.BackupAndRestore(args.backup_dir),
                   FirstStep()])
    with open(args.out, "w") as f:
        json.dump({"first_step": FirstStep.first,
                   "last_step": int(trainer.step.numpy())}, f)


if __name__ == "__main__":
    main()
