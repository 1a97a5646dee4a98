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

Errors the user can fix are `jobs.JobError`s: one line naming the setting
(which is also the flag) and the file.
"""

import dataclasses
from typing import List

import keras
import tensorflow as tf

from input_pipelines import images
from input_pipelines.images import ImageSpec
from models import benchmark_models
from models.tasks.records import RecordsJobConfig, RecordsTask
from tfscale import jobs

# No weight decay on batch-norm scales and offsets or on biases (Goyal et
# al.; keras.applications names its batch norms "..._bn").
NO_DECAY = (r"_bn/", r"bias")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageClassificationConfig(RecordsJobConfig):
    """Everything an image classification run needs: the `JobConfig` and
    `RecordsJobConfig` fields, and

    Attributes:
        spec: Image size, classes, label offset, pixel dtype, augmentation.
        label_smoothing: Label smoothing of the cross-entropy (0.1: Szegedy
            et al., Goyal et al.'s follow-ups).
    """

    spec: ImageSpec
    label_smoothing: float = 0.1
    eval_batch_size: int = 256

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got "
                             f"{self.label_smoothing}")


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
        jobs.JobError: Bad records, files, checkpoint or cluster.
        Preempted: SIGTERM; the agreed step is saved (exit code 143).
    """
    return jobs.run(ImageClassification(config))


class ImageClassification(RecordsTask):
    """ResNet-50 on TF-slim's ImageNet records."""

    title = "tfscale train_image_classifier"
    unit = "images"
    bad_record_hint = " (--skip_corrupt_records skips such records)"

    def check_first_record(self, files, records):
        images.check_first_record(files, self.config.spec,
                                  records.compression_type)

    def find_bad_record(self, files, records):
        return images.find_bad_record(files, self.config.spec,
                                      records.compression_type)

    def build(self) -> jobs.Built:
        spec = self.config.spec
        model = benchmark_models.make_resnet50(benchmark_models.ResNetConfig(
            image_size=spec.image_size, classes=spec.num_classes,
            input_dtype=spec.output_dtype))
        return jobs.Built(
            model, smoothed_crossentropy(spec.num_classes,
                                         self.config.label_smoothing),
            classification_metrics())

    def dataset_fn(self, per_replica_batch, training):
        records = (self.config.train_records if training
                   else self.config.eval_records)
        return images.make_dataset_fn(records, self.config.spec,
                                      per_replica_batch)

    def describe(self, model) -> List[str]:
        spec = self.config.spec
        return [f"model resnet50: {spec.image_size}x{spec.image_size} "
                f"{spec.output_dtype} images, {spec.num_classes} classes, "
                f"{jobs.millions_of_parameters(model):.2f}M parameters, "
                f"label smoothing {self.config.label_smoothing:g}",
                *super().describe(model)[1:]]
