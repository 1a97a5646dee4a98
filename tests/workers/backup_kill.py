"""A Trainer run (or with --keras_fit, Keras's `model.fit` after
`tfscale.enable_multi_worker_fit()`) with Keras's BackupAndRestore (one
backup per epoch) in one process. With --kill_at N the N-th backup's weights
are written, cut to half their bytes and the process SIGKILLs itself: a
worker killed while writing its backup. With --kill_before_replace N it
SIGKILLs itself just before the N-th rename into the backup folder. Writes
{"first_step", "last_step", "restored": the weights the first step starts
from, "epochs": {epoch: the weights at its end}} to --out when it ends,
and each epoch's weights to --out.epoch-N.json as it ends."""

import argparse
import json
import os
import signal

import keras
import numpy as np
import tensorflow as tf

from tfscale.trainer.loop import TrainConfig, Trainer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backup_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill_at", type=int, default=0)
    p.add_argument("--kill_before_replace", type=int, default=0)
    p.add_argument("--keras_fit", action="store_true")
    args = p.parse_args()
    replaces = []
    replace = os.replace

    def replace_or_die(source, target):
        if os.path.dirname(os.path.abspath(target)) == os.path.abspath(
                args.backup_dir):
            replaces.append(target)
            if len(replaces) == args.kill_before_replace:
                os.kill(os.getpid(), signal.SIGKILL)
        replace(source, target)
    os.replace = replace_or_die
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

        restored = None
        epochs = {}

        def on_epoch_end(self, epoch, logs=None):
            # Before the backup's own on_epoch_end, and on disk at once: a
            # run killed in its backup has these too.
            FirstStep.epochs[epoch + 1] = [w.tolist()
                                           for w in model.get_weights()]
            with open(f"{args.out}.epoch-{epoch + 1}.json", "w") as f:
                json.dump(FirstStep.epochs[epoch + 1], f)

        def on_train_batch_begin(self, batch, logs=None):
            if FirstStep.first is None:
                FirstStep.restored = [w.tolist() for w in model.get_weights()]
                FirstStep.first = int((optimizer.iterations if args.keras_fit
                                       else trainer.step).numpy())

    callbacks = [FirstStep(),
                 keras.callbacks.BackupAndRestore(args.backup_dir)]
    if args.keras_fit:
        import tfscale
        tfscale.enable_multi_worker_fit()
        model.compile(optimizer=optimizer, loss="mse")
        step = optimizer.iterations
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            16), steps_per_epoch=3, epochs=4, callbacks=callbacks, verbose=0)
    else:
        step = trainer.step
        trainer.fit(lambda context: tf.data.Dataset.from_tensor_slices(
            (x, y)).repeat().batch(16), steps_per_epoch=3, epochs=4,
            callbacks=callbacks)
    with open(args.out, "w") as f:
        json.dump({"first_step": FirstStep.first,
                   "last_step": int(step.numpy()),
                   "restored": FirstStep.restored,
                   "epochs": FirstStep.epochs}, f)


if __name__ == "__main__":
    main()
