r"""ResNet-50 on ImageNet-format records, on one or many workers.

    python train_image_classifier.py --train_files='records/train-*' \
        --eval_files='records/validation-*' --output_dir=runs/resnet50 \
        --train_batch_size=256 --learning_rate=0.1 --num_train_steps=112590 \
        --num_warmup_steps=25020 --precision=mixed_bfloat16

Records are TF-slim's ImageNet format (`input_pipelines/images.py`; make
them with `python -m input_pipelines.build_image_records`). The recipe is
Goyal et al.'s: SGD with momentum 0.9, --learning_rate for a batch of
--reference_batch_size (256) scaled linearly to --train_batch_size, linear
warmup, label smoothing, weight decay except on batch norms and biases.
Single worker by default; under TF_CONFIG (launch.local, Kubernetes), SLURM
(`srun`) or MPI (`--backend=mpi`) it runs multi-worker with no other change.

This file is the edge: flags -> one frozen `ImageClassificationConfig` ->
`image_classification.train_and_evaluate`.
"""

import sys

from absl import flags

from models.tasks.flags import (cluster_from_flags, data_service_from_flags,
                                define_cluster_flags,
                                define_data_service_flags, train_from_flags,
                                train_records_from_flags)
from tfscale import edge
from tfscale.edge import define_noise_scale_flags

FLAGS = flags.FLAGS

flags.DEFINE_string("train_files", None, "Training records: globs or a comma "
                    "list (TF-slim's ImageNet format).")
flags.DEFINE_string("eval_files", None, "Evaluation records (evaluated at "
                    "the end).")
flags.DEFINE_integer("image_size", 224, "Side of the square model input.")
flags.DEFINE_integer("num_classes", 1000, "Classes.")
flags.DEFINE_integer("label_offset", 1, "Label of the first class in the "
                     "records (1: ImageNet/TF-slim, where 0 is background).")
flags.DEFINE_enum("image_dtype", "uint8", ["uint8", "float32", "bfloat16",
                                           "float16"],
                  "Pixel dtype out of the pipeline (the model standardizes).")
flags.DEFINE_integer("shuffle_buffer_size", 1024, "Record shuffle buffer of "
                     "--input_order=sharded "
                     "(held in each input checkpoint).")
flags.DEFINE_integer("cycle_length", 2, "Files read at once per worker.")
flags.DEFINE_bool("skip_corrupt_records", False, "Skip and count records "
                  "whose JPEG cannot be decoded.")
flags.DEFINE_enum("input_order", "global", ["global", "sharded"],
                  "global: one seeded order and crops, the same records in "
                  "each global batch on any worker count, exact resume on "
                  "any count; sharded: files dealt out per worker (the "
                  "default with --data_service).")
define_data_service_flags(flags)

flags.DEFINE_integer("train_batch_size", 256, "Global batch per step.")
flags.DEFINE_integer("num_accumulation_steps", 1, "Micro-batches per step.")
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "lamb", "adamw"], "Optimizer "
                  "(sgd: with --momentum).")
flags.DEFINE_float("learning_rate", 0.1, "Peak learning rate at "
                   "--reference_batch_size.")
flags.DEFINE_enum("lr_scaling", "linear", ["none", "linear", "sqrt",
                                           "adascale"],
                  "Scale --learning_rate to --train_batch_size.")
flags.DEFINE_integer("reference_batch_size", 256, "Batch --learning_rate is "
                     "given for.")
flags.DEFINE_enum("lr_schedule", "cosine", ["cosine", "polynomial",
                                            "constant"], "Decay after warmup.")
flags.DEFINE_integer("num_train_steps", 1000, "Optimizer steps.")
flags.DEFINE_integer("num_warmup_steps", 100, "Linear warmup steps (Goyal "
                     "et al.: 5 epochs).")
flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
flags.DEFINE_float("weight_decay", 1e-4, "Weight decay (none on batch norms "
                   "and biases).")
flags.DEFINE_float("label_smoothing", 0.1, "Label smoothing.")
flags.DEFINE_float("clip_global_norm", 0.0, "Global-norm clip (0: none).")
flags.DEFINE_integer("seed", 12345, "Seed of weights and augmentation.")

flags.DEFINE_enum("precision", "float32",
                  ["float32", "mixed_bfloat16", "mixed_float16"], "Precision.")
flags.DEFINE_bool("xla", False, "XLA-compile the forward/backward pass.")
flags.DEFINE_bool("deterministic", False, "Deterministic ops and input "
                  "order.")
define_cluster_flags(flags)

flags.DEFINE_string("output_dir", None, "Checkpoints, TensorBoard, "
                    "summary.json.")
flags.DEFINE_bool("do_train", True, "Train (else evaluate the latest "
                  "checkpoint in --output_dir).")
flags.DEFINE_integer("eval_batch_size", 256, "Global evaluation batch.")
flags.DEFINE_integer("max_eval_steps", 0, "Evaluation batches at most (0: "
                     "all records).")
flags.DEFINE_integer("save_checkpoints_steps", 1000, "Checkpoint interval.")
flags.DEFINE_integer("log_steps", 100, "Loss/throughput log interval, and "
                     "the most steps one call of the compiled step runs (the "
                     "host reads the device once per call).")
flags.DEFINE_integer("timed_steps_per_log", 4, "Steps per log interval run "
                     "part by part to measure the time split (0: none; "
                     "saves tracing the step a second time).")
define_noise_scale_flags(flags)


def fail(message: str):
    sys.exit(f"train_image_classifier: error: {message}")


def config_from_flags():
    """FLAGS -> a frozen `ImageClassificationConfig` (the only FLAGS
    reader); exits with one line naming the flag on a bad value."""
    from models.tasks.image_classification import ImageClassificationConfig
    from input_pipelines.images import ImageSpec
    from input_pipelines.tfrecord import TFRecordConfig
    from models.tasks.image_classification import NO_DECAY
    from tfscale.optim import OptimConfig

    for name in ("train_files", "output_dir"):
        if not FLAGS[name].value and (name == "output_dir" or FLAGS.do_train):
            fail(f"--{name} is required")
    try:
        order, data_service = data_service_from_flags(
            FLAGS, FLAGS.output_dir, FLAGS.connect_timeout)
        spec = ImageSpec(image_size=FLAGS.image_size,
                         num_classes=FLAGS.num_classes,
                         label_offset=FLAGS.label_offset,
                         output_dtype=FLAGS.image_dtype)
        eval_records = (TFRecordConfig(FLAGS.eval_files, training=False)
                        if FLAGS.eval_files else None)
        return ImageClassificationConfig(
            spec=spec,
            train_records=train_records_from_flags(
                FLAGS, FLAGS.train_files or FLAGS.eval_files or "", order, data_service),
            optim=OptimConfig(
                optimizer=FLAGS.optimizer, learning_rate=FLAGS.learning_rate,
                schedule=FLAGS.lr_schedule,
                warmup_steps=FLAGS.num_warmup_steps,
                total_steps=FLAGS.num_train_steps, momentum=FLAGS.momentum,
                weight_decay=FLAGS.weight_decay,
                exclude_from_weight_decay=NO_DECAY,
                scaling_rule=FLAGS.lr_scaling,
                reference_batch_size=FLAGS.reference_batch_size),
            cluster=cluster_from_flags(FLAGS, FLAGS.backend),
            train=train_from_flags(
                FLAGS, precision=FLAGS.precision, log_steps=FLAGS.log_steps,
                timed_steps_per_log=FLAGS.timed_steps_per_log),
            output_dir=FLAGS.output_dir,
            label_smoothing=FLAGS.label_smoothing,
            do_train=FLAGS.do_train,
            eval_records=eval_records,
            eval_batch_size=FLAGS.eval_batch_size,
            max_eval_steps=FLAGS.max_eval_steps or None,
            seed=FLAGS.seed,
            deterministic=FLAGS.deterministic)
    except ValueError as e:
        fail(flag_message(str(e)))


# Config fields whose flag has another name (errors name the flag).
FLAG_OF_FIELD = {"global_batch_size": "train_batch_size",
                 "total_steps": "num_train_steps",
                 "warmup_steps": "num_warmup_steps",
                 "output_dtype": "image_dtype", "schedule": "lr_schedule",
                 "scaling_rule": "lr_scaling", "order": "input_order"}


def flag_message(message: str) -> str:
    """A config's ValueError in flag names."""
    first, _, rest = message.partition(" ")
    flag = FLAG_OF_FIELD.get(first, first)
    return f"--{flag} {rest}" if flag in FLAGS else message


# The console script (and the root train_image_classifier.py).
run = edge.entry_point("train_image_classifier", config_from_flags,
                       "models.tasks.image_classification:train_and_evaluate")

if __name__ == "__main__":
    run()
