"""Horovod's synthetic benchmark shape on tfscale.horovod: images/s of a
Keras application (ResNet-50) on random data, gradients averaged by
`DistributedGradientTape`, optionally sent as float16.

    tfscale-run -np 2 -H localhost:2 python examples/horovod/synthetic_benchmark.py \
        --image-size 96 --batch-size 16 --fp16-allreduce

`--image-size` (224 in Horovod's) and `--json-out` are this script's own.
"""

import argparse
import json
import timeit

import numpy as np
import tensorflow as tf

import tfscale.horovod as hvd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--model", default="ResNet50")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-warmup-batches", type=int, default=10)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    model = getattr(tf.keras.applications, args.model)(
        weights=None, input_shape=(args.image_size, args.image_size, 3))
    opt = tf.keras.optimizers.SGD(0.01)
    data = tf.random.uniform([args.batch_size, args.image_size,
                              args.image_size, 3])
    target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999,
                               dtype=tf.int64)
    compression = (hvd.Compression.fp16 if args.fp16_allreduce
                   else hvd.Compression.none)

    def benchmark_step(first_batch):
        with tf.GradientTape() as tape:
            probs = model(data, training=True)
            loss = tf.reduce_mean(
                tf.keras.losses.sparse_categorical_crossentropy(target,
                                                                probs))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)

    if not args.eager:
        benchmark_step = tf.function(benchmark_step)

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    device = "GPU" if gpus else "CPU"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")
    log("Running warmup...")
    benchmark_step(first_batch=True)
    timeit.timeit(lambda: benchmark_step(first_batch=False),
                  number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(lambda: benchmark_step(first_batch=False),
                                number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): "
        f"{hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    weights = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    spread = float(tf.reduce_max(hvd.allreduce(weights, op=hvd.Max)
                                 - hvd.allreduce(weights, op=hvd.Min)))
    log(f"Weight spread across ranks: {spread:.3g}")
    if args.json_out and hvd.rank() == 0:
        with open(args.json_out, "w") as f:
            json.dump({"images_per_second": hvd.size() * mean,
                       "per_rank": img_secs, "size": hvd.size(),
                       "batch_size": args.batch_size,
                       "image_size": args.image_size,
                       "fp16_allreduce": args.fp16_allreduce,
                       "weight_spread": spread}, f)


if __name__ == "__main__":
    main()
