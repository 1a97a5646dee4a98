"""Version workarounds for TensorFlow and Keras, each with what it works around.

Everything in tfscale that touches a private TensorFlow or Keras name does it
here or, for Keras's callbacks (TensorBoard, BackupAndRestore), in
`keras/callbacks.py`, so an upgrade has two files to check. Each shim is gated on the versions
it was verified against (`CHECKED_WITH`: TensorFlow 2.21, Keras 3.15): on
others it still runs, since a private name often survives a release, but the
first call logs one warning naming the shim, so that a failure after an
upgrade points here. Shims whose private name is gone raise, naming it.
"""

import functools

import keras
import tensorflow as tf
from absl import logging

KERAS_VERSION = tuple(int(p) for p in keras.__version__.split(".")[:2])
TF_VERSION = tuple(int(p) for p in tf.__version__.split(".")[:2])
# The (major, minor) versions every shim below was checked with.
CHECKED_WITH = {"TensorFlow": (2, 21), "Keras": (3, 15)}


def unverified(running=None) -> str:
    """"TensorFlow 2.22" (what runs, where it is not what the shims were
    checked with), or "" when every version is a checked one."""
    running = running or {"TensorFlow": TF_VERSION, "Keras": KERAS_VERSION}
    return ", ".join(f"{name} {'.'.join(map(str, version))}"
                     for name, version in running.items()
                     if version != CHECKED_WITH[name])


_UNVERIFIED = unverified()
_warned = set()  # shims that said so once


def shim(fn):
    """Marks `fn` as a shim checked with `CHECKED_WITH`: on other versions
    its first call logs which shim to suspect."""
    name = f"{fn.__module__.removeprefix('tfscale.')}.{fn.__name__}"

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if _UNVERIFIED and name not in _warned:
            _warned.add(name)
            logging.warning(
                "tfscale: %s uses private TensorFlow/Keras names "
                "checked with TensorFlow %s and Keras %s; this is %s (if it "
                "fails, look there first)", name,
                ".".join(map(str, CHECKED_WITH["TensorFlow"])),
                ".".join(map(str, CHECKED_WITH["Keras"])), _UNVERIFIED)
        return fn(*args, **kwargs)
    checked.checked_with = dict(CHECKED_WITH)
    return checked


@shim
def slurm_expand_hostlist(hostlist: str) -> list:
    """'node[01-02],gpu7' -> ['node01', 'node02', 'gpu7'].

    SLURM's hostlist grammar; TensorFlow's SlurmClusterResolver module has
    the parser as a module-level function but does not export it.
    """
    from tensorflow.python.distribute.cluster_resolver import (
        slurm_cluster_resolver)
    return slurm_cluster_resolver.expand_hostlist(hostlist)


@shim
def slurm_expand_tasks_per_node(spec: str) -> list:
    """'2(x3),1' -> [2, 2, 2, 1] (SLURM_STEP_TASKS_PER_NODE's grammar)."""
    from tensorflow.python.distribute.cluster_resolver import (
        slurm_cluster_resolver)
    return slurm_cluster_resolver.expand_tasks_per_node(spec)


_MISSING = object()


@shim
def disable_gradient_aggregation(optimizer) -> list:
    """Stops a Keras 3 optimizer from all-reducing gradients itself.

    Keras 3's TensorFlow optimizer sums gradients across replicas inside
    `apply()` when it runs in a replica context (docs/facts.md, fact 3). The
    Trainer all-reduces once itself (to time it, clip after it, check it for
    non-finite values and accumulate before it), so the optimizer must take
    the already-reduced gradients as they are; otherwise every update would
    be num_replicas times too large. Applies to the wrapped optimizer too.
    Read when a step is traced: `restore_gradient_aggregation` undoes it
    for what is traced later (a `model.fit` of the user's own).

    Args:
        optimizer: A `keras.optimizers.Optimizer` (TensorFlow backend).

    Returns:
        What `restore_gradient_aggregation` takes to undo it.
    """
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise TypeError(
            f"{type(optimizer).__name__} has no _all_reduce_sum_gradients: "
            f"this Keras ({keras.__version__}) is not the one tfscale "
            "supports")
    saved = [(optimizer, optimizer.__dict__.get("_all_reduce_sum_gradients",
                                                _MISSING))]
    optimizer._all_reduce_sum_gradients = lambda grads_and_vars: list(
        grads_and_vars)
    # keras.optimizers.LossScaleOptimizer.apply calls its inner optimizer's
    # apply, which would all-reduce again: N workers, N times the gradient.
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        saved += disable_gradient_aggregation(inner)
    return saved


@shim
def restore_gradient_aggregation(saved: list) -> None:
    """Undoes `disable_gradient_aggregation` (its return value)."""
    for optimizer, previous in saved:
        if previous is _MISSING:
            optimizer.__dict__.pop("_all_reduce_sum_gradients", None)
        else:
            optimizer._all_reduce_sum_gradients = previous


@shim
def fix_keras_multi_worker_bugs():
    """Lets plain Keras 3 `model.fit` run under MultiWorkerMirroredStrategy.

    Works around keras-team/keras#20585 (docs/facts.md, facts 1 and 6), two bugs
    in `keras/src/backend/tensorflow/trainer.py`:
      * `_maybe_symbolic_build` calls `strategy.reduce("MEAN", batch)` on the
        first (PerReplica) batch, which fails under MWMS. Building only needs
        shapes, so the first local replica's batch is enough.
      * `reduce_per_replica` reduces scalar logs with `axis=0`, which fails
        for a rank-0 value under MWMS. Scalars are reduced with `axis=None`.

    Called by `tfscale.enable_multi_worker_fit` (keras/multi_worker_fit.py), which adds
    what a correct multi-worker `fit` needs beyond these two fixes.
    Idempotent.

    Raises:
        RuntimeError: Keras is not a version this shim was verified against.
    """
    if KERAS_VERSION[0] != 3 or KERAS_VERSION < (3, 10):
        raise RuntimeError(
            f"enable_multi_worker_fit supports Keras 3.10+, found "
            f"{keras.__version__}")
    from keras.src.backend.tensorflow import trainer as tf_trainer
    if getattr(tf_trainer, "_tfscale_patched", False):
        return

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None:
            return
        if iterator is not None:
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tf.nest.map_structure(
                    lambda v: (self.distribute_strategy.
                               experimental_local_results(v)[0]
                               if isinstance(v, tf.distribute.DistributedValues)
                               else v), batch)
                break
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    original_reduce = tf_trainer.reduce_per_replica

    @functools.wraps(original_reduce)
    def reduce_per_replica(values, strategy, reduction):
        if (tf_trainer._collective_all_reduce_multi_worker(strategy)
                and reduction in ("auto", "mean")):
            def _reduce(v):
                # With one device per worker, strategy.run returns plain
                # tensors rather than PerReplica values: check the local one.
                local = strategy.experimental_local_results(v)[0]
                if getattr(local, "shape", None) is not None and \
                        local.shape.rank == 0:
                    return strategy.reduce("MEAN", v, axis=None)
                return original_reduce(v, strategy, reduction)
            return tf.nest.map_structure(_reduce, values)
        return original_reduce(values, strategy, reduction)

    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer.reduce_per_replica = reduce_per_replica
    tf_trainer._tfscale_patched = True


@shim
def wrap_keras_fit(wrapper) -> None:
    """Routes every Keras 3 (TensorFlow backend) `model.fit` call through
    `wrapper(fit, model, *args, **kwargs)`. Idempotent."""
    from keras.src.backend.tensorflow import trainer as tf_trainer
    cls = tf_trainer.TensorFlowTrainer
    if getattr(cls.fit, "_tfscale_wrapper", None) is wrapper:
        return
    fit = getattr(cls.fit, "_tfscale_original", cls.fit)

    @functools.wraps(fit)
    def wrapped_fit(self, *args, **kwargs):
        return wrapper(fit, self, *args, **kwargs)
    wrapped_fit._tfscale_wrapper = wrapper
    wrapped_fit._tfscale_original = fit
    cls.fit = wrapped_fit


@shim
def communication_options(strategy):
    """The `CommunicationOptions` the strategy was created with, or None.

    A replica-context `all_reduce` merges the strategy's implementation
    choice but takes `bytes_per_pack` only from the options passed to it
    (tensorflow/python/distribute/cross_device_ops.py, `_all_reduce`), so
    the step passes the strategy's own; reading them here means callers
    give them once, to the strategy.
    """
    return getattr(strategy.extended, "_communication_options", None)


@shim
def compiled_metrics(model) -> list:
    """The metrics of `model.compile(metrics=...)`, as one Keras metric whose
    `result()` is a dict ({"accuracy": ...}): Keras keeps them in the private
    `CompileMetrics` container, which resolves names like "accuracy" from
    the shapes of the first batch (see `build_compiled_metrics`)."""
    container = getattr(model, "_compile_metrics", None)
    return [container] if container is not None else []


@shim
def build_compiled_metrics(model, metrics, element_spec_fn) -> None:
    """Builds `compile`'s metric container (and loss) from the shapes of one
    per-replica batch (`element_spec_fn()`, called only when needed), as
    `fit` does before its first step: their variables must exist before the
    step is traced under the strategy."""
    container = getattr(model, "_compile_metrics", None)
    if container is None or container.built or container not in metrics:
        return
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=element_spec_fn())


@shim
def new_host_tensor(shape, dtype):
    """(an uninitialised tensor in host memory, a writable NumPy view of its
    buffer), for MPI to fill in place (eager).

    TF 2.21's `EagerTensor._numpy()` of a host tensor is a view of its
    buffer (the public `numpy()` copies; `np.asarray` is read-only). The
    tensor is pinned to the host: on a GPU `_numpy()` is a host copy, and
    filling it would leave the device tensor uninitialised.
    """
    with tf.device("/cpu:0"):
        tensor = tf.raw_ops.Empty(shape=shape, dtype=dtype)
    view = tensor._numpy()
    if not view.flags.writeable:  # a TensorFlow that no longer shares it
        raise RuntimeError("tfscale: this TensorFlow's host tensors give no "
                           "writable view (checked with 2.21)")
    return tensor, view


@shim
def gradient_may_be_recorded(tensors) -> bool:
    """Whether an active `tf.GradientTape` watches any of `tensors` (eager).

    tfscale.horovod's collectives skip `tf.custom_gradient`'s overhead
    (a signature inspection per call) when no tape could use it.
    """
    try:
        from tensorflow.python.eager import record
        return bool(record.should_record_backprop(tensors))
    except (ImportError, AttributeError):
        return True


@shim
def in_xla_context() -> bool:
    """Whether the graph being built is compiled by XLA (jit_compile=True),
    where a `tf.numpy_function` cannot run."""
    try:
        from tensorflow.python.ops import control_flow_util
        return bool(control_flow_util.GraphOrParentsInXlaContext(
            tf.compat.v1.get_default_graph()))
    except (ImportError, AttributeError):
        return False


class CallableList(list):
    """A list that returns itself when called (Keras 2's `opt.variables()`)."""

    def __call__(self):
        return self


@shim
def allow_calling_optimizer_variables() -> None:
    """Keras 3's `Optimizer.variables` as a `CallableList`.

    Horovod's TF2 examples broadcast `opt.variables()`: a method in Keras 2,
    a list property in Keras 3 (docs/facts.md, fact 23). Returning a list that
    also answers a call lets those lines run unchanged; it is a list in
    every other respect. Idempotent.
    """
    for cls in keras.optimizers.Optimizer.__mro__:
        prop = cls.__dict__.get("variables")
        if isinstance(prop, property):
            break
    else:
        return
    if getattr(prop.fget, "_tfscale_callable", False):
        return

    def variables(self):
        return CallableList(prop.fget(self))
    variables._tfscale_callable = True
    setattr(cls, "variables", property(variables, doc=prop.__doc__))

@shim
def coordination_service():
    """This process's coordination-service agent, as the eager context (it
    has `wait_at_barrier`, `set_config_key_value` and
    `get_config_key_value`), or None when no service is configured.

    MultiWorkerMirroredStrategy starts TensorFlow's coordination service
    (its leader is task 0) for any cluster from TF_CONFIG or SLURM; its
    barriers and key-value store are reachable only through the private
    eager context (tensorflow/python/eager/context.py).
    """
    from tensorflow.python.eager import context
    ctx = context.context()
    if not ctx.coordination_service:
        return None
    return ctx


@shim
def configure_coordination(cluster: dict, heartbeat_timeout_seconds: float
                           ) -> None:
    """Starts TensorFlow's coordination service as MultiWorkerMirroredStrategy
    would (leader: the chief, else worker 0; the chief and worker jobs
    coordinated), with this heartbeat timeout: a task silent that long is
    held to have failed, and every task's next collective fails naming it.
    MultiWorkerMirroredStrategy configures the service only where none is
    (collective_all_reduce_strategy.py, `_initialize_multi_worker`), with
    TensorFlow's default timeout (10 s), which a loaded host can miss.
    Call before building the strategy."""
    import tensorflow as tf
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context
    spec = tf.train.ClusterSpec(dict(cluster))
    jobs = [coordination_config_pb2.CoordinatedJob(
        name=job, num_tasks=spec.num_tasks(job))
        for job in ("chief", "worker") if job in spec.jobs]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=jobs,
        heartbeat_timeout_in_ms=int(heartbeat_timeout_seconds * 1000))


@shim
def runtime_started() -> bool:
    """Whether this process's TensorFlow runtime (the eager context) has
    started: a tensor, a dataset or a model made it. Read from the eager
    context's handle (tensorflow/python/eager/context.py), which
    MultiWorkerMirroredStrategy needs unset to configure collectives."""
    from tensorflow.python.eager import context
    return context.context()._context_handle is not None


@shim
def heartbeat_timeout_ms() -> int:
    """The coordination service's configured heartbeat timeout in ms (0:
    TensorFlow's default), as the eager context holds it."""
    from tensorflow.python.eager import context
    return context.context().config.experimental.coordination_config \
        .heartbeat_timeout_in_ms


@shim
def second_moments(optimizer, variables):
    """The second-moment slots (Adam's v) of an Adam-family optimizer, one
    per variable in `variables`' order; None if it keeps none.

    Keras 3's Adam/AdamW and tfscale's LAMB keep them in `_velocities`,
    indexed by `_get_variable_index` (not public API).
    """
    moments = getattr(optimizer, "_velocities", None)
    if not moments or not all(hasattr(optimizer, a)
                              for a in ("beta_2", "epsilon")):
        return None
    return [moments[variable_index(optimizer, v)] for v in variables]


@shim
def variable_index(optimizer, variable) -> int:
    """The index of `variable` in a Keras 3 optimizer's slot lists (what
    Keras's own optimizers read their slots by in `update_step`, where the
    TensorFlow backend passes the raw `tf.Variable`)."""
    return optimizer._get_variable_index(variable)


@shim
def uses_weight_decay(optimizer, variable) -> bool:
    """Whether a Keras 3 optimizer decays `variable` (its exclusions by
    variable and by name pattern, `_use_weight_decay`)."""
    return bool(optimizer._use_weight_decay(variable))


@shim
def all_to_all(strategy, rows, options=None):
    """`rows[j]` sent to worker j of a MultiWorkerMirroredStrategy of one
    replica per worker; returns
    [replicas, ...]: row i from replica i. Inside a replica context.

    TensorFlow 2.21 has `CollectiveAllToAllV2` on CPUs and GPUs but no
    strategy method for it, and its reduce-scatter op has only an NCCL
    kernel: this issues the op with the strategy's own group, instance keys
    and ordering token (`cross_device_utils.CollectiveReplicaLauncher`), so
    it is ordered with the strategy's all-reduces in the same function.
    """
    from tensorflow.python.ops import collective_ops
    cross_device_ops = strategy.extended._cross_device_ops
    launchers = cross_device_ops._launchers
    if len(launchers) != 1:
        raise ValueError("all_to_all needs one replica per worker, got "
                         f"{len(launchers)} devices here")
    launcher = launchers[0]
    merged = launcher._options.merge(options)
    instance_key = launcher._next_instance_key()
    with tf.device(launcher._device):
        return collective_ops.all_to_all_v2(
            rows, launcher._group_size, launcher._group_key, instance_key,
            communication_hint=merged.implementation.value,
            timeout=merged.timeout_seconds or 0,
            ordering_token=launcher._get_ordering_token())


@shim
def variable_value_key() -> str:
    """The attribute name under which a checkpoint keeps a variable's value
    ("VARIABLE_VALUE": `.ATTRIBUTES/VARIABLE_VALUE` in its keys)."""
    from tensorflow.python.trackable import base
    return base.VARIABLE_VALUE_KEY


@shim
def trackable_base():
    """TensorFlow's `Trackable` base class: an object that writes its own
    tensors into object-based checkpoints (`_serialize_to_tensors`,
    `_restore_from_tensors`) and its SaveSpec (a tensor written lazily)."""
    from tensorflow.python.trackable import base
    from tensorflow.python.training.saving import saveable_object
    return base.Trackable, saveable_object.SaveSpec


@shim
def learning_rate_schedule(optimizer):
    """The optimizer's `LearningRateSchedule`, or None for a fixed rate
    (Keras 3 keeps the schedule object in `_learning_rate`)."""
    schedule = getattr(optimizer, "_learning_rate", None)
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return schedule
    return None


@shim
def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` was called
    (TensorFlow 2.21 exports no reader of it)."""
    from tensorflow.python.framework import config
    return bool(config.is_op_determinism_enabled())
