"""A custom GradientTape loop on every rank, Horovod style (tfscale.horovod).

    tfscale-run -np 2 -H localhost:2 python examples/horovod/tape_mnist.py

The shape of Horovod's TF2 MNIST example: the tape is wrapped after the
forward pass, and the compiled step broadcasts the model's and the
optimizer's variables from rank 0 on the first batch (after the optimizer
has made its slots), inside the `tf.function`.
"""

import argparse
import os

import numpy as np
import tensorflow as tf

import tfscale.horovod as hvd


def digits(count, seed):
    patterns = np.random.default_rng(0).uniform(size=(10, 28, 28, 1))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=count)
    images = patterns[labels] + 0.5 * rng.normal(size=(count, 28, 28, 1))
    return images.astype(np.float32), labels.astype(np.int64)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-dir", default="runs/horovod_tape")
    args = parser.parse_args()

    hvd.init()
    images, labels = digits(args.steps * args.batch_size, seed=hvd.rank())
    dataset = (tf.data.Dataset.from_tensor_slices((images, labels))
               .repeat().shuffle(1000, seed=hvd.rank())
               .batch(args.batch_size))

    tf.keras.utils.set_random_seed(1234 + hvd.rank())  # differ until broadcast
    model = tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.Adam(0.001 * hvd.size())
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = model(images, training=True)
            loss_value = loss(labels, probs)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Broadcast after the first step, so the optimizer's slots exist.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)
        return loss_value

    for batch, (x, y) in enumerate(dataset.take(args.steps)):
        loss_value = training_step(x, y, batch == 0)
        if batch % 10 == 0 and hvd.rank() == 0:
            print(f"Step #{batch}\tLoss: {float(loss_value):.6f}")

    # The weights are the same on every rank: say so, then save once.
    weights = tf.concat([tf.reshape(v, [-1]) for v in model.variables], 0)
    spread = hvd.allreduce(weights, op=hvd.Max) - hvd.allreduce(
        weights, op=hvd.Min)
    if hvd.rank() == 0:
        print(f"final: loss {float(loss_value):.4f} weight spread across "
              f"ranks {float(tf.reduce_max(spread)):.3g}")
        checkpoint.save(os.path.join(args.checkpoint_dir, "ckpt"))


if __name__ == "__main__":
    main()
