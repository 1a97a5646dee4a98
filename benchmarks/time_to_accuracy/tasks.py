"""The studies' tasks: Fashion-MNIST (Debian's IDX files), scikit-learn's
digits, and BERT-tiny's masked LM on the demo corpus's records."""

import dataclasses
import json
import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from input_pipelines import idx  # noqa: E402
from benchmarks.time_to_accuracy.study import Study, data_of  # noqa: E402
# ---- Fashion-MNIST -------------------------------------------------------------


def fashion_task(directory: str, target: float) -> Study:
    def load(split):
        images, labels = idx.load_fashion_mnist(directory, split)
        return images.reshape(len(images), -1), labels
    train_x, train_y = load("train")
    test_x, test_y = load("test")
    test_x = tf.constant(test_x.astype(np.float32) / 255.0)

    def build_model():
        return keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10)])

    def dataset_fn(per_replica_batch, seed):
        def make(context):
            ds = tf.data.Dataset.from_tensor_slices((train_x, train_y))
            ds = ds.shuffle(len(train_y), seed=seed,
                            reshuffle_each_iteration=True).repeat()
            ds = ds.batch(per_replica_batch, drop_remainder=True)
            return ds.map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y))
        return make

    def evaluate(model):
        logits = model(test_x, training=False)
        predicted = tf.argmax(logits, axis=1).numpy()
        return float(np.mean(predicted == test_y))

    return Study(
        name="fashion_mnist", batches=(16, 64, 256, 1024, 4096),
        reference_batch=256,
        base_rates={"sgd": 0.05, "adamw": 1e-3, "lamb": 4e-3},
        target=target, higher_is_better=True,
        metric="test accuracy", cap_examples=1_500_000,
        warmup_examples=5_000, build_model=build_model,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        dataset_fn=dataset_fn, evaluate=evaluate,
        data=data_of([os.path.join(directory, name) for name in sorted(
            os.listdir(directory)) if "idx" in name]),
        model="MLP 784-256-10, relu, from logits",
        source=os.path.abspath(directory))


# ---- scikit-learn's digits ---------------------------------------------------------


def digits_task(target: float) -> Study:
    """The 1,797 8x8 handwritten digits scikit-learn ships (UCI's optical
    digits test set): a second real image set for the same kind of model,
    500 of them held out (a fixed permutation)."""
    try:
        from sklearn import datasets
    except ImportError as e:
        raise SystemExit("--task digits: needs scikit-learn (pip install "
                         "scikit-learn)") from e
    path = os.path.join(os.path.dirname(datasets.__file__), "data",
                        "digits.csv.gz")
    digits = datasets.load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype(np.float32)
    y = digits.target[order].astype(np.int64)
    train_x, train_y, test_x, test_y = x[500:], y[500:], x[:500], y[:500]

    def build_model():
        return keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10)])

    def dataset_fn(per_replica_batch, seed):
        def make(context):
            ds = tf.data.Dataset.from_tensor_slices((train_x, train_y))
            ds = ds.shuffle(len(train_y), seed=seed,
                            reshuffle_each_iteration=True).repeat()
            return ds.batch(per_replica_batch, drop_remainder=True)
        return make

    def evaluate(model):
        logits = model(test_x, training=False)
        predicted = tf.argmax(logits, axis=1).numpy()
        return float(np.mean(predicted == test_y))

    return Study(
        name="digits", batches=(16, 64, 256, 1024),
        reference_batch=256,
        base_rates={"sgd": 0.05, "adamw": 1e-3, "lamb": 4e-3},
        target=target, higher_is_better=True,
        metric="test accuracy", cap_examples=1_500_000,
        warmup_examples=5_000, build_model=build_model,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        dataset_fn=dataset_fn, evaluate=evaluate,
        data=data_of([path]), model="MLP 64-128-10, relu, from logits",
        source=path)


# ---- BERT-tiny masked LM -----------------------------------------------------------


def bert_task(records: str, bert_config: str, target: float) -> Study:
    from input_pipelines import bert_records, record_files, tfrecord
    from models import bert
    from models.bert_config import BertConfig

    files = record_files.expand_files(records)
    if len(files) < 2:
        raise SystemExit(f"--records: {records} must match >= 2 files (the "
                         "last is held out)")
    config = BertConfig.from_json_file(bert_config)
    config = dataclasses.replace(config, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    spec = bert_records.BertRecordSpec(64, 10)
    limits = bert_records.IdLimits(config.vocab_size, config.type_vocab_size)
    held_out = bert_records.make_dataset_fn(
        tfrecord.TFRecordConfig(files[-1:], training=False), spec, 256,
        limits)(None).take(2).cache()

    def build_model():
        return bert.make_pretrainer(config, 64, 10)

    def dataset_fn(per_replica_batch, seed):
        return bert_records.make_dataset_fn(
            tfrecord.TFRecordConfig(files[:-1], training=True, seed=seed),
            spec, per_replica_batch, limits)

    def evaluate(model):
        metric = bert.MaskedLMLoss()
        for features, labels in held_out:
            outputs = model(features, training=False)
            metric.update_state(labels, outputs)
        return float(metric.result())

    return Study(
        name="bert_tiny", batches=(16, 64, 256, 1024),
        reference_batch=64,
        base_rates={"sgd": 0.1, "adamw": 2e-3, "lamb": 4e-3},
        target=target, higher_is_better=False, metric="held-out MLM loss",
        # Warmup ends long before the target (study version 1 warmed up
        # over 2,000 examples: the best runs reached the target inside it).
        cap_examples=200_000, warmup_examples=320,
        build_model=build_model, loss_fn=bert.pretraining_loss,
        dataset_fn=dataset_fn, evaluate=evaluate, evaluation_growth=1.1,
        data=data_of(files + [bert_config]),
        model=f"BERT pretrainer {json.dumps(dataclasses.asdict(config), sort_keys=True)}, seq 64, 10 predictions",
        source=records,
        code_files=("models/bert.py", "models/bert_config.py",
                    "input_pipelines/bert_records.py"))
