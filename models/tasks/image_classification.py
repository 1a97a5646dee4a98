"""ResNet-50 on ImageNet-format records, as one library call.

    config = ImageClassificationConfig(...)   # frozen, validated
    results = train_and_evaluate(config)

`train_image_classifier.py` turns flags into the config; tests call this
directly. It wires cluster -> records (`input_pipelines.images`) -> model
(`benchmark_models.make_resnet50`) -> Trainer, trains with Goyal et al.'s
large-batch recipe (SGD with momentum, learning rate scaled linearly from a
reference batch of 256, linear warmup, label smoothing, no weight decay on
batch-norm parameters and biases), resumes from the latest checkpoint in
`output_dir`, evaluates, and writes `summary.json`.

Errors the user can fix are `ImageClassificationError`s (`jobs.JobError`):
one line naming the setting (which is also the flag) and the file.
"""

import dataclasses
import json
import os
import time
from typing import Optional

import keras
import tensorflow as tf

from input_pipelines import images, service, tfrecord
from input_pipelines.images import ImageSpec
from input_pipelines.tfrecord import TFRecordConfig
from models import benchmark_models
from models.tasks.records import check_records
from tfscale import checkpointing, jobs
from tfscale.cluster import ClusterConfig
from tfscale.input_feed import InputPipelineError
from tfscale.optim import OptimConfig, make_optimizer
from tfscale.timing import IntervalLog
from tfscale.train_config import TrainConfig

# No weight decay on batch-norm scales and offsets or on biases (Goyal et
# al.; keras.applications names its batch norms "..._bn").
NO_DECAY = (r"_bn/", r"bias")


# A problem the user can fix, in one line naming the setting (and flag).
ImageClassificationError = jobs.JobError


@dataclasses.dataclass(frozen=True)
class ImageClassificationConfig:
    """Everything an image classification run needs.

    Attributes:
        spec: Image size, classes, label offset, pixel dtype, augmentation.
        train_records: Training records and how to read them.
        optim: Optimizer and schedule; `total_steps` is the run's length.
        cluster: Collective settings and timeouts.
        train: The Trainer's settings; `checkpoint_dir` must be set.
        output_dir: Checkpoints, TensorBoard, summary.json.
        label_smoothing: Label smoothing of the cross-entropy (0.1: Szegedy
            et al., Goyal et al.'s follow-ups).
        do_train: Train (else only evaluate the latest checkpoint).
        eval_records: Evaluate on these at the end (None: no evaluation).
        eval_batch_size: Global evaluation batch.
        max_eval_steps: Evaluation batches at most (None: all records).
        seed: Seed of weights and augmentation.
        deterministic: Deterministic ops and input order.
    """

    spec: ImageSpec
    train_records: TFRecordConfig
    optim: OptimConfig
    cluster: ClusterConfig
    train: TrainConfig
    output_dir: str
    label_smoothing: float = 0.1
    do_train: bool = True
    eval_records: Optional[TFRecordConfig] = None
    eval_batch_size: int = 256
    max_eval_steps: Optional[int] = None
    seed: int = 12345
    deterministic: bool = False

    def __post_init__(self):
        jobs.check_job_config(output_dir=self.output_dir, train=self.train,
                              do_train=self.do_train,
                              evaluates=self.eval_records is not None)
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got "
                             f"{self.label_smoothing}")
        if self.eval_batch_size < 1:
            raise ValueError("eval_batch_size must be >= 1")


def smoothed_crossentropy(num_classes: int, smoothing: float):
    """`fn(class indices, logits) -> per-example cross-entropy` against
    labels smoothed toward the uniform distribution."""
    def loss(labels, logits):
        one_hot = tf.one_hot(tf.cast(tf.reshape(labels, [-1]), tf.int32),
                             num_classes)
        return keras.losses.categorical_crossentropy(
            one_hot, logits, from_logits=True, label_smoothing=smoothing)
    return loss


def classification_metrics() -> list:
    return [keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
            keras.metrics.SparseTopKCategoricalAccuracy(
                k=5, name="top_5_accuracy")]


def train_and_evaluate(config: ImageClassificationConfig) -> dict:
    """Runs the whole job on this worker (every worker calls it).

    Returns:
        The results also written to `summary.json`.

    Raises:
        ImageClassificationError: Bad records, files, checkpoint or cluster.
        Preempted: SIGTERM; the agreed step is saved (exit code 143).
    """
    train_files, eval_files = check_records(
        config.train_records, config.eval_records, do_train=config.do_train,
        train_flag="train_files", eval_flag="eval_files")
    info, strategy = jobs.start_worker(
        config.cluster, output_dir=config.output_dir,
        precision=config.train.precision, seed=config.seed,
        deterministic=config.deterministic)
    for files, setting, records in (
            (train_files, "train_files", config.train_records),
            (eval_files, "eval_files", config.eval_records)):
        if files:
            try:
                images.check_first_record(
                    files, config.spec, records.compression_type)
            except tfrecord.InputError as e:
                raise ImageClassificationError(setting, str(e)) from None
    spec = config.spec
    with strategy.scope():
        model = benchmark_models.make_resnet50(benchmark_models.ResNetConfig(
            image_size=spec.image_size, classes=spec.num_classes,
            input_dtype=spec.output_dtype))
        optimizer = make_optimizer(config.optim, config.train.global_batch_size,
                                   model.trainable_variables)
        metrics = classification_metrics()
    trainer = jobs.make_trainer(
        model=model, optimizer=optimizer,
        loss_fn=smoothed_crossentropy(spec.num_classes,
                                      config.label_smoothing),
        strategy=strategy, metrics=metrics, cluster=config.cluster,
        train=config.train)
    if info.is_chief:
        print(run_summary(config, info, trainer, model), flush=True)

    start = time.perf_counter()
    intervals = IntervalLog()
    if config.do_train:
        dataset_fn = images.make_dataset_fn(
            config.train_records, spec, trainer.per_replica_batch_size)
        try:
            intervals = jobs.fit(trainer, dataset_fn, config.optim.total_steps,
                                 config.output_dir)
        except tfrecord.InputError as e:  # a file changed since the start
            raise ImageClassificationError("train_files", str(e)) from None
        except InputPipelineError as e:
            raise ImageClassificationError("train_files", _diagnose(
                train_files, config.train_records, config, e)) from e
    else:
        _restore_for_eval(config, trainer, model)
    results = jobs.run_results(trainer, info, config.cluster.backend,
                               time.perf_counter() - start, intervals)
    if config.eval_records:
        results["eval"] = _evaluate(config, trainer, eval_files)
    if info.is_chief:
        with open(os.path.join(config.output_dir, "summary.json"), "w") as f:
            json.dump(results, f, indent=2)
        print(jobs.done_summary("tfscale train_image_classifier", results,
                                "images"), flush=True)
    trainer.leave_together()
    return results


def _restore_for_eval(config, trainer, model):
    try:
        path = checkpointing.restore_model(model, config.train.checkpoint_dir)
    except checkpointing.RestoreError as e:
        raise ImageClassificationError(
            "do_train", f"evaluating only needs a checkpoint in "
            f"--output_dir: {e}") from None
    trainer.step.assign(checkpointing.checkpoint_step(path))
    trainer.checkpoint_path = path


def _evaluate(config, trainer, files) -> dict:
    replicas = trainer.collectives.num_replicas
    eval_fn = images.make_dataset_fn(
        config.eval_records, config.spec,
        max(1, config.eval_batch_size // replicas))
    try:
        return trainer.evaluate(eval_fn, steps=config.max_eval_steps)
    except InputPipelineError as e:
        raise ImageClassificationError("eval_files", _diagnose(
            files, config.eval_records, config, e)) from e


def _diagnose(files, records, config, error) -> str:
    """Names the file, record and cause of an input pipeline failure
    (`records`: the failing set's TFRecordConfig)."""
    culprit = images.find_bad_record(files, config.spec,
                                     records.compression_type)
    if culprit:
        return (f"bad input record: {culprit} (--skip_corrupt_records "
                "skips such records)")
    return service.worker_message(str(error))


def run_summary(config: ImageClassificationConfig, info, trainer, model
                ) -> str:
    optim, spec = config.optim, config.spec
    params = sum(int(v.numpy().size) for v in model.trainable_variables)
    return "\n".join([
        "tfscale train_image_classifier",
        jobs.workers_line(info, trainer),
        f"  model resnet50: {spec.image_size}x{spec.image_size} "
        f"{spec.output_dtype} images, {spec.num_classes} classes, "
        f"{params / 1e6:.2f}M parameters",
        jobs.numerics_line(config.train, config.cluster),
        "  " + tfrecord.describe_input(config.train_records),
        f"  optimizer {optim.optimizer}, lr {optim.learning_rate:g} at batch "
        f"{optim.reference_batch_size or config.train.global_batch_size} "
        f"({optim.scaling_rule} scaling, {optim.schedule}, warmup "
        f"{optim.warmup_steps}), {optim.total_steps} steps, label smoothing "
        f"{config.label_smoothing:g}"])
