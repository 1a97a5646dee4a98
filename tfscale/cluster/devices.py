"""The GPUs this process sees, and the devices a strategy's replicas sit on
in this process, for any strategy, TensorFlow's default one included."""

from typing import Tuple


def visible_gpus() -> Tuple[str, ...]:
    """The GPUs this process sees, as TensorFlow names its logical devices
    ("/device:GPU:0", ...): one per visible physical GPU (after
    `CUDA_VISIBLE_DEVICES` and `tf.config.set_visible_devices`), or as many
    as `tf.config.set_logical_device_configuration` split it into.

    Counted from the device configuration, not from the runtime's device
    list: a MultiWorkerMirroredStrategy must configure its collectives
    before TensorFlow's runtime starts ("Collective ops must be configured
    at program startup"), and listing logical devices starts it."""
    import tensorflow as tf
    count = 0
    for gpu in tf.config.get_visible_devices("GPU"):
        count += len(tf.config.get_logical_device_configuration(gpu) or [gpu])
    return tuple(f"/device:GPU:{i}" for i in range(count))


def worker_devices(strategy) -> tuple:
    """The devices `strategy` holds replicas on in this process. TensorFlow's
    default strategy (a model built and compiled outside any
    `strategy.scope()`, as for Keras's `fit`) says none: its one replica is
    on the device TensorFlow places variables on, the first GPU or the CPU."""
    try:
        return tuple(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy: "unsupported"
        gpus = visible_gpus()
        return (gpus[0] if gpus else "/job:localhost/replica:0/task:0/"
                "device:CPU:0",)


def is_default_strategy(strategy) -> bool:
    """Whether `strategy` is TensorFlow's default (no `strategy.scope()`
    was entered where the model was built)."""
    try:
        strategy.extended.worker_devices
    except RuntimeError:
        return True
    return False
