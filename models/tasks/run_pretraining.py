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
from models.tasks.flags import (cluster_from_flags, data_service_from_flags,
                                define_cluster_flags,
                                define_data_service_flags, define_job_flags,
                                train_from_flags, train_records_from_flags)
from tfscale import cli
from tfscale.cli import define_noise_scale_flags

FLAGS = flags.FLAGS


def _concern(number: int, name: str) -> dict:
    """Flags of one concern share a --helpfull section (sorted by number)."""
    return {"module_name": f"run_pretraining ({number}) {name}"}


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
                  skip_corrupt_records=False, input_order="global",
                  train_batch_size=32, num_accumulation_steps=1,
                  learning_rate=1e-4, num_train_steps=1000,
                  num_warmup_steps=100, lr_schedule="polynomial",
                  lr_scaling="none", reference_batch_size=0,
                  optimizer="lamb", weight_decay=0.01, clip_global_norm=1.0,
                  seed=12345, precision="float32", xla=False,
                  xla_gemm="cublas",
                  deterministic=False, do_train=True, eval_batch_size=32,
                  max_eval_steps=100, output_dir=None,
                  save_checkpoints_steps=1000),
    helps={"do_train": "Train. (Google's default is False; tfscale trains "
                       "unless --do_train=False.)",
           "output_dir": "Checkpoints, TensorBoard, export, "
                         "eval_results.txt, summary.json."})

define_cluster_flags(flags, **SPEED)

flags.DEFINE_bool("do_eval", False,
                  "Evaluate at the end, on --eval_input_file or else on "
                  "--input_file, and write eval_results.txt in --output_dir.",
                  **RUN)
flags.DEFINE_integer("iterations_per_loop", 100,
                     "Steps per host loop: the steps one call of the "
                     "compiled step runs (the host reads the device once per "
                     "call) and the loss/throughput log interval.", **RUN)
flags.DEFINE_string("profile_steps", None, "Profile steps 'first,last' into "
                    "TensorBoard (the calls of the compiled step that run "
                    "them, whole: up to --iterations_per_loop steps each; "
                    "the last 4 steps of each loop run one at a time, part "
                    "by part).", **RUN)
# BERT's variable groups (paths of models/bert.py's pretrainer).
BERT_NOISE_SCALE_GROUPS = ("embeddings=_embeddings/|embedding_layer_norm,"
                           "encoder=encoder/layer_,"
                           "head=pooler|mlm_|nsp")
define_noise_scale_flags(flags, BERT_NOISE_SCALE_GROUPS, **RUN)

TPU = _concern(6, "Google's TPU flags (accepted; TPUs are not supported)")
flags.DEFINE_bool("use_tpu", False, "Must be False.", **TPU)
flags.DEFINE_string("tpu_name", None, "Ignored.", **TPU)
flags.DEFINE_string("tpu_zone", None, "Ignored.", **TPU)
flags.DEFINE_string("gcp_project", None, "Ignored.", **TPU)
flags.DEFINE_string("master", None, "Ignored.", **TPU)
flags.DEFINE_integer("num_tpu_cores", 8, "Ignored.", **TPU)

NVIDIA = _concern(7, "NVIDIA DeepLearningExamples names")
flags.DEFINE_bool("use_fp16", False, "Same as --precision=mixed_float16.",
                  **NVIDIA)
flags.DEFINE_enum("optimizer_type", None, ["lamb", "adam", "adamw", "sgd"],
                  "Same as --optimizer (adam: AdamW, BERT's "
                  "AdamWeightDecay).", **NVIDIA)
flags.DEFINE_bool("amp", False, "NVIDIA TF1: same as --use_fp16.", **NVIDIA)
flags.DEFINE_string("input_files_dir", None, "NVIDIA TF1: a directory of "
                    "training records (read as DIR/*).", **NVIDIA)
flags.DEFINE_string("eval_files_dir", None, "NVIDIA TF1: a directory of "
                    "evaluation records (read as DIR/*).", **NVIDIA)
flags.DEFINE_integer("num_train_epochs", None, "NVIDIA TF2: with "
                     "--num_steps_per_epoch, sets --num_train_steps to "
                     "their product.", **NVIDIA)
flags.DEFINE_integer("num_steps_per_epoch", None, "NVIDIA TF2: see "
                     "--num_train_epochs.", **NVIDIA)
flags.DEFINE_bool("horovod", False, "NVIDIA TF1: Horovod's data parallelism "
                  "over MPI; implies --backend=mpi unless --backend is given "
                  "(start with mpirun, launch.local --backend mpi or srun "
                  "--mpi=pmix).", **NVIDIA)
flags.DEFINE_bool("use_horovod", False, "NVIDIA TF2: same as --horovod.",
                  **NVIDIA)
for _name, _meaning in (
        ("allreduce_post_accumulation", "tfscale always all-reduces once, "
         "after accumulation"),
        ("manual_fp16", "tfscale's fp16 is Keras's mixed_float16 policy"),
        ("report_loss", "the loss is logged every --iterations_per_loop")):
    flags.DEFINE_bool(_name, False, f"NVIDIA: accepted; {_meaning}.",
                      **NVIDIA)
for _alias, _original in (("log_steps", "iterations_per_loop"),
                          ("steps_per_loop", "iterations_per_loop"),
                          ("enable_xla", "xla"), ("use_xla", "xla"),
                          ("input_files", "input_file"),
                          ("warmup_steps", "num_warmup_steps"),
                          ("model_dir", "output_dir")):
    flags.DEFINE_alias(_alias, _original, **NVIDIA)
def fail(message: str):
    """One line on stderr, non-zero exit."""
    flags_lib.fail("run_pretraining", message)


def _directory_glob(directory):
    """NVIDIA's --input_files_dir / --eval_files_dir: every file in it."""
    return os.path.join(directory, "*") if directory else None


def _aliases():
    """(precision, backend, steps, optimizer) after Google's and NVIDIA's
    spellings of them (--use_fp16/--amp, --horovod, --num_train_epochs x
    --num_steps_per_epoch, --optimizer_type)."""
    precision_name = FLAGS.precision
    if FLAGS.use_fp16 or FLAGS.amp:
        if FLAGS.precision not in ("float32", "mixed_float16"):
            fail(f"--use_fp16/--amp contradicts --precision={FLAGS.precision}")
        precision_name = "mixed_float16"
    backend = FLAGS.backend
    if (FLAGS.horovod or FLAGS.use_horovod) and not FLAGS["backend"].present:
        backend = "mpi"  # what NVIDIA's mpirun/horovodrun command lines mean
    num_train_steps = FLAGS.num_train_steps
    if FLAGS.num_train_epochs or FLAGS.num_steps_per_epoch:
        if not (FLAGS.num_train_epochs and FLAGS.num_steps_per_epoch):
            fail("--num_train_epochs and --num_steps_per_epoch go together")
        num_train_steps = FLAGS.num_train_epochs * FLAGS.num_steps_per_epoch
    optimizer_name = FLAGS.optimizer
    if FLAGS.optimizer_type:
        # NVIDIA's "adam" is BERT's AdamWeightDecay: decoupled decay, AdamW.
        optimizer_name = {"adam": "adamw"}.get(FLAGS.optimizer_type,
                                               FLAGS.optimizer_type)
    return precision_name, backend, num_train_steps, optimizer_name


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


def config_from_flags():
    """FLAGS -> a frozen, validated `PretrainingConfig` (the only FLAGS
    reader). Exits with one line naming the flag on a bad value."""
    from input_pipelines.bert_records import BertRecordSpec
    from input_pipelines.tfrecord import TFRecordConfig
    from models import bert_config
    from models.tasks.pretraining import PretrainingConfig
    from tfscale.optim import OptimConfig

    input_file = FLAGS.input_file or _directory_glob(FLAGS.input_files_dir)
    eval_input_file = (FLAGS.eval_input_file or
                       _directory_glob(FLAGS.eval_files_dir))
    if not input_file:
        fail("--input_file is required")
    if not FLAGS.output_dir:
        fail("--output_dir is required")
    if FLAGS.use_tpu:
        fail("--use_tpu=True: TPUs are not supported; tfscale runs on GPUs and "
             "CPUs (drop --use_tpu and the --tpu_* flags)")
    precision_name, backend, num_train_steps, optimizer_name = _aliases()
    model = _model_from_flags(bert_config)
    profile = _profile_from_flags()
    eval_records = None
    if FLAGS.do_eval or eval_input_file:
        # Google's script evaluates on --input_file when there is nothing else.
        eval_records = TFRecordConfig(eval_input_file or input_file,
                                      training=False)
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
                optimizer=optimizer_name, learning_rate=FLAGS.learning_rate,
                schedule=FLAGS.lr_schedule,
                warmup_steps=FLAGS.num_warmup_steps,
                total_steps=num_train_steps,
                weight_decay=FLAGS.weight_decay, scaling_rule=FLAGS.lr_scaling,
                reference_batch_size=FLAGS.reference_batch_size),
            cluster=cluster_from_flags(FLAGS, backend),
            train=train_from_flags(FLAGS, precision=precision_name,
                                   log_steps=FLAGS.iterations_per_loop),
            output_dir=FLAGS.output_dir,
            do_train=FLAGS.do_train,
            eval_records=eval_records,
            eval_batch_size=FLAGS.eval_batch_size,
            max_eval_steps=FLAGS.max_eval_steps,
            init_checkpoint=FLAGS.init_checkpoint,
            profile_steps=profile,
            seed=FLAGS.seed,
            deterministic=FLAGS.deterministic)
    except ValueError as e:
        flags_lib.fail_on_config("run_pretraining", e, FLAGS)


# The console script (and the root run_pretraining.py).
run = cli.entry_point("run_pretraining", config_from_flags,
                       "models.tasks.pretraining:train_and_evaluate")

if __name__ == "__main__":
    run()
