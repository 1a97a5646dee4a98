"""Flags the job entry points share, and the configs they make of them
(TensorFlow is not imported here: the entry points define flags before it
loads). Each `define_*` takes the entry point's `module_name` section as
`kwargs`; each `*_from_flags` reads parsed flag values."""

import os


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


def define_cluster_flags(flags, **kwargs) -> None:
    """How the workers join and sum gradients."""
    flags.DEFINE_enum(
        "backend", "mwms", ["mwms", "mpi"],
        "How workers sum gradients: mwms = MultiWorkerMirroredStrategy "
        "(workers from TF_CONFIG or SLURM; NCCL on GPUs); mpi = "
        "MPI.Allreduce between the ranks of mpirun, launch.local --backend "
        "mpi or srun --mpi=pmix (CPU clusters; pip install 'tfscale[mpi]').",
        **kwargs)
    flags.DEFINE_enum("all_reduce_alg", "auto", ["auto", "ring", "nccl"],
                      "Collective implementation.", **kwargs)
    flags.DEFINE_integer("bytes_per_pack", 0, "All-reduce pack size (0: one "
                         "pack).", **kwargs)
    flags.DEFINE_float("collective_timeout", 300,
                       "Seconds before a collective fails.", **kwargs)
    flags.DEFINE_float("connect_timeout", 120,
                       "Seconds for all workers to join.", **kwargs)
    flags.DEFINE_integer("slurm_port_base", 8888, "Port of task 0 on each "
                         "SLURM node.", **kwargs)


def cluster_from_flags(values, backend: str):
    """A `ClusterConfig` from `define_cluster_flags`' flags (`backend`: the
    entry point's reading of --backend and its aliases)."""
    from tfscale.cluster import ClusterConfig
    return ClusterConfig(
        backend=backend, all_reduce_alg=values.all_reduce_alg,
        bytes_per_pack=values.bytes_per_pack,
        collective_timeout_seconds=values.collective_timeout,
        connect_timeout_seconds=values.connect_timeout,
        slurm_port_base=values.slurm_port_base)


def train_from_flags(values, *, precision: str, log_steps: int, **more):
    """A `TrainConfig` from the flags both jobs name alike (batch,
    accumulation, XLA, clipping, checkpoints in --output_dir, the noise
    scale); `more`: fields of the entry point's own flags. The host loop is
    the log interval: up to `log_steps` steps per call of the compiled step
    (Google's `iterations_per_loop`), so the host reads the device once per
    interval."""
    from tfscale.edge import noise_scale_from_flags
    from tfscale.train_config import TrainConfig
    return TrainConfig(
        global_batch_size=values.train_batch_size,
        num_accumulation_steps=values.num_accumulation_steps,
        jit_compile=values.xla,
        clip_global_norm=values.clip_global_norm or None,
        precision=precision,
        checkpoint_dir=os.path.join(values.output_dir, "checkpoints"),
        save_checkpoints_steps=values.save_checkpoints_steps,
        log_steps=log_steps, steps_per_execution=log_steps, verbose=2,
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
        service=service)
