"""NVIDIA DeepLearningExamples' BERT pretraining flags (TF1 and TF2), and
the one rule that decides what `--train_batch_size` and `--learning_rate`
mean on a command line.

The rule (docs/bert.md, "Two dialects"):

- A command line is **NVIDIA's** when it names any flag of `NVIDIA_FLAGS`
  (flags only NVIDIA's scripts have: `--use_horovod`, `--horovod`,
  `--optimizer_type`, `--input_files`, `--model_dir`, ...). Then, as in
  NVIDIA's `run_pretraining.py`, `--train_batch_size` is the batch of one
  rank's one micro-step: the global batch is train_batch_size x ranks x
  num_accumulation_steps, and the learning rate is multiplied by the
  number of ranks. Ranks count only with `--use_horovod`/`--horovod`
  (NVIDIA's scripts without Horovod run one process; ranks are worker
  processes, Horovod's `hvd.size()`).
- Otherwise it is **Google's** (and tfscale's): `--train_batch_size` is the
  global batch per optimizer step and the rate is `--learning_rate`.
- A flag only Google's script or tfscale has, that presumes the global
  reading (`GLOBAL_FLAGS`), beside an NVIDIA flag whose reading gives other
  numbers, is one error naming both; `--dialect=google|nvidia` says which
  is meant.

TensorFlow is not imported here (flags are defined before it loads).
"""

import dataclasses
import os
from typing import Optional, Tuple

# NVIDIA's flags that tfscale names otherwise: alias -> tfscale's flag.
NVIDIA_ALIASES = (("steps_per_loop", "iterations_per_loop"),
                  ("save_checkpoint_steps", "save_checkpoints_steps"),
                  ("enable_xla", "xla"), ("use_xla", "xla"),
                  ("input_files", "input_file"),
                  ("warmup_steps", "num_warmup_steps"),
                  ("model_dir", "output_dir"))

# What NVIDIA's pretraining scripts define and never read, or read to no
# effect in tfscale (accepted; docs/bert.md says why per flag).
NO_EFFECT = (
    ("allreduce_post_accumulation", "tfscale always all-reduces once, after "
     "accumulation (the same sum)"),
    ("report_loss", "the loss is logged every log interval"),
    ("scale_loss", "the loss is the mean over the global batch on any "
     "worker count already"),
    ("benchmark", "NVIDIA's run_pretraining.py defines it and reads it "
     "nowhere"),
)

# Flags only NVIDIA's scripts have: naming one makes the command line
# NVIDIA's (the aliases' names are read from the command line too).
NVIDIA_FLAGS = (
    "use_horovod", "horovod", "optimizer_type", "input_files_dir",
    "eval_files_dir", "num_train_epochs", "num_steps_per_epoch", "use_fp16",
    "amp", "manual_fp16", "dtype", "loss_scale", "init_loss_scale",
    "fp16_implementation", "dllog_path", "display_loss_steps", "num_gpus",
    "distribution_strategy", "run_eagerly", "use_keras_compile_fit",
    "hub_module_url", "model_type", "model_export_path", "tpu",
    "verbose_logging", *(name for name, _ in NO_EFFECT), *(alias for alias, _ in NVIDIA_ALIASES))

# Flags of Google's script or of tfscale that presume the global reading.
GLOBAL_FLAGS = ("input_file", "use_tpu", "tpu_name", "tpu_zone",
                "gcp_project", "master", "num_tpu_cores", "lr_scaling",
                "reference_batch_size")

# DLLogger's file in --output_dir when --dllog_path is not given on an
# NVIDIA command line (the name NVIDIA's TF2 script writes in its working
# directory; its TF1 script's, /results/..., is a path of its container).
# In the run's own folder, two runs started from one folder never share
# one file.
DLLOG_DEFAULT = "bert_dllogger.json"

# NVIDIA TF2's sub-model export in --model_dir (its phase 2 reads it).
PRETRAINED_PREFIX = os.path.join("pretrained", "bert_model.ckpt-1")

# NVIDIA TF2's defaults when only one of epochs x steps per epoch is given.
DEFAULT_EPOCHS, DEFAULT_STEPS_PER_EPOCH = 3, 1000

# --dtype (Model Garden's flag) -> --precision.
DTYPES = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}


def define_nvidia_flags(flags, **kwargs) -> None:
    """Every flag of NVIDIA's TF1 and TF2 BERT pretraining scripts that
    tfscale does not define under the same name (`kwargs`: the entry
    point's `module_name` section)."""
    flags.DEFINE_enum("dialect", "auto", ["auto", "google", "nvidia"],
                      "What --train_batch_size and --learning_rate mean. "
                      "auto: NVIDIA's when the command line names an NVIDIA "
                      "flag (per rank x ranks x accumulation; the rate x "
                      "ranks with --use_horovod), else Google's (the global "
                      "batch).", **kwargs)
    flags.DEFINE_bool("horovod", False, "NVIDIA TF1: Horovod's data "
                      "parallelism over MPI: --train_batch_size per rank, "
                      "the learning rate x ranks; implies --backend=mpi "
                      "unless --backend is given (start with mpirun, "
                      "tfscale-run, launch.local --backend mpi or srun "
                      "--mpi=pmix).", **kwargs)
    flags.DEFINE_bool("use_horovod", False, "NVIDIA TF2: same as --horovod.",
                      **kwargs)
    # NVIDIA's default is LAMB in TF1 and ADAM in TF2; tfscale's is LAMB.
    flags.DEFINE_string("optimizer_type", None, "LAMB or ADAM, any case "
                        "(NVIDIA's ADAM is BERT's AdamWeightDecay: "
                        "--optimizer=adamw).", **kwargs)
    flags.DEFINE_string("input_files_dir", None, "NVIDIA TF1: directories "
                        "of training records, comma separated (each read "
                        "as DIR/*).", **kwargs)
    flags.DEFINE_string("eval_files_dir", None, "NVIDIA TF1: directories of "
                        "evaluation records, comma separated.", **kwargs)
    flags.DEFINE_integer("num_train_epochs", None, "NVIDIA TF2: "
                         "--num_train_steps is epochs x --num_steps_per_epoch "
                         f"(default {DEFAULT_EPOCHS} when only "
                         "--num_steps_per_epoch is given).", **kwargs)
    flags.DEFINE_integer("num_steps_per_epoch", None, "NVIDIA TF2: optimizer "
                         "steps per epoch (default "
                         f"{DEFAULT_STEPS_PER_EPOCH} when only "
                         "--num_train_epochs is given).", **kwargs)
    _define_numerics(flags, **kwargs)
    _define_model_garden(flags, **kwargs)
    flags.DEFINE_string("dllog_path", None, "DLLogger's JSON-lines log "
                        "(what NVIDIA's log parsers read): per log interval "
                        "the step, loss and throughput, and a final summary "
                        f"line; default --output_dir/{DLLOG_DEFAULT} on an "
                        "NVIDIA command line, none otherwise.", **kwargs)
    flags.DEFINE_integer("display_loss_steps", None, "NVIDIA TF1: the log "
                         "interval (same as --iterations_per_loop).",
                         **kwargs)
    flags.DEFINE_bool("verbose_logging", False, "NVIDIA TF1: print every "
                      "trainable variable (name and shape) at the start.",
                      **kwargs)
    for name, meaning in NO_EFFECT:
        flags.DEFINE_bool(name, False, f"NVIDIA: accepted; {meaning}.",
                          **kwargs)
    for alias, original in NVIDIA_ALIASES:
        flags.DEFINE_alias(alias, original, **kwargs)


def _define_numerics(flags, **kwargs) -> None:
    """NVIDIA's and Model Garden's precision and loss-scale flags."""
    flags.DEFINE_bool("use_fp16", False, "Same as --precision=mixed_float16 "
                      "(dynamic loss scaling).", **kwargs)
    flags.DEFINE_bool("amp", False, "NVIDIA TF1: same as --use_fp16.",
                      **kwargs)
    flags.DEFINE_bool("manual_fp16", False, "NVIDIA TF1: fp16 by casts in "
                      "the model; here the same as --use_fp16 (Keras's "
                      "mixed_float16 policy).", **kwargs)
    flags.DEFINE_enum("dtype", None, list(DTYPES), "Model Garden's: fp16 = "
                      "--precision=mixed_float16, bf16 = mixed_bfloat16, "
                      "fp32 = float32.", short_name="dt", **kwargs)
    flags.DEFINE_string("loss_scale", None, "fp16's loss scale: 'dynamic' "
                        "(the default) or a number, kept fixed (a step with "
                        "non-finite gradients is still skipped).",
                        short_name="ls", **kwargs)
    flags.DEFINE_float("init_loss_scale", None, "NVIDIA TF1: fp16's first "
                       "dynamic loss scale (NVIDIA's default 2**32; "
                       "tfscale's 2**15).", **kwargs)
    flags.DEFINE_enum("fp16_implementation", "keras",
                      ["keras", "graph_rewrite"], "Model Garden's: only "
                      "keras (Keras's mixed precision policy).", **kwargs)


def _define_model_garden(flags, **kwargs) -> None:
    """Model Garden's flags NVIDIA's TF2 script defines (flags core)."""
    flags.DEFINE_integer("num_gpus", 1, "Model Garden's GPUs per process "
                         "under a distribution strategy; only 1 (tfscale "
                         "uses every visible GPU of a worker: set "
                         "CUDA_VISIBLE_DEVICES).", short_name="ng", **kwargs)
    flags.DEFINE_string("distribution_strategy", "off", "Model Garden's: "
                        "off, one_device or mirrored (tfscale's workers; "
                        "with --use_horovod only off).", short_name="ds",
                        **kwargs)
    flags.DEFINE_bool("run_eagerly", False, "Model Garden's: only False "
                      "(the step is compiled).", **kwargs)
    flags.DEFINE_bool("use_keras_compile_fit", False, "Model Garden's: only "
                      "False (see docs/keras-fit.md for Keras's fit).",
                      **kwargs)
    flags.DEFINE_string("hub_module_url", None, "Model Garden's: not "
                        "supported (use --init_checkpoint).", **kwargs)
    flags.DEFINE_enum("model_type", "bert", ["bert", "albert"],
                      "Model Garden's: only bert.", **kwargs)
    flags.DEFINE_string("model_export_path", None, "NVIDIA TF2: defined, "
                        "not read by its pretraining; tfscale exports to "
                        "--output_dir/export.", **kwargs)
    flags.DEFINE_string("tpu", "", "Model Garden's TPU address: must be "
                        "empty.", **kwargs)


class DialectError(ValueError):
    """The command line cannot be read: the message names the flags."""


def named(values, names) -> Tuple[str, ...]:
    """The flags of `names` the command line gave by that name (absl counts
    an alias's use as its original's too)."""
    def by_name(name):
        aliases = [a for a, original in NVIDIA_ALIASES if original == name]
        return values[name].present > sum(values[a].present for a in aliases)
    return tuple(name for name in names if by_name(name))


def dialect_of(values) -> str:
    """"nvidia" or "google" by the rule above (`values`: parsed flags)."""
    if values.dialect != "auto":
        return values.dialect
    return "nvidia" if named(values, NVIDIA_FLAGS) else "google"


@dataclasses.dataclass(frozen=True)
class BatchAndRate:
    """What `--train_batch_size` and `--learning_rate` mean for this run.

    Attributes:
        dialect: "google" or "nvidia".
        global_batch_size: Examples per optimizer step, all ranks and
            micro-steps.
        learning_rate: The peak rate the schedule uses.
        line: The start banner's line saying how they were read.
    """

    dialect: str
    global_batch_size: int
    learning_rate: float
    line: str


def batch_and_rate(dialect: str, train_batch_size: int,
                   num_accumulation_steps: int, learning_rate: float,
                   horovod: bool, ranks: int) -> BatchAndRate:
    """The global batch and rate a command line means (`ranks`: worker
    processes, counted only with `horovod`)."""
    if dialect == "google":
        return BatchAndRate(dialect, train_batch_size, learning_rate,
                            f"Google semantics: --train_batch_size "
                            f"{train_batch_size:,} is the global batch; "
                            f"learning rate {learning_rate:g}")
    ranks = ranks if horovod else 1
    global_batch = train_batch_size * ranks * num_accumulation_steps
    rate = learning_rate * ranks
    if horovod:
        batch = (f"--train_batch_size {train_batch_size:,} per rank x "
                 f"{ranks} rank{'s' * (ranks != 1)} x "
                 f"{num_accumulation_steps} accumulation")
        scaled = f"{learning_rate:g} x {ranks} ranks = {rate:g}"
    else:
        batch = (f"--train_batch_size {train_batch_size:,} x "
                 f"{num_accumulation_steps} accumulation (one process: no "
                 "--use_horovod)")
        scaled = f"{rate:g} (x ranks only with --use_horovod)"
    return BatchAndRate(dialect, global_batch, rate,
                        f"NVIDIA semantics: {batch} = global batch "
                        f"{global_batch:,}; learning rate {scaled}")


def check_mixed(values, dialect: str, reading: BatchAndRate,
                train_batch_size: int, learning_rate: float) -> None:
    """Raises `DialectError` naming an NVIDIA flag and a flag that presumes
    the global reading, when the command line gives both, does not say
    --dialect, and NVIDIA's reading gives other numbers."""
    if values.dialect != "auto" or dialect != "nvidia":
        return
    if (reading.global_batch_size == train_batch_size
            and reading.learning_rate == learning_rate):
        return
    google = named(values, GLOBAL_FLAGS)
    if google:
        nvidia = named(values, NVIDIA_FLAGS)[0]
        raise DialectError(
            f"--{google[0]} (Google's or tfscale's reading: "
            f"--train_batch_size is the global batch) and --{nvidia} "
            "(NVIDIA's: per rank x ranks x accumulation, the rate x ranks) "
            f"disagree: they would read {train_batch_size} as "
            f"{train_batch_size} or {reading.global_batch_size}; spell the "
            "command in one dialect, or pass --dialect=google or "
            "--dialect=nvidia")


def directory_globs(directories: Optional[str]) -> Optional[str]:
    """NVIDIA TF1's comma-separated directories -> a comma list of DIR/*."""
    if not directories:
        return None
    return ",".join(os.path.join(d.strip(), "*")
                    for d in directories.split(",") if d.strip())


def train_steps(values, num_train_steps: int) -> int:
    """--num_train_steps, or NVIDIA TF2's epochs x steps per epoch (with
    its defaults for the one not given). Raises `DialectError` when both
    spellings are given and disagree."""
    epochs, per_epoch = values.num_train_epochs, values.num_steps_per_epoch
    if epochs is None and per_epoch is None:
        return num_train_steps
    steps = ((DEFAULT_EPOCHS if epochs is None else epochs) *
             (DEFAULT_STEPS_PER_EPOCH if per_epoch is None else per_epoch))
    if values["num_train_steps"].present and steps != num_train_steps:
        raise DialectError(
            f"--num_train_steps={num_train_steps} and --num_train_epochs x "
            f"--num_steps_per_epoch = {steps} disagree: give one")
    return steps


def optimizer_name(values, optimizer: str) -> str:
    """--optimizer_type in any case (NVIDIA's LAMB/ADAM) -> tfscale's name.
    Raises `DialectError` on another value or a contradicting
    --optimizer."""
    if values.optimizer_type is None:
        return optimizer
    given = values.optimizer_type.lower()
    # NVIDIA's "adam" is BERT's AdamWeightDecay: decoupled decay, AdamW.
    name = {"adam": "adamw"}.get(given, given)
    if name not in ("lamb", "adamw", "sgd"):
        raise DialectError(f"--optimizer_type={values.optimizer_type}: "
                           "expected LAMB or ADAM (any case)")
    if values["optimizer"].present and optimizer != name:
        raise DialectError(f"--optimizer_type={values.optimizer_type} and "
                           f"--optimizer={optimizer} disagree: give one")
    return name


def precision_name(values, precision: str) -> str:
    """--use_fp16, --amp, --manual_fp16 and --dtype -> --precision. Raises
    `DialectError` when two of them disagree."""
    asked = []
    if values.use_fp16 or values.amp or values.manual_fp16:
        flag = next(f for f in ("use_fp16", "amp", "manual_fp16")
                    if values[f].value)
        asked.append((flag, "mixed_float16"))
    if values.dtype is not None:
        asked.append((f"dtype={values.dtype}", DTYPES[values.dtype]))
    if values["precision"].present:
        asked.append((f"precision={precision}", precision))
    for flag, name in asked[1:]:
        if name != asked[0][1]:
            raise DialectError(f"--{asked[0][0]} and --{flag} disagree: "
                               "give one")
    return asked[0][1] if asked else precision


def loss_scale(values) -> Tuple[Optional[float], bool]:
    """(the first loss scale or None for tfscale's default, dynamic) from
    --loss_scale and --init_loss_scale."""
    text = values.loss_scale
    if text is None or text.strip().lower() == "dynamic":
        return values.init_loss_scale, True
    try:
        scale = float(text)
    except ValueError:
        scale = 0.0
    if not scale > 0:
        raise DialectError(f"--loss_scale={text}: expected 'dynamic' or a "
                           "positive number")
    if values.init_loss_scale is not None:
        raise DialectError(f"--loss_scale={text} (fixed) and "
                           "--init_loss_scale (dynamic's first scale) "
                           "disagree: give one")
    return scale, False


def refused(values) -> Optional[str]:
    """The first flag whose value tfscale cannot honour, as the error's
    text naming what to use instead; None when every value can be."""
    if values.num_gpus != 1:
        return (f"--num_gpus={values.num_gpus}: tfscale uses every GPU a "
                "worker sees (set CUDA_VISIBLE_DEVICES, or start one worker "
                "per GPU with mpirun, tfscale-run or launch.local)")
    strategy = values.distribution_strategy.lower()
    if strategy not in ("off", "one_device", "mirrored"):
        return (f"--distribution_strategy={values.distribution_strategy}: "
                "expected off, one_device or mirrored (workers come from "
                "TF_CONFIG, SLURM or MPI: --backend)")
    if strategy != "off" and (values.horovod or values.use_horovod):
        return (f"--distribution_strategy={values.distribution_strategy} "
                "and --use_horovod: NVIDIA's script refuses Horovod with a "
                "distribution strategy; drop one")
    if values.run_eagerly:
        return ("--run_eagerly=True: the step is compiled; to debug, "
                "tf.config.run_functions_eagerly(True) in a library call")
    if values.use_keras_compile_fit:
        return ("--use_keras_compile_fit=True: run_pretraining.py runs "
                "tfscale's Trainer; Keras's fit is in docs/keras-fit.md")
    if values.hub_module_url:
        return ("--hub_module_url: TF-Hub modules are not supported; use "
                "--init_checkpoint (Google's bert_model.ckpt or tfscale's)")
    if values.model_type != "bert":
        return "--model_type=albert: only BERT (--model_type=bert)"
    if values.tpu:
        return "--tpu: TPUs are not supported; tfscale runs on GPUs and CPUs"
    if values.fp16_implementation != "keras":
        return ("--fp16_implementation=graph_rewrite: only keras (Keras's "
                "mixed precision policy: --use_fp16)")
    return None
