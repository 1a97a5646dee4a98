"""Flags the job entry points share, and the configs they make of them
(TensorFlow is not imported here: the entry points define flags before it
loads). Each flag every job has is defined here once (`define_job_flags`,
with the job's defaults); each `define_*` takes the entry point's
`module_name` section as `kwargs`; each `*_from_flags` reads parsed flag
values."""

import os

from absl import flags as absl_flags

from tfscale.errors import flag_message

# The flags every job has: (concern, kind, name, help, enum choices). A job
# gives each one its default (`define_job_flags`) and may reword its help.
JOB_FLAG_TABLE = (
    ("records", "integer", "shuffle_buffer_size", "Record shuffle buffer of "
     "--input_order=sharded (held in each input checkpoint).", None),
    ("records", "integer", "cycle_length", "Files read at once per worker.",
     None),
    ("records", "bool", "skip_corrupt_records", "Skip and count records that "
     "do not parse.", None),
    ("records", "bool", "allow_partial_shards", "Train on a shard set "
     "NAME-i-of-N with shards missing (a writer that did not finish; "
     "refused by default, naming them).", None),
    ("records", "bool", "verify_records", "Check every record's CRC-32C as "
     "it is read (--input_order=global; TensorFlow's own reader checks them "
     "in the sharded order). Off only for data verified with python -m "
     "input_pipelines.index_records --verify: the banner says so.", None),
    ("records", "enum", "input_order", "global: one seeded order, the same "
     "records in each global batch on any worker count, exact resume on any "
     "count; sharded: files dealt out per worker (for compressed or remote "
     "records; the default with --data_service).", ("global", "sharded")),
    ("optimizer", "integer", "train_batch_size", "Global batch per optimizer "
     "step.", None),
    ("optimizer", "integer", "num_accumulation_steps", "Micro-batches per "
     "step.", None),
    ("optimizer", "integer", "micro_batch_size", "The batch one replica "
     "computes at once; when set (not with --num_accumulation_steps), the "
     "accumulation steps follow from the worker count: a job an elastic "
     "launcher restarts on fewer or more workers keeps its global batch "
     "and its micro-batches. 0: from --num_accumulation_steps.", None),
    ("optimizer", "float", "learning_rate", "Peak learning rate (at "
     "--reference_batch_size when --lr_scaling scales it).", None),
    ("optimizer", "integer", "num_train_steps", "Optimizer steps (with "
     "--lr_scaling=adascale: the reference run's steps; the run ends when "
     "AdaScale's progress reaches them).", None),
    ("optimizer", "integer", "num_warmup_steps", "Linear warmup steps.",
     None),
    ("optimizer", "enum", "lr_schedule", "Decay after warmup.",
     ("polynomial", "cosine", "constant")),
    ("optimizer", "enum", "lr_scaling", "Scale --learning_rate from "
     "--reference_batch_size to --train_batch_size (adascale: by the gain "
     "the gradient noise scale gives at every step; --optimizer=sgd).",
     ("none", "linear", "sqrt", "adascale")),
    ("optimizer", "integer", "reference_batch_size", "Global batch "
     "--learning_rate was tuned at (0: --train_batch_size itself, so "
     "--lr_scaling scales nothing).", None),
    ("optimizer", "enum", "optimizer", "Optimizer.", ("lamb", "adamw", "sgd")),
    ("optimizer", "float", "weight_decay", "Weight decay rate.", None),
    ("optimizer", "float", "clip_global_norm", "Global-norm clip (0: none).",
     None),
    ("optimizer", "bool", "shard_optimizer_state", "ZeRO stage 1: each of "
     "N workers keeps the optimizer slots (moments, momentum) of 1/N of the "
     "weights; gradients reduce-scattered, weights all-gathered, no more "
     "bytes than the all-reduce; checkpoints unchanged (docs/memory.md).",
     None),
    ("optimizer", "integer", "seed", "Seed of weights, dropout, shuffling and "
     "augmentation.", None),
    ("numerics", "enum", "precision", "Precision.",
     ("float32", "mixed_bfloat16", "mixed_float16")),
    ("numerics", "auto_bool", "xla", "XLA-compile the step: auto (the "
     "default) on when the worker's devices are GPUs, off on CPUs (slower "
     "there for BERT); --xla or --noxla forces it.", None),
    ("numerics", "enum", "xla_gemm", "With --xla on a GPU, XLA's GEMMs on "
     "cuBLAS (--xla_gpu_enable_triton_gemm=false) or on Triton (XLA's own "
     "autotuning); autotuning cached in --output_dir/xla_autotune. A flag "
     "set in XLA_FLAGS wins.", ("cublas", "triton")),
    ("numerics", "bool", "deterministic", "Deterministic ops and input "
     "order.", None),
    ("run", "bool", "do_train", "Train (else evaluate the latest checkpoint "
     "in --output_dir).", None),
    ("run", "integer", "eval_batch_size", "Global evaluation batch.", None),
    ("run", "integer", "max_eval_steps", "Evaluation batches at most.", None),
    ("run", "string", "output_dir", "Checkpoints, TensorBoard, "
     "summary.json.", None),
    ("run", "integer", "save_checkpoints_steps", "Checkpoint interval.",
     None),
)


def concern(program: str, number: int, name: str) -> dict:
    """The `module_name` kwargs of one concern's --help section ("program
    (N) name": sections sort by N)."""
    return {"module_name": f"{program} ({number}) {name}"}


def define_job_flags(flags, defaults: dict, helps=None, section=None) -> None:
    """Defines `JOB_FLAG_TABLE` with the job's `defaults` ({name: value}, one for
    every flag), help rewordings (`helps`: {name: text}) and `section`
    (concern -> the `module_name` kwargs of the job's --helpfull section).

    Raises:
        KeyError: A flag has no default here (each job decides them all).
    """
    helps = helps or {}
    for concern, kind, name, text, choices in JOB_FLAG_TABLE:
        kwargs = section(concern) if section else {}
        text = helps.get(name, text)
        if kind == "enum":
            getattr(flags, "DEFINE_enum")(name, defaults[name], list(choices),
                                          text, **kwargs)
        elif kind == "auto_bool":
            define_auto_bool(flags, name, defaults[name], text, **kwargs)
        else:
            getattr(flags, f"DEFINE_{kind}")(name, defaults[name], text,
                                             **kwargs)
    unknown = set(defaults) - {name for _, _, name, _, _ in JOB_FLAG_TABLE}
    if unknown:
        raise KeyError(f"defaults for flags that are not job flags: "
                       f"{sorted(unknown)}")


class _AutoBoolParser(absl_flags.BooleanParser):
    """A bool flag's parser that also takes "auto" (the value None)."""

    syntactic_help = "true, false or auto"

    def parse(self, argument):
        if isinstance(argument, str) and argument.lower() == "auto":
            return None
        return super().parse(argument)

    def flag_type(self) -> str:
        return "bool or auto"


def define_auto_bool(flags, name: str, default, text: str, **kwargs) -> None:
    """A flag that is True (--name), False (--noname) or None (auto:
    --name=auto, or the default "auto")."""
    flags.DEFINE_flag(flags.Flag(_AutoBoolParser(), None, name, default,
                                 text, None, True), **kwargs)


def fail(program: str, message: str):
    """One line on stderr naming the program, exit 2 (`cli.usage_error`)."""
    from tfscale.cli import usage_error
    usage_error(program, message)


def fail_on_config(program: str, error: ValueError, flags_values):
    """A config's ValueError as one line in flag names, and exit."""
    fail(program, flag_message(str(error), flags_values))


def define_data_service_flags(flags, **kwargs) -> None:
    """The tf.data service flags of an entry point (`kwargs`: its
    `module_name` section)."""
    flags.DEFINE_string(
        "data_service", None, "tf.data service dispatcher HOST:PORT: the "
        "training records are read, decoded and batched on its workers "
        "(default: $TFSCALE_DATA_SERVICE, which `launch.local "
        "--data_service_workers K` sets).", **kwargs)
    flags.DEFINE_enum(
        "data_service_mode", "distributed_epoch",
        ["distributed_epoch", "parallel_epochs"],
        "distributed_epoch: every record once per epoch across the service's "
        "workers; parallel_epochs: every worker reads every record.",
        **kwargs)
    flags.DEFINE_enum(
        "data_service_compression", "none", ["none", "auto"],
        "Compress batches on the service workers (auto: less network, more "
        "trainer CPU; none: for a fast network or one host).", **kwargs)


def data_service_from_flags(flags_values, output_dir: str,
                            connect_timeout: float):
    """(the training order, a `ServiceConfig` or None) from the flags of
    `define_data_service_flags` and `--input_order`: with a service the
    order is "sharded" unless --input_order says otherwise (which the
    config then refuses, naming the flag)."""
    from input_pipelines import service
    address = (flags_values.data_service or
               os.environ.get(service.ADDRESS_ENV) or None)
    order = flags_values.input_order
    if not address:
        return order, None
    if not flags_values["input_order"].present:
        order = "sharded"
    return order, service.ServiceConfig(
        address, processing_mode=flags_values.data_service_mode,
        job_name=service.job_name_for(output_dir),
        compression=flags_values.data_service_compression,
        connect_timeout_seconds=connect_timeout)


def define_log_interval(flags, default: int, **kwargs) -> None:
    """--iterations_per_loop (Google's name) and its alias --log_steps: the
    log interval; --steps_per_execution and --max_call_seconds: how many
    steps, and how many seconds, one call of the compiled step runs at most;
    --timed_steps_per_log: how many steps per interval are timed part by
    part."""
    flags.DEFINE_integer("iterations_per_loop", default,
                         "Steps per host loop: the loss/throughput log "
                         "interval (a call of the compiled step ends at its "
                         "boundaries).", **kwargs)
    flags.DEFINE_alias("log_steps", "iterations_per_loop", **kwargs)
    flags.DEFINE_integer("steps_per_execution", 0,
                         "The most steps one call of the compiled step runs "
                         "(Keras's name: the host reads the device once per "
                         "call). 0: up to the log interval.", **kwargs)
    flags.DEFINE_float("max_call_seconds", 2.0,
                       "Bound on one call's wall time, so that SIGTERM or "
                       "SIGUSR1 is acted on within about this many seconds, "
                       "one step and the checkpoint's save at any "
                       "--steps_per_execution (its steps sized from the "
                       "measured step time, agreed by all workers). 0: no "
                       "bound.", **kwargs)
    flags.DEFINE_integer("steps_per_launch", 1,
                         "Optimizer steps in one XLA program (a loop of "
                         "static trip count over that many batches taken "
                         "before the launch): the host launches once per "
                         "that many steps. Needs the step to be one XLA "
                         "program (one GPU alone, --xla). 1: one a launch.",
                         **kwargs)
    flags.DEFINE_integer("timed_steps_per_log", 4,
                         "Steps per log interval run part by part to measure "
                         "the time split (input, compute, sync, update), "
                         "each part followed by a wait for the device. 0: "
                         "none, which also saves tracing and compiling the "
                         "parts beside the step.", **kwargs)
    flags.DEFINE_float("straggler_threshold", 0.2,
                       "Name a worker whose input wait + compute a step "
                       "(from the timed steps) is more than this fraction "
                       "above the other workers' median over the last 3 "
                       "log intervals. 0: never.", **kwargs)


def define_cluster_flags(flags, **kwargs) -> None:
    """How the workers join and sum gradients."""
    flags.DEFINE_enum(
        "backend", "mwms", ["mwms", "mpi"],
        "How workers sum gradients: mwms = MultiWorkerMirroredStrategy "
        "(workers from TF_CONFIG or SLURM; NCCL on GPUs); mpi = "
        "MPI.Allreduce between the ranks of mpirun, launch.local --backend "
        "mpi or srun --mpi=pmix (CPU clusters; pip install '.[mpi]' in "
        "tfscale's checkout).",
        **kwargs)
    flags.DEFINE_enum("all_reduce_alg", "auto", ["auto", "ring", "nccl"],
                      "The workers' all-reduce: auto is NCCL where each "
                      "replica has a GPU of its own, else the gRPC ring.",
                      **kwargs)
    flags.DEFINE_integer("bytes_per_pack", 0, "All-reduce pack size (0: one "
                         "pack).", **kwargs)
    flags.DEFINE_float("collective_timeout", 300,
                       "Seconds before a collective fails.", **kwargs)
    flags.DEFINE_float("connect_timeout", 120,
                       "Seconds for all workers to join.", **kwargs)
    flags.DEFINE_float("heartbeat_timeout", 30,
                       "Seconds without a heartbeat before TensorFlow's "
                       "coordination service holds a worker lost and fails "
                       "the others' collectives naming it (--backend=mwms; "
                       "TensorFlow's own default, 10, is missed by healthy "
                       "workers on a loaded host).", **kwargs)
    flags.DEFINE_integer("slurm_port_base", 8888, "Port of task 0 on each "
                         "SLURM node.", **kwargs)


def cluster_from_flags(values, backend: str):
    """A `ClusterConfig` from `define_cluster_flags`' flags (`backend`: the
    entry point's reading of --backend and its aliases)."""
    from tfscale.cluster.environment import ClusterConfig
    return ClusterConfig(
        backend=backend, all_reduce_alg=values.all_reduce_alg,
        bytes_per_pack=values.bytes_per_pack,
        collective_timeout_seconds=values.collective_timeout,
        connect_timeout_seconds=values.connect_timeout,
        heartbeat_timeout_seconds=values.heartbeat_timeout,
        slurm_port_base=values.slurm_port_base)


def train_from_flags(values, *, precision: str, log_steps: int, **more):
    """A `TrainConfig` from the flags both jobs name alike (batch,
    accumulation, XLA, clipping, checkpoints in --output_dir, the noise
    scale); `more`: fields of the entry point's own flags. `log_steps` is
    the log interval (Google's `iterations_per_loop`); a call of the
    compiled step runs up to --steps_per_execution steps (0: up to the log
    interval) and about --max_call_seconds. `more` may give
    `global_batch_size` when the entry point reads --train_batch_size
    otherwise (NVIDIA's batch per rank)."""
    from tfscale.train_config import TrainConfig
    more.setdefault("global_batch_size", values.train_batch_size)
    return TrainConfig(
        num_accumulation_steps=values.num_accumulation_steps,
        micro_batch_size=values.micro_batch_size or None,
        jit_compile=values.xla, xla_gemm=values.xla_gemm,
        clip_global_norm=values.clip_global_norm or None,
        shard_optimizer_state=values.shard_optimizer_state,
        precision=precision,
        checkpoint_dir=os.path.join(values.output_dir, "checkpoints"),
        save_checkpoints_steps=values.save_checkpoints_steps,
        log_steps=log_steps,
        steps_per_execution=values.steps_per_execution or log_steps,
        max_call_seconds=values.max_call_seconds, verbose=2,
        say_placement=False,  # in the start banner
        steps_per_launch=values.steps_per_launch,
        timed_steps_per_log=values.timed_steps_per_log,
        straggler_threshold=values.straggler_threshold,
        noise_scale=noise_scale_from_flags(values), **more)


def train_records_from_flags(values, input_files, order: str, service):
    """The training set's `TFRecordConfig` from the record flags both jobs
    name alike (shuffle buffer, cycle length, determinism, seed, corrupt
    records), the files and order the entry point chose and the service
    (`data_service_from_flags`)."""
    from input_pipelines.tfrecord import TFRecordConfig
    return TFRecordConfig(
        input_files, training=True,
        shuffle_buffer_size=values.shuffle_buffer_size,
        cycle_length=values.cycle_length,
        deterministic=values.deterministic, seed=values.seed,
        skip_corrupt=values.skip_corrupt_records, order=order,
        verify_records=values.verify_records,
        allow_partial_shards=values.allow_partial_shards,
        service=service)


def define_noise_scale_flags(flags, default_groups: str = "", **kwargs
                             ) -> None:
    """The gradient noise scale flags of an entry point (`kwargs`: its
    `module_name` section); `default_groups` as --noise_scale_groups."""
    flags.DEFINE_enum(
        "noise_scale", "plain", ["plain", "preconditioned", "off"],
        "Measure the gradient noise scale B_simple (the batch at which the "
        "gradient's noise equals its signal; docs/batch-size.md) in every "
        "step, at no extra collective: plain, preconditioned (Adam/LAMB: "
        "gradients over sqrt(v_hat)+eps) or off. Needs >= 2 micro-batches "
        "per step (workers x accumulation).",
        **kwargs)
    flags.DEFINE_float(
        "noise_scale_decay", 0.99, "Moving-average decay of the noise "
        "scale's estimates (window about 1/(1-decay) steps).", **kwargs)
    flags.DEFINE_string(
        "noise_scale_groups", default_groups, "Also measure per variable "
        "group: name=regex[|regex],... on variable paths ('' : the whole "
        "model only).", **kwargs)


def noise_scale_from_flags(flags_values):
    """A `NoiseScaleConfig` from `define_noise_scale_flags`' flags.

    Raises:
        ValueError: "--noise_scale...: ..." naming the flag at fault.
    """
    from tfscale.noise import scale as noise_scale
    try:
        groups = noise_scale.parse_groups(flags_values.noise_scale_groups)
    except ValueError as e:
        raise ValueError(f"--noise_scale_groups: {e}") from None
    try:
        return noise_scale.NoiseScaleConfig(
            mode=flags_values.noise_scale,
            decay=flags_values.noise_scale_decay, groups=groups)
    except ValueError as e:
        raise ValueError(f"--noise_scale: {e}") from None

