r"""BERT pretraining on one or many workers.

    python run_pretraining.py --input_file='records/train-*.tfrecord' \
        --output_dir=runs/bert --bert_config_file=bert_config.json \
        --train_batch_size=256 --max_seq_length=128 --max_predictions_per_seq=20 \
        --num_train_steps=10000 --num_warmup_steps=1000 --learning_rate=1e-3

Single worker by default; under TF_CONFIG (launch.local, Kubernetes) or
SLURM (`srun`) it runs multi-worker with no other change. Flag names follow
Google's and NVIDIA's run_pretraining.py where the meaning is the same, so
their command lines (and --flagfile files) carry over.

This file is the edge: it defines the flags (grouped by concern in
--helpfull), turns them into one frozen `PretrainingConfig`, and calls
`pretraining.train_and_evaluate`, which does the rest.
"""

import os

from absl import flags

from models.tasks import flags as flags_lib
from models.tasks import nvidia_flags
from models.tasks.flags import (cluster_from_flags, data_service_from_flags,
                                define_cluster_flags,
                                define_data_service_flags, define_job_flags,
                                define_noise_scale_flags,
                                define_log_interval,
                                train_from_flags, train_records_from_flags)
from tfscale import cli

FLAGS = flags.FLAGS


def _concern(number: int, name: str) -> dict:
    """Flags of one concern share a --help section (sorted by number)."""
    return flags_lib.concern("run_pretraining", number, name)


DATA = _concern(1, "records")
flags.DEFINE_string("input_file", None, "Training records: globs or a comma "
                    "list (Google's format).", **DATA)
flags.DEFINE_string("eval_input_file", None, "Evaluation records (default "
                    "with --do_eval: --input_file).", **DATA)
flags.DEFINE_integer("max_seq_length", 128, "Tokens per record.", **DATA)
flags.DEFINE_integer("max_predictions_per_seq", 20, "Masked tokens per record.",
                     **DATA)
define_data_service_flags(flags, **DATA)

MODEL = _concern(2, "model")
flags.DEFINE_string("bert_config_file", None, "Google bert_config.json.",
                    **MODEL)
flags.DEFINE_enum("model", "bert_tiny", ["bert_tiny", "bert_mini", "bert_small",
                                         "bert_medium", "bert_base", "bert_large"],
                  "Preset size when no --bert_config_file is given.", **MODEL)
flags.DEFINE_integer("vocab_size", 30522, "Vocab size for a preset model.",
                     **MODEL)
flags.DEFINE_string("init_checkpoint", None,
                    "Initial model weights when --output_dir has no checkpoint "
                    "yet: Google's bert_model.ckpt or a tfscale checkpoint "
                    "(prefix or directory); step and optimizer start fresh.",
                    **MODEL)

OPTIM = _concern(3, "optimizer and schedule")
SPEED = _concern(4, "numerics and distribution")
RUN = _concern(5, "what to run, output")
define_job_flags(
    flags, section={"records": DATA, "optimizer": OPTIM, "numerics": SPEED,
                    "run": RUN}.get,
    defaults=dict(shuffle_buffer_size=10000, cycle_length=2,
                  skip_corrupt_records=False, verify_records=True,
                  allow_partial_shards=False,
                  input_order="global",
                  train_batch_size=32, num_accumulation_steps=1,
                  micro_batch_size=0,
                  learning_rate=1e-4, num_train_steps=1000,
                  num_warmup_steps=100, lr_schedule="polynomial",
                  lr_scaling="none", reference_batch_size=0,
                  optimizer="lamb", weight_decay=0.01, clip_global_norm=1.0,
                  shard_optimizer_state=False,
                  seed=12345, precision="float32", xla="auto",
                  xla_gemm="cublas",
                  deterministic=False, do_train=True, eval_batch_size=32,
                  max_eval_steps=100, output_dir=None,
                  save_checkpoints_steps=1000),
    helps={"do_train": "Train. (Google's default is False; tfscale trains "
                       "unless --do_train=False.)",
           "output_dir": "Checkpoints, TensorBoard, export, "
                         "eval_results.txt, summary.json."})

define_cluster_flags(flags, **SPEED)
flags.DEFINE_bool("recompute_activations", False, "Keep only each "
                  "transformer layer's input for the backward pass and run "
                  "the layer's forward again there (tf.recompute_grad): "
                  "activation memory of one layer instead of all, for about "
                  "one more forward pass (docs/memory.md).", **SPEED)
flags.DEFINE_enum("dropout_bits", "32", ["32", "16"],
                  "Random bits drawn per dropout element: 32 (a uniform "
                  "number each) or 16 (one 32-bit word for two elements; the "
                  "rate quantized to 1/65536, the kept elements scaled by "
                  "the keep probability that realizes: docs/gpus.md).",
                  **SPEED)

flags.DEFINE_bool("do_eval", False,
                  "Evaluate at the end, on --eval_input_file or else on "
                  "--input_file, and write eval_results.txt in --output_dir.",
                  **RUN)
define_log_interval(flags, 100, **RUN)
flags.DEFINE_string("profile_steps", None, "Profile steps 'first,last' into "
                    "TensorBoard (the calls of the compiled step that run "
                    "them, whole: up to --iterations_per_loop steps each; "
                    "the last 4 steps of each loop run one at a time, part "
                    "by part).", **RUN)
# BERT's variable groups (paths of models/bert.py's pretrainer).
# (", " between groups: --help wraps the default there, not mid-word.)
BERT_NOISE_SCALE_GROUPS = ("embeddings=_embeddings/|embedding_layer_norm, "
                           "encoder=encoder/layer_, "
                           "head=pooler|mlm_|nsp")
define_noise_scale_flags(flags, BERT_NOISE_SCALE_GROUPS, **RUN)

TPU = _concern(6, "Google's TPU flags (accepted; TPUs are not supported)")
flags.DEFINE_bool("use_tpu", False, "Must be False.", **TPU)
flags.DEFINE_string("tpu_name", None, "Ignored.", **TPU)
flags.DEFINE_string("tpu_zone", None, "Ignored.", **TPU)
flags.DEFINE_string("gcp_project", None, "Ignored.", **TPU)
flags.DEFINE_string("master", None, "Ignored.", **TPU)
flags.DEFINE_integer("num_tpu_cores", 8, "Ignored.", **TPU)

NVIDIA = _concern(7, "NVIDIA DeepLearningExamples names (TF1 and TF2)")
nvidia_flags.define_nvidia_flags(flags, **NVIDIA)


def fail(message: str):
    """One line on stderr, non-zero exit."""
    flags_lib.fail("run_pretraining", message)


def _backend():
    """--backend, or MPI's for NVIDIA's --horovod/--use_horovod (what their
    mpirun/horovodrun command lines mean) unless --backend is given."""
    if (FLAGS.horovod or FLAGS.use_horovod) and not FLAGS["backend"].present:
        return "mpi"
    return FLAGS.backend


def _ranks(backend: str) -> int:
    """Worker processes in this job (Horovod's hvd.size()), from the
    environment the launcher set."""
    from tfscale.cluster import environment as cluster_lib
    try:
        return cluster_lib.resolve_cluster(
            slurm_port_base=FLAGS.slurm_port_base,
            backend=backend).num_workers
    except cluster_lib.ClusterError as e:
        fail(str(e))


def _nvidia(backend: str):
    """(precision, steps, optimizer, the batch and rate, loss scale, log
    interval, DLLogger path) after Google's and NVIDIA's spellings and the
    dialect rule (models/tasks/nvidia_flags.py)."""
    values = FLAGS
    refusal = nvidia_flags.refused(values)
    if refusal:
        fail(refusal)
    try:
        precision = nvidia_flags.precision_name(values, FLAGS.precision)
        steps = nvidia_flags.train_steps(values, FLAGS.num_train_steps)
        optimizer = nvidia_flags.optimizer_name(values, FLAGS.optimizer)
        scale = nvidia_flags.loss_scale(values)
        dialect = nvidia_flags.dialect_of(values)
        horovod = FLAGS.horovod or FLAGS.use_horovod
        reading = nvidia_flags.batch_and_rate(
            dialect, FLAGS.train_batch_size, FLAGS.num_accumulation_steps,
            FLAGS.learning_rate, horovod,
            _ranks(backend) if horovod else 1)
        nvidia_flags.check_mixed(values, dialect, reading,
                                 FLAGS.train_batch_size, FLAGS.learning_rate)
    except nvidia_flags.DialectError as e:
        fail(str(e))
    log_steps = FLAGS.iterations_per_loop
    if FLAGS.display_loss_steps is not None:
        if (FLAGS["iterations_per_loop"].present
                and FLAGS.iterations_per_loop != FLAGS.display_loss_steps):
            fail(f"--display_loss_steps={FLAGS.display_loss_steps} and "
                 f"--iterations_per_loop={FLAGS.iterations_per_loop} (or "
                 "--steps_per_loop) disagree on the log interval: give one")
        log_steps = FLAGS.display_loss_steps
    dllog = FLAGS.dllog_path or (
        os.path.join(FLAGS.output_dir or ".", nvidia_flags.DLLOG_DEFAULT)
        if dialect == "nvidia" else None)
    return precision, steps, optimizer, reading, scale, log_steps, dllog


def _model_from_flags(bert_config):
    """--bert_config_file's BertConfig, else --model's preset."""
    if not FLAGS.bert_config_file:
        return bert_config.preset(FLAGS.model, vocab_size=FLAGS.vocab_size)
    try:
        return bert_config.BertConfig.from_json_file(FLAGS.bert_config_file)
    except ValueError as e:
        fail(f"--bert_config_file: {e}")


def _profile_from_flags():
    """--profile_steps as (first, last), or None."""
    if not FLAGS.profile_steps:
        return None
    try:
        first, last = (int(v) for v in FLAGS.profile_steps.split(","))
        return first, last
    except ValueError:
        fail(f"--profile_steps must be 'first,last', got "
             f"{FLAGS.profile_steps!r}")


def _records(record_config):
    """(the training files, the evaluation `record_config` or None) from
    Google's and NVIDIA's record flags; exits on missing ones."""
    input_file = FLAGS.input_file or nvidia_flags.directory_globs(
        FLAGS.input_files_dir)
    eval_input_file = (FLAGS.eval_input_file or
                       nvidia_flags.directory_globs(FLAGS.eval_files_dir))
    if not input_file:
        fail("--input_file is required")
    if not FLAGS.output_dir:
        fail("--output_dir is required")
    if FLAGS.use_tpu:
        fail("--use_tpu=True: TPUs are not supported; tfscale runs on GPUs and "
             "CPUs (drop --use_tpu and the --tpu_* flags)")
    if not (FLAGS.do_eval or eval_input_file):
        return input_file, None
    # Google's script evaluates on --input_file when there is nothing else.
    return input_file, record_config(
        eval_input_file or input_file, training=False,
        allow_partial_shards=FLAGS.allow_partial_shards)


def config_from_flags():
    """FLAGS -> a frozen, validated `PretrainingConfig` (the only FLAGS
    reader). Exits with one line naming the flag on a bad value."""
    from input_pipelines.bert_records import BertRecordSpec
    from input_pipelines.tfrecord import TFRecordConfig
    from models import bert_config
    from models.tasks.pretraining import PretrainingConfig
    from tfscale.optim import OptimConfig

    input_file, eval_records = _records(TFRecordConfig)
    backend = _backend()
    (precision_name, num_train_steps, optimizer_name, reading,
     (initial_loss_scale, dynamic_loss_scale), log_steps,
     dllog_path) = _nvidia(backend)
    model = _model_from_flags(bert_config)
    profile = _profile_from_flags()
    try:
        order, data_service = data_service_from_flags(
            FLAGS, FLAGS.output_dir, FLAGS.connect_timeout)
        return PretrainingConfig(
            model=model,
            model_name=FLAGS.bert_config_file or FLAGS.model,
            spec=BertRecordSpec(FLAGS.max_seq_length,
                                FLAGS.max_predictions_per_seq),
            train_records=train_records_from_flags(
                FLAGS, input_file, order, data_service),
            optim=OptimConfig(
                optimizer=optimizer_name, learning_rate=reading.learning_rate,
                schedule=FLAGS.lr_schedule,
                warmup_steps=FLAGS.num_warmup_steps,
                total_steps=num_train_steps,
                weight_decay=FLAGS.weight_decay, scaling_rule=FLAGS.lr_scaling,
                reference_batch_size=FLAGS.reference_batch_size),
            cluster=cluster_from_flags(FLAGS, backend),
            train=train_from_flags(
                FLAGS, precision=precision_name, log_steps=log_steps,
                global_batch_size=reading.global_batch_size,
                initial_loss_scale=initial_loss_scale,
                dynamic_loss_scale=dynamic_loss_scale),
            output_dir=FLAGS.output_dir,
            do_train=FLAGS.do_train,
            eval_records=eval_records,
            eval_batch_size=FLAGS.eval_batch_size,
            max_eval_steps=FLAGS.max_eval_steps,
            init_checkpoint=FLAGS.init_checkpoint,
            profile_steps=profile,
            seed=FLAGS.seed,
            deterministic=FLAGS.deterministic,
            notes=(reading.line, *([f"DLLogger's log: {dllog_path}"]
                                   if dllog_path else [])),
            flag_names={original: alias for alias, original
                        in nvidia_flags.NVIDIA_ALIASES
                        if FLAGS[alias].present},
            dllog_path=dllog_path,
            pretrained_prefix=(os.path.join(FLAGS.output_dir,
                                            nvidia_flags.PRETRAINED_PREFIX)
                               if reading.dialect == "nvidia" else None),
            list_variables=FLAGS.verbose_logging,
            recompute_activations=FLAGS.recompute_activations,
            dropout_bits=int(FLAGS.dropout_bits))
    except ValueError as e:
        flags_lib.fail_on_config("run_pretraining", e, FLAGS)


# The console script (and the root run_pretraining.py).
run = cli.entry_point("run_pretraining", config_from_flags,
                       "models.tasks.pretraining:train_and_evaluate",
                       required=(("input_file", "input_files_dir"),
                                 "output_dir"))

if __name__ == "__main__":
    run()
