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

from absl import flags

from models.tasks import flags as flags_lib
from models.tasks.flags import (cluster_from_flags, data_service_from_flags,
                                define_cluster_flags,
                                define_data_service_flags, define_job_flags,
                                define_noise_scale_flags,
                                define_log_interval, train_from_flags,
                                train_records_from_flags)
from tfscale import cli

FLAGS = flags.FLAGS


def _concern(number: int, name: str) -> dict:
    """Flags of one concern share a --help section (sorted by number), the
    groups of docs/image-job.md."""
    return flags_lib.concern("train_image_classifier", number, name)


DATA = _concern(1, "records")
OPTIM = _concern(2, "optimizer and schedule")
SPEED = _concern(3, "numerics and distribution")
RUN = _concern(4, "what to run, output")
flags.DEFINE_string("train_files", None, "Training records: globs or a comma "
                    "list (TF-slim's ImageNet format).", **DATA)
flags.DEFINE_string("eval_files", None, "Evaluation records (evaluated at "
                    "the end).", **DATA)
flags.DEFINE_integer("image_size", 224, "Side of the square model input.",
                     **DATA)
flags.DEFINE_integer("num_classes", 1000, "Classes.", **DATA)
flags.DEFINE_integer("label_offset", 1, "Label of the first class in the "
                     "records (1: ImageNet/TF-slim, where 0 is background).",
                     **DATA)
flags.DEFINE_enum("image_dtype", "uint8", ["uint8", "float32", "bfloat16",
                                           "float16"],
                  "Pixel dtype out of the pipeline (the model standardizes).",
                  **DATA)
define_data_service_flags(flags, **DATA)
define_job_flags(
    flags, section={"records": DATA, "optimizer": OPTIM, "numerics": SPEED,
                    "run": RUN}.get,
    defaults=dict(shuffle_buffer_size=1024, cycle_length=2,
                  skip_corrupt_records=False, verify_records=True,
                  allow_partial_shards=False,
                  input_order="global",
                  train_batch_size=256, num_accumulation_steps=1,
                  micro_batch_size=0,
                  learning_rate=0.1, num_train_steps=1000,
                  num_warmup_steps=100, lr_schedule="cosine",
                  lr_scaling="linear", reference_batch_size=256,
                  optimizer="sgd", weight_decay=1e-4, clip_global_norm=0.0,
                  shard_optimizer_state=False,
                  seed=12345, precision="float32", xla="auto",
                  xla_gemm="cublas",
                  deterministic=False, do_train=True, eval_batch_size=256,
                  max_eval_steps=0, output_dir=None,
                  save_checkpoints_steps=1000),
    helps={"skip_corrupt_records": "Skip and count records whose JPEG "
                                   "cannot be decoded.",
           "optimizer": "Optimizer (sgd: with --momentum).",
           "weight_decay": "Weight decay (none on batch norms and biases).",
           "num_warmup_steps": "Linear warmup steps (Goyal et al.: 5 "
                               "epochs).",
           "max_eval_steps": "Evaluation batches at most (0: all records).",
           "seed": "Seed of weights and augmentation."})
flags.DEFINE_float("momentum", 0.9, "SGD momentum.", **OPTIM)
flags.DEFINE_float("label_smoothing", 0.1, "Label smoothing.", **OPTIM)
define_cluster_flags(flags, **SPEED)

define_log_interval(flags, 100, **RUN)
define_noise_scale_flags(flags, **RUN)


def fail(message: str):
    flags_lib.fail("train_image_classifier", message)


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
        eval_records = (TFRecordConfig(
            FLAGS.eval_files, training=False,
            allow_partial_shards=FLAGS.allow_partial_shards)
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
                FLAGS, precision=FLAGS.precision,
                log_steps=FLAGS.iterations_per_loop),
            output_dir=FLAGS.output_dir,
            label_smoothing=FLAGS.label_smoothing,
            do_train=FLAGS.do_train,
            eval_records=eval_records,
            eval_batch_size=FLAGS.eval_batch_size,
            max_eval_steps=FLAGS.max_eval_steps or None,
            seed=FLAGS.seed,
            deterministic=FLAGS.deterministic)
    except ValueError as e:
        flags_lib.fail_on_config("train_image_classifier", e, FLAGS)


# The console script (and the root train_image_classifier.py).
run = cli.entry_point("train_image_classifier", config_from_flags,
                       "models.tasks.image_classification:train_and_evaluate",
                       required=(("train_files", "nodo_train"), "output_dir"))

if __name__ == "__main__":
    run()
