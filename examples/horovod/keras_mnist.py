"""Keras `fit` on every rank, Horovod style (tfscale.horovod.keras).

    tfscale-run -np 2 -H localhost:2 python examples/horovod/keras_mnist.py

The shape of Horovod's Keras MNIST example: scale the learning rate by the
number of ranks, wrap the optimizer, broadcast rank 0's weights, average
the metrics, warm the learning rate up, and checkpoint on rank 0 only.
"""

import argparse
import os

import numpy as np
import tensorflow as tf

import tfscale.horovod.keras as hvd


def digits(count, seed):
    """MNIST-shaped (28x28x1 float, labels 0-9): ten fixed patterns plus
    noise, made here."""
    patterns = np.random.default_rng(0).uniform(size=(10, 28, 28, 1))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=count)
    images = patterns[labels] + 0.5 * rng.normal(size=(count, 28, 28, 1))
    return images.astype(np.float32), labels.astype(np.int64)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--checkpoint-dir", default="runs/horovod_keras")
    args = parser.parse_args()

    hvd.init()
    images, labels = digits(args.steps_per_epoch * args.batch_size,
                            seed=hvd.rank())
    dataset = (tf.data.Dataset.from_tensor_slices((images, labels))
               .repeat().shuffle(1000, seed=hvd.rank())
               .batch(args.batch_size))

    model = tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Dense(10),
    ])
    scaled_lr = args.lr * hvd.size()
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(scaled_lr))
    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    ]
    if hvd.rank() == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.weights.h5"),
            save_weights_only=True))

    history = model.fit(dataset, steps_per_epoch=args.steps_per_epoch,
                        epochs=args.epochs, callbacks=callbacks,
                        verbose=1 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0:
        print(f"final: loss {history.history['loss'][-1]:.4f} accuracy "
              f"{history.history['accuracy'][-1]:.4f} "
              f"lr {history.history['lr'][-1]:.6f}")


if __name__ == "__main__":
    main()
