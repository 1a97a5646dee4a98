"""A worker for the noise scale's truth test: softmax regression on TFRecords.

Started through `launch.local`. Reads records of (x: float [D], y: int64)
through the toolkit's record pipeline in the global order (shuffled), starts
from the weights in --init, and trains with the Trainer at learning rate 0,
so the weights stay where the exact noise scale was computed and the
Trainer's moving averages settle on its estimate there. The chief writes
the Trainer's noise scale summary to --out.
"""

import argparse
import json
import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from input_pipelines import dataset_fns, tfrecord# noqa: E402
from tfscale import jobs  # noqa: E402
from tfscale.cluster import ClusterConfig  # noqa: E402
from tfscale.noise_scale import NoiseScaleConfig  # noqa: E402
from tfscale.train_config import TrainConfig  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--global_batch", type=int, default=32)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--decay", type=float, default=0.995)
    args = parser.parse_args()

    init = np.load(args.init)
    features, classes = init["kernel"].shape
    cluster = ClusterConfig()
    info, strategy = jobs.start_worker(cluster, output_dir=os.path.dirname(
        args.out), precision="float32", seed=1, deterministic=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((features,)),
                                  keras.layers.Dense(classes)])
        model.layers[0].set_weights([init["kernel"], init["bias"]])
        optimizer = keras.optimizers.SGD(0.0)
    trainer = jobs.make_trainer(
        model=model, optimizer=optimizer,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        strategy=strategy, metrics=[], cluster=cluster,
        train=TrainConfig(global_batch_size=args.global_batch,
                          num_accumulation_steps=args.accumulation,
                          log_steps=100, verbose=0,
                          noise_scale=NoiseScaleConfig(decay=args.decay)))
    parse = tfrecord.make_parse_fn(
        {"x": tf.io.FixedLenFeature([features], tf.float32),
         "y": tf.io.FixedLenFeature([], tf.int64)},
        lambda f: (f["x"], f["y"]))
    dataset_fn = dataset_fns.make_dataset_fn(
        tfrecord.TFRecordConfig(args.records, training=True, seed=7),
        lambda config, context, start: tfrecord.make_dataset(
            config, trainer.per_replica_batch_size, parse, context, start))
    trainer.fit(dataset_fn, steps_per_epoch=args.steps, epochs=1)
    if info.is_chief:
        with open(args.out, "w") as f:
            json.dump({"noise_scale": trainer.noise_scale.summary(),
                       "micro_batches": trainer.num_workers
                       * args.accumulation}, f)
    trainer.leave_together()


if __name__ == "__main__":
    main()
