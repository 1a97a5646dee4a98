"""One worker of a scaling measurement (started by benchmarks.scaling.study).

Trains a benchmark model on synthetic in-memory data (resnet50: real JPEG
records through the image pipeline) with the Trainer for
--warmup_steps, then --steps more, and the chief writes the Trainer's report
of the measured steps (throughput, step time, time split) and the gradient
bytes all-reduced per step to --result_file as JSON.
"""

import argparse
import json
import sys

import keras
import numpy as np
import tensorflow as tf

from input_pipelines import images, tfrecord
from models import benchmark_models, bert, bert_config
from tfscale.cluster import environment as cluster_lib
from tfscale.cluster import strategies
from tfscale.cluster import collectives
from tfscale import precision
from tfscale.trainer.loop import TrainConfig, Trainer


def model_and_data(name: str, batch_size: int, image_records=None,
                   image_size=224):
    """(make_model, loss_fn, dataset_fn of per-replica batches of
    `batch_size`): one synthetic batch repeated, or for resnet50 real JPEG
    records through the image pipeline."""
    if name == "resnet50":
        spec = images.ImageSpec(image_size=image_size, num_classes=10)
        records = tfrecord.TFRecordConfig(image_records, training=True,
                                          seed=0, shuffle_buffer_size=256)
        return (lambda: benchmark_models.make_resnet50(
                    benchmark_models.ResNetConfig(image_size, 10, "uint8")),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                images.make_dataset_fn(records, spec, batch_size))
    if name == "resnet50_synthetic":
        # Horovod's synthetic benchmark: keras.applications ResNet-50 (1000
        # classes, softmax) on one random batch.
        data = tf.random.stateless_uniform(
            [batch_size, image_size, image_size, 3], seed=[0, 0])
        target = tf.random.stateless_uniform(
            [batch_size, 1], seed=[0, 1], minval=0, maxval=999,
            dtype=tf.int64)
        return (lambda: keras.applications.ResNet50(
                    weights=None, input_shape=(image_size, image_size, 3)),
                keras.losses.SparseCategoricalCrossentropy(),
                lambda context: tf.data.Dataset.from_tensors(
                    (data, target)).repeat())
    make_model, loss_fn, batch = _synthetic(name, batch_size)
    return (make_model, loss_fn,
            lambda context: tf.data.Dataset.from_tensors(batch).repeat())


def _synthetic(name: str, batch_size: int):
    """(make_model, loss_fn, one synthetic batch of `batch_size`)."""
    rng = np.random.RandomState(0)
    if name == "bert_tiny":
        config = bert_config.preset("bert_tiny", vocab_size=8000)
        seq, pred = 128, 20
        inputs = {"input_ids": rng.randint(5, 8000, (batch_size, seq)),
                  "input_mask": np.ones((batch_size, seq)),
                  "segment_ids": np.zeros((batch_size, seq)),
                  "masked_lm_positions": rng.randint(1, seq, (batch_size, pred))}
        labels = {"masked_lm_ids": rng.randint(5, 8000, (batch_size, pred)),
                  "masked_lm_weights": np.ones((batch_size, pred)),
                  "next_sentence_labels": rng.randint(0, 2, (batch_size, 1))}
        inputs = {k: v.astype("int32") for k, v in inputs.items()}
        labels = {k: v.astype("float32" if "weights" in k else "int32")
                  for k, v in labels.items()}
        return (lambda: bert.make_pretrainer(config, seq, pred),
                bert.pretraining_loss, (inputs, labels))
    mse = keras.losses.MeanSquaredError()
    if name == "materials_mlp":
        x = rng.randn(batch_size, 200, 3).astype("float32")
        y = rng.randn(batch_size, 2).astype("float32")
        return benchmark_models.make_materials_mlp, mse, (x, y)
    if name == "gru":
        config = benchmark_models.GruConfig()
        x = rng.randn(batch_size, config.timesteps, config.features)
        y = rng.randn(batch_size, config.timesteps, 1)
        return (benchmark_models.make_stacked_gru, mse,
                (x.astype("float32"), y.astype("float32")))
    raise ValueError(f"unknown model {name!r}")


class _Report(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = None

    def on_interval_end(self, step, numbers):
        self.logs = dict(numbers)


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="materials_mlp",
                   help="the model")
    p.add_argument("--global_batch_size", type=int, required=True,
                   help="global batch a step")
    p.add_argument("--steps", type=int, default=50,
                   help="steps timed in each run")
    p.add_argument("--warmup_steps", type=int, default=10,
                   help="steps run first, untimed (tracing, compilation)")
    p.add_argument("--xla", action="store_true",
                   help="compile the step with XLA")
    p.add_argument("--precision", default="float32",
                   help="the step's Keras dtype policy")
    p.add_argument("--bytes_per_pack", type=int, default=0,
                   help="all-reduce pack size in bytes (0: one pack)")
    p.add_argument("--timed_steps", type=int, default=10,
                   help="steps timed part by part for the time split")
    p.add_argument("--result_file", required=True,
                   help="where this worker writes its timings as JSON (the "
                        "benchmark that starts it sets it)")
    p.add_argument("--backend", default="mwms", choices=["mwms", "mpi"],
                   help="how workers sum gradients: mwms "
                        "(MultiWorkerMirroredStrategy) or mpi (MPI.Allreduce)")
    p.add_argument("--mpi_bucket_bytes", type=int, default=0,
                   help="MPI: all-reduce buckets of this size in reverse "
                        "layer order (0: one fused buffer)")
    p.add_argument("--image_records", default=None,
                   help="resnet50: JPEG records (glob)")
    p.add_argument("--image_size", type=int, default=224,
                   help="image side in pixels")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"],
                   help="sgd: SGD(0.01), as Horovod's synthetic benchmark")
    args = p.parse_args(argv)

    info = cluster_lib.resolve_cluster(backend=args.backend)
    config = cluster_lib.ClusterConfig(backend=args.backend,
                                       bytes_per_pack=args.bytes_per_pack)
    strategy = strategies.make_strategy(info, config)
    precision.set_precision(args.precision)
    replicas = strategy.num_replicas_in_sync * (
        info.num_workers if args.backend == "mpi" else 1)
    per_replica = args.global_batch_size // replicas
    make_model, loss_fn, dataset_fn = model_and_data(
        args.model, per_replica, args.image_records, args.image_size)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = make_model()
        optimizer = (keras.optimizers.SGD(0.01) if args.optimizer == "sgd"
                     else keras.optimizers.Adam(1e-4))
    trainer = Trainer(
        model=model, optimizer=optimizer, loss_fn=loss_fn, strategy=strategy,
        config=TrainConfig(global_batch_size=args.global_batch_size,
                           jit_compile=args.xla, precision=args.precision,
                           log_steps=args.steps,
                           timed_steps_per_log=args.timed_steps, verbose=0),
        backend=collectives.make(args.backend, strategy,
                                 bucket_bytes=args.mpi_bucket_bytes))
    report = _Report()
    # Warmup (tracing, XLA compilation), then the measured fit. The warmup
    # spans a whole log interval, so that it traces both the fused step and
    # the part-by-part one of the timed steps (otherwise the first timed
    # steps of the measured fit would trace, counted in its step time).
    trainer.fit(dataset_fn,
                steps_per_epoch=max(args.warmup_steps, args.steps))
    trainer.step.assign(0)
    trainer.fit(dataset_fn, steps_per_epoch=args.steps, callbacks=[report])
    gradient_bytes = sum(int(np.prod(v.shape)) * 4
                         for v in model.trainable_variables) + 4
    if info.is_chief:
        result = dict(report.logs, num_workers=info.num_workers,
                      global_batch_size=args.global_batch_size,
                      gradient_bytes=gradient_bytes,
                      parameters=int(sum(np.prod(v.shape)
                                         for v in model.trainable_variables)))
        with open(args.result_file, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
