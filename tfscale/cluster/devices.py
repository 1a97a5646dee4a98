"""The devices a strategy's replicas sit on in this process, for any
strategy, TensorFlow's default one included."""


def worker_devices(strategy) -> tuple:
    """The devices `strategy` holds replicas on in this process. TensorFlow's
    default strategy (a model built and compiled outside any
    `strategy.scope()`, as for Keras's `fit`) says none: its one replica is
    on the device TensorFlow places variables on, the first GPU or the CPU."""
    try:
        return tuple(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy: "unsupported"
        import tensorflow as tf
        gpus = tf.config.list_logical_devices("GPU")
        return (gpus[0].name if gpus else "/job:localhost/replica:0/task:0/"
                "device:CPU:0",)


def is_default_strategy(strategy) -> bool:
    """Whether `strategy` is TensorFlow's default (no `strategy.scope()`
    was entered where the model was built)."""
    try:
        strategy.extended.worker_devices
    except RuntimeError:
        return True
    return False
