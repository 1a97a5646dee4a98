"""Flags the job entry points share that reach beyond the engine (TensorFlow
is not imported here: the entry points define flags before it loads)."""

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
