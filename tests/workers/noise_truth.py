"""A worker for the noise scale's truth test: softmax regression on TFRecords,
as a job of its own on tfscale's skeleton (`tfscale.jobs.run`).

Started through `launch.local`. Reads records of (x: float [D], y: int64)
through the toolkit's record pipeline in the global order (shuffled), starts
from the weights in --init, and trains at learning rate 0 (its own
optimizer), so the weights stay where the exact noise scale was computed
and the Trainer's moving averages settle on its estimate there. The chief
writes `summary.json` (with the noise scale) to --output_dir.
"""

import argparse
import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from input_pipelines import dataset_fns, tfrecord  # noqa: E402
from tfscale import jobs  # noqa: E402
from tfscale.cluster.environment import ClusterConfig  # noqa: E402
from tfscale.noise.scale import NoiseScaleConfig  # noqa: E402
from tfscale.optim import OptimConfig  # noqa: E402
from tfscale.train_config import TrainConfig  # noqa: E402


class SoftmaxAtRest(jobs.Task):
    """Softmax regression from given weights, never moving them."""

    title = "noise_truth"

    def __init__(self, config, records: str, init: dict):
        super().__init__(config)
        self.records, self.init = records, init

    def build(self) -> jobs.Built:
        features, classes = self.init["kernel"].shape
        model = keras.Sequential([keras.Input((features,)),
                                  keras.layers.Dense(classes)])
        model.layers[0].set_weights([self.init["kernel"], self.init["bias"]])
        return jobs.Built(
            model, keras.losses.SparseCategoricalCrossentropy(
                from_logits=True),
            optimizer=keras.optimizers.SGD(0.0))

    def dataset_fn(self, per_replica_batch, training):
        features = self.init["kernel"].shape[0]
        parse = tfrecord.make_parse_fn(
            {"x": tf.io.FixedLenFeature([features], tf.float32),
             "y": tf.io.FixedLenFeature([], tf.int64)},
            lambda f: (f["x"], f["y"]))
        return dataset_fns.make_dataset_fn(
            tfrecord.TFRecordConfig(self.records, training=True, seed=7),
            lambda config, context, start: tfrecord.make_dataset(
                config, per_replica_batch, parse, context, start))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--global_batch", type=int, default=32)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--decay", type=float, default=0.995)
    args = parser.parse_args()

    config = jobs.JobConfig(
        optim=OptimConfig(optimizer="sgd", total_steps=args.steps),
        cluster=ClusterConfig(),
        train=TrainConfig(global_batch_size=args.global_batch,
                          num_accumulation_steps=args.accumulation,
                          log_steps=100, verbose=0,
                          checkpoint_dir=os.path.join(args.output_dir,
                                                      "checkpoints"),
                          save_checkpoints_steps=10**9,
                          noise_scale=NoiseScaleConfig(decay=args.decay)),
        output_dir=args.output_dir, seed=1)
    jobs.run(SoftmaxAtRest(config, args.records, dict(np.load(args.init))))


if __name__ == "__main__":
    main()
