r"""What resuming costs: time from `fit` to the first step, at step 10 and at
step 5,000 of the same run (a resume must not re-read the records it
skips).

    python -m benchmarks.preemption.resume_cost [--steps 5000] [--repeats 3]

BERT records (seq 128, 20 predictions, shuffled, 16,384 records in 8 files)
through tfscale's pipeline (interleave, block shuffle of 10,000 records,
chunked parse, prefetch) into a small model, so the input dominates. One run
trains `--steps` steps; its checkpoint of step 10 is copied aside. Then, in
alternation, a new Trainer resumes from each and the time from `fit` to the
first step's start is measured (median of `--repeats`). Baseline in the same
run: what the old resume did, `dataset.skip(consumed batches)` until the first
batch.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

from benchmarks import harness
from input_pipelines import bert_records, tfrecord
from tfscale.trainer.loop import TrainConfig, Trainer

SPEC = bert_records.BertRecordSpec(128, 20)
GLOBAL_BATCH = 64


def write_records(directory, files=8, per_file=2048, vocab=1000):
    rng = np.random.RandomState(0)
    for f in range(files):
        with tf.io.TFRecordWriter(os.path.join(directory,
                                               f"train-{f}.tfrecord")) as w:
            for _ in range(per_file):
                n = rng.randint(40, 128)
                w.write(bert_records.serialize_instance(
                    rng.randint(5, vocab, n), [0] * n,
                    sorted(rng.choice(np.arange(1, n), 20, replace=False)),
                    rng.randint(5, vocab, 20), bool(rng.randint(2)), SPEC))


def make_trainer(checkpoint_dir):
    keras.utils.set_random_seed(0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        ids = keras.Input((128,), dtype="int32", name="input_ids")
        x = keras.layers.Embedding(1000, 16)(ids)
        x = keras.layers.GlobalAveragePooling1D()(x)
        model = keras.Model({"input_ids": ids}, keras.layers.Dense(2)(x))
        optimizer = keras.optimizers.SGD(0.01)
    return Trainer(
        model=model, optimizer=optimizer, strategy=strategy,
        loss_fn=lambda y, p: keras.losses.sparse_categorical_crossentropy(
            tf.reshape(y, [-1]), p, from_logits=True),
        config=TrainConfig(global_batch_size=GLOBAL_BATCH, verbose=0,
                           checkpoint_dir=checkpoint_dir, log_steps=1000,
                           timed_steps_per_log=0, save_checkpoints_steps=10))


def dataset_fn(records, batch):
    parse = bert_records.make_parse_fn(SPEC)
    config = tfrecord.TFRecordConfig(os.path.join(records, "*.tfrecord"),
                                     seed=1, deterministic=True,
                                     # iterator-state restore: the sharded
                                     # order (the global one needs none)
                                     order="sharded")

    def fn(context):
        ds = tfrecord.make_dataset(config, batch, parse, context)
        return ds.map(lambda inputs, labels: (
            {"input_ids": inputs["input_ids"]},
            labels["next_sentence_labels"]))
    return fn


class FirstStep(keras.callbacks.Callback):
    """Notes when the first step starts; stops training after it."""

    def on_train_batch_begin(self, batch, logs=None):
        if not hasattr(self, "at"):
            self.at = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.model.stop_training = True


class CopyAt(keras.callbacks.Callback):
    """Copies the checkpoint directory aside once step `step` is saved."""

    def __init__(self, trainer, step, source, target):
        super().__init__()
        self.trainer, self.step = trainer, step
        self.source, self.target = source, target

    def on_train_batch_begin(self, batch, logs=None):
        if int(self.trainer.step.numpy()) == self.step and \
                not os.path.exists(self.target):
            shutil.copytree(self.source, self.target)


def time_to_first_step(checkpoint_dir, records, total_steps):
    work = tempfile.mkdtemp()
    shutil.rmtree(work)
    shutil.copytree(checkpoint_dir, work)
    trainer = make_trainer(work)
    probe = FirstStep()
    start = time.perf_counter()
    trainer.fit(dataset_fn(records, trainer.per_replica_batch_size),
                steps_per_epoch=total_steps + 1, callbacks=[probe])
    shutil.rmtree(work, ignore_errors=True)
    return probe.at - start


def skip_baseline(records, step):
    ds = dataset_fn(records, GLOBAL_BATCH)(None).skip(step)
    start = time.perf_counter()
    next(iter(ds))
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000,
                        help="the position, in steps, a resume restores")
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each measurement is repeated")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="tfscale-resume-")
    records = os.path.join(root, "records")
    os.makedirs(records)
    write_records(records)
    run_dir, at10 = os.path.join(root, "run"), os.path.join(root, "at10")
    trainer = make_trainer(run_dir)
    start = time.perf_counter()
    trainer.fit(dataset_fn(records, trainer.per_replica_batch_size),
                steps_per_epoch=args.steps,
                callbacks=[CopyAt(trainer, 10, run_dir, at10)])
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s")
    times = {10: [], args.steps: []}
    skips = {10: [], args.steps: []}
    for _ in range(args.repeats):
        for step, directory in ((10, at10), (args.steps, run_dir)):
            times[step].append(time_to_first_step(directory, records, args.steps))
            skips[step].append(skip_baseline(records, step))
    table = harness.Table(["resume at step", "tfscale: fit -> first step (s)",
                           "old `.skip(n)`: to first batch (s)"], align="rrr")
    for step in times:
        table.row(step, f"{statistics.median(times[step]):.2f}",
                  f"{statistics.median(skips[step]):.2f}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
