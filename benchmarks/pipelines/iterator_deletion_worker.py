"""One worker of benchmarks/pipelines/iterator_deletion.py (started by launch.local).

MultiWorkerMirroredStrategy from TF_CONFIG; this worker's share of the image
training pipeline; each step takes a batch, all-reduces one number over the
workers and then keeps the CPU busy with matrix products for
`--busy_seconds`, as training would; the iterator is checkpointed every 10
steps, as the Trainer does.
Then the iterator is deleted on the main thread and the deletion timed.
Writes `{"worker": i, "delete_seconds": s}` to `--result_file.<i>`.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

from input_pipelines import images, tfrecord  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", required=True, help="records glob")
    parser.add_argument("--autotune", type=int, choices=(0, 1), default=1,
                        help="tf.data autotuning on (1) or off (0)")
    parser.add_argument("--steps", type=int, default=40,
                        help="steps it trains")
    parser.add_argument("--busy_seconds", type=float, default=1.0,
                        help="seconds the input pipeline keeps busy before "
                             "the end")
    parser.add_argument("--checkpoint_dir", required=True,
                        help="where it saves the input iterator")
    parser.add_argument("--result_file", required=True,
                        help="where this worker writes its timings as JSON "
                             "(the benchmark that starts it sets it)")
    args = parser.parse_args()

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    index = resolver.task_id
    workers = len(resolver.cluster_spec().as_dict().get("worker", [])) or 1
    config = tfrecord.TFRecordConfig(input_files=args.records, seed=3,
                                     deterministic=True)
    context = tf.distribute.InputContext(workers, index, workers)
    dataset = images.make_dataset(
        config, images.ImageSpec(image_size=32, num_classes=10), 8, context)
    if not args.autotune:
        options = tf.data.Options()
        options.autotune.enabled = False
        dataset = dataset.with_options(options)
    with tf.device("/cpu:0"):
        iterator = iter(dataset)
    with strategy.scope():
        total = tf.Variable(0.0)

    @tf.function
    def step(labels):
        def replica_fn(labels):
            context = tf.distribute.get_replica_context()
            total.assign_add(context.all_reduce(
                "sum", tf.reduce_sum(tf.cast(labels, tf.float32))))
        strategy.run(replica_fn, args=(labels,))

    @tf.function
    def busy(a):
        for _ in range(20):
            a = tf.matmul(a, a) / 256.0
        return a

    checkpoint = tf.train.Checkpoint(iterator=iterator)
    prefix = os.path.join(args.checkpoint_dir, f"worker-{index}", "input")
    for i in range(args.steps):
        step(tf.nest.flatten(next(iterator))[-1])
        start = time.time()
        while time.time() - start < args.busy_seconds:
            busy(tf.ones([256, 256]))
        if i % 10 == 9:
            checkpoint.write(prefix)
    del checkpoint
    start = time.perf_counter()
    del iterator
    seconds = time.perf_counter() - start
    step(tf.zeros([8], tf.int64))  # the next collective, as after `fit`
    with open(f"{args.result_file}.{index}", "w") as f:
        json.dump({"worker": index, "delete_seconds": seconds}, f)


if __name__ == "__main__":
    main()
