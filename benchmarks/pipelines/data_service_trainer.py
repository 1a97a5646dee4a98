"""One trainer of `benchmarks/pipelines/data_service.py`: reads training batches (from
its own pipeline or from a tf.data service) into a minimal step and prints
one JSON line: images/s reaching the step and this process's CPU seconds
per image, over the measured batches only.

    python -m benchmarks.pipelines.data_service_trainer --files 'runs/x/train-*' \
        [--data_service localhost:5050] --batch_size 64 --batches 100
"""

import argparse
import json
import time

import tensorflow as tf

from input_pipelines import images, service, tfrecord


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", required=True,
                   help="record files (a glob)")
    p.add_argument("--data_service", default=None,
                   help="the tf.data service's dispatcher, host:port (none: "
                        "local input)")
    p.add_argument("--compression", default="none",
                   choices=service.COMPRESSIONS,
                   help="the service's compression of its elements")
    p.add_argument("--job_name", default="benchmark",
                   help="the service's shared job name")
    p.add_argument("--order", default="global", choices=tfrecord.ORDERS,
                   help="local input's record order")
    p.add_argument("--max_outstanding_requests", type=int, default=None,
                   help="requests in flight to the service's workers (none: "
                        "tf.data's default)")
    p.add_argument("--image_size", type=int, default=224,
                   help="image side in pixels")
    p.add_argument("--num_classes", type=int, default=10,
                   help="classes of the synthetic images")
    p.add_argument("--batch_size", type=int, default=64,
                   help="examples a batch")
    p.add_argument("--batches", type=int, default=100,
                   help="batches timed")
    p.add_argument("--warmup_batches", type=int, default=10,
                   help="batches read first, untimed")
    args = p.parse_args(argv)

    config = None
    if args.data_service:
        config = service.ServiceConfig(args.data_service,
                                       job_name=args.job_name,
                                       compression=args.compression,
                                       max_outstanding_requests=(
                                           args.max_outstanding_requests))
    records = tfrecord.TFRecordConfig(
        args.files, training=True, seed=1,
        order="sharded" if config else args.order, service=config)
    spec = images.ImageSpec(image_size=args.image_size,
                            num_classes=args.num_classes)
    iterator = iter(images.make_dataset_fn(records, spec,
                                           args.batch_size)(None))

    @tf.function
    def step(batch):
        # The batch is in this process; a model would now read it (its cost
        # is the model's, the same however the batch came).
        pixels, labels = batch
        return tf.cast(pixels[0, 0, 0, 0], tf.int32) + tf.reduce_sum(labels)

    for _ in range(args.warmup_batches):
        step(next(iterator)).numpy()
    cpu, start = time.process_time(), time.perf_counter()
    for _ in range(args.batches):
        step(next(iterator)).numpy()
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    count = args.batches * args.batch_size
    print(json.dumps({"images_per_second": count / seconds,
                      "cpu_ms_per_image": 1000 * cpu / count,
                      "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
