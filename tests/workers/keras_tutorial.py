"""TensorFlow's "Multi-worker training with Keras" tutorial, in Keras 3.

The tutorial's flow, unchanged but for the line that switches tfscale on:
MultiWorkerMirroredStrategy from TF_CONFIG, the tutorial's CNN compiled in
its scope, `fit` on a dataset of global batches, and its callbacks
(BackupAndRestore, ModelCheckpoint, TensorBoard, plus CSVLogger). With
`--mode=trainer` the same script calls `trainer.fit` with the same arguments.
MNIST-shaped data is generated (no downloads): each label is the brightest of
ten image bands, so the CNN has something to learn.

Each worker saves its final weights to `<out>/weights_<index>.npz` and the
epochs it started to `<out>/epochs_<index>.txt`. `--kill_at_epoch=E` makes
worker 1 kill itself (SIGKILL) in the middle of epoch E, the first time only;
`--term_at_epoch=E` sends it SIGTERM there instead (a scheduler preempting
its node), and `--no_backup` leaves BackupAndRestore out.
"""

import argparse
import json
import os
import signal

import keras
import numpy as np
import tensorflow as tf

import tfscale


def mnist_like(n: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    x = rng.randint(0, 256, size=(n, 28, 28)).astype("float32") / 255.0
    bands = x[:, :, :20].reshape(n, 28, 10, 2).mean(axis=(1, 3))
    return x, bands.argmax(axis=1).astype("int64")


def build_and_compile_cnn_model():
    model = keras.Sequential([
        keras.Input(shape=(28, 28)),
        keras.layers.Reshape(target_shape=(28, 28, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.SGD(learning_rate=0.05),
        metrics=["accuracy"])
    return model


class EpochLog(keras.callbacks.Callback):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_epoch_begin(self, epoch, logs=None):
        with open(self.path, "a") as f:
            f.write(f"{epoch}\n")


class KillMidEpoch(keras.callbacks.Callback):
    """SIGKILL (or `sig`) in the middle of an epoch: by then the chief has
    written the previous epoch's backup (the batches' collectives wait for
    it)."""

    def __init__(self, epoch, marker, sig=signal.SIGKILL):
        super().__init__()
        self.epoch, self.marker, self.current = epoch, marker, 0
        self.sig = sig

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == 3 and not os.path.exists(
                self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), self.sig)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["fit", "trainer"], default="fit")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global_batch", type=int, default=64)
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--kill_at_epoch", type=int, default=-1)
    parser.add_argument("--term_at_epoch", type=int, default=-1)
    parser.add_argument("--no_backup", action="store_true")
    args = parser.parse_args()
    tf_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    index = tf_config.get("task", {}).get("index", 0)

    tfscale.enable_multi_worker_fit()  # the one added line
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras.utils.set_random_seed(1)
    x, y = mnist_like(args.examples)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        args.global_batch)
    with strategy.scope():
        model = build_and_compile_cnn_model()

    out = args.out
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(out, "ckpt", "epoch{epoch:02d}.weights.h5"),
            save_weights_only=True),
        keras.callbacks.TensorBoard(log_dir=os.path.join(out, "tensorboard")),
        keras.callbacks.CSVLogger(os.path.join(out, "log.csv")),
        keras.callbacks.EarlyStopping(monitor="loss", patience=100),
        EpochLog(os.path.join(out, f"epochs_{index}.txt")),
    ]
    if not args.no_backup:
        callbacks.insert(0, keras.callbacks.BackupAndRestore(
            backup_dir=os.path.join(out, "backup"), delete_checkpoint=False))
    if index == 1 and args.kill_at_epoch >= 0:
        callbacks.append(KillMidEpoch(args.kill_at_epoch,
                                      os.path.join(out, "killed")))
    if index == 1 and args.term_at_epoch >= 0:
        callbacks.append(KillMidEpoch(args.term_at_epoch,
                                      os.path.join(out, "termed"),
                                      signal.SIGTERM))
    if args.mode == "fit":
        model.fit(dataset, epochs=args.epochs, callbacks=callbacks, verbose=2)
    else:
        trainer = tfscale.Trainer.from_compiled(
            model, tfscale.TrainConfig(global_batch_size=args.global_batch,
                                       log_steps=8))
        trainer.fit(dataset, epochs=args.epochs, callbacks=callbacks,
                    verbose=2)
    np.savez(os.path.join(out, f"weights_{index}.npz"),
             *[v.numpy() for v in model.trainable_variables])


if __name__ == "__main__":
    main()
