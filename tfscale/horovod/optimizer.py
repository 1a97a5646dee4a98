"""Horovod's `DistributedGradientTape` and `DistributedOptimizer`.

Both average (by default) the gradients over all ranks before they are
used: one fused all-reduce per dtype (per group with `num_groups`), as
tfscale's own MPI backend does. The optimizer wraps Keras 3 optimizers
(TensorFlow 2.21's default), tf_keras ones (`TF_USE_LEGACY_KERAS=1`, new
and legacy) and `tf.compat.v1.train.Optimizer`s: the object gets a subclass
of its own class that reduces in `apply` / `apply_gradients` /
`compute_gradients`, so everything else about it (its variables, config,
checkpoints, learning rate) is unchanged.
"""

import dataclasses
from typing import List, Optional

import tensorflow as tf

from tfscale.horovod import _state, ops
from tfscale.horovod.compression import Compression


@dataclasses.dataclass(frozen=True)
class _Reduction:
    """How gradients are reduced (the tape's and optimizer's arguments)."""

    compression: type = Compression.none
    sparse_as_dense: bool = False
    op: int = ops.Average
    gradient_predivide_factor: float = 1.0
    num_groups: int = 0

    def __post_init__(self):
        if self.op == ops.Adasum:
            ops.resolve_op(self.op, None)
        if self.op not in (ops.Average, ops.Sum):
            raise ValueError("tfscale.horovod: gradients are reduced with "
                             "op=hvd.Average or hvd.Sum")
        if self.gradient_predivide_factor != 1.0 and self.op != ops.Average:
            raise ValueError("gradient_predivide_factor not supported with "
                             "op != Average")
        if self.num_groups < 0:
            raise ValueError(f"num_groups must be >= 0, got "
                             f"{self.num_groups}")

    def reduce(self, grads, name: str = "gradients") -> list:
        """The reduced `grads` (a list; None entries stay None)."""
        grads = list(grads)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g)
                     if isinstance(g, tf.IndexedSlices) else g for g in grads]
        factor = self.gradient_predivide_factor
        prescale, postscale = 1.0 / factor, factor
        out = list(grads)
        dense = [i for i, g in enumerate(grads)
                 if g is not None and not isinstance(g, tf.IndexedSlices)]
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                out[i] = ops.allreduce(g, op=self.op, name=f"{name}.{i}",
                                       prescale_factor=prescale,
                                       postscale_factor=postscale)
        for part, indices in enumerate(_groups(dense, self.num_groups)):
            reduced = ops.grouped_allreduce(
                [grads[i] for i in indices], op=self.op,
                compression=self.compression, prescale_factor=prescale,
                postscale_factor=postscale, name=f"{name}.group{part}")
            for i, r in zip(indices, reduced):
                out[i] = r
        return out


def _groups(indices: List[int], num_groups: int) -> List[List[int]]:
    """`indices` in `num_groups` consecutive parts (0: one part)."""
    if not indices:
        return []
    if num_groups <= 1:
        return [indices]
    size = -(-len(indices) // num_groups)
    return [indices[i:i + size] for i in range(0, len(indices), size)]


def _reduction(compression, sparse_as_dense, op, gradient_predivide_factor,
               num_groups, groups, process_set) -> _Reduction:
    ops.check_process_set(process_set)
    _state.get()
    if groups is not None and not isinstance(groups, int):
        # Which variables share an all-reduce changes the schedule only;
        # the sums are the same. Fused per dtype as one group.
        num_groups = 0
    elif isinstance(groups, int):
        num_groups = groups
    return _Reduction(compression or Compression.none, bool(sparse_as_dense),
                      ops.Average if op is None else op,
                      float(gradient_predivide_factor), int(num_groups or 0))


class DistributedGradientTape:
    """A `tf.GradientTape` whose `gradient()` reduces over all ranks.

        with tf.GradientTape() as tape:
            loss = ...
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    Every other method and attribute is the wrapped tape's.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="",
                 compression=Compression.none, sparse_as_dense=False,
                 op=ops.Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None,
                 process_set=ops.global_process_set,
                 scale_local_gradients=True):
        self.__dict__["_tape"] = gradtape
        self.__dict__["_reduction"] = _reduction(
            compression, sparse_as_dense, op, gradient_predivide_factor,
            num_groups, groups, process_set)
        self.__dict__["_local"] = set()
        self.__dict__["_scale_local"] = scale_local_gradients

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources,
                                    output_gradients=output_gradients,
                                    **kwargs)
        flat_grads = tf.nest.flatten(grads)
        flat_sources = tf.nest.flatten(sources)
        shared = [i for i, s in enumerate(flat_sources)
                  if id(s) not in self._local]
        reduced = self._reduction.reduce([flat_grads[i] for i in shared],
                                         name="DistributedGradientTape")
        out = list(flat_grads)
        for i, r in zip(shared, reduced):
            out[i] = r
        if self._scale_local and self._local:
            size = _state.size()
            for i, s in enumerate(flat_sources):
                if id(s) in self._local and out[i] is not None:
                    out[i] = out[i] / size
        return tf.nest.pack_sequence_as(grads, out)

    def register_local_source(self, source) -> None:
        """`source`'s gradient stays this rank's own (not reduced)."""
        self._local.add(id(source))

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)


class _Accumulation:
    """`backward_passes_per_step`: gradients summed locally over that many
    calls; every that-many-th call reduces and applies them (divided by the
    count with `average_aggregated_gradients`), the others only advance the
    optimizer's iteration count, as Horovod does."""

    def __init__(self, passes: int, average: bool):
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got "
                             f"{passes}")
        self.passes = passes
        self.average = average
        self.sums = None
        self.count = None

    def step(self, grads, apply_fn, iterations):
        if self.sums is None:
            with tf.init_scope():
                self.count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                         name="hvd_backward_passes")
                self.sums = [
                    None if g is None else tf.Variable(
                        tf.zeros(g.shape, g.dtype), trainable=False,
                        name="hvd_aggregated_gradient") for g in grads]
        updates = [s.assign_add(tf.convert_to_tensor(g))
                   for s, g in zip(self.sums, grads) if g is not None]
        with tf.control_dependencies(updates):
            count = self.count.assign_add(1)

        def flush():
            totals = [None if s is None else
                      (s / self.passes if self.average else s.read_value())
                      for s in self.sums]
            with tf.control_dependencies(
                    [t for t in totals if t is not None]):
                apply_fn(totals)
            for s in self.sums:
                if s is not None:
                    s.assign(tf.zeros_like(s))
            self.count.assign(0)
            return tf.constant(True)

        def skip():
            if iterations is not None:
                iterations.assign_add(1)
            return tf.constant(False)
        return tf.cond(count >= self.passes, flush, skip)


def _keras_kind(optimizer) -> Optional[str]:
    module = type(optimizer).__module__
    if module.startswith("keras."):
        return "keras3"
    if module.startswith("tf_keras."):
        return "tf_keras"
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return "v1"
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("keras."):
            return "keras3"
        if cls.__module__.startswith("tf_keras."):
            return "tf_keras"
    return None


class _Keras3Distributed:
    """Keras 3: `apply_gradients` and `fit` all go through `apply`."""

    def apply(self, grads, trainable_variables=None):
        hvd = self.__dict__["_hvd"]
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not self.built:
                self.build(trainable_variables)
        parent_apply = super().apply
        if hvd.accumulation is None:
            return parent_apply(hvd.reduction.reduce(grads),
                                trainable_variables)
        hvd.accumulation.step(
            grads, lambda g: parent_apply(hvd.reduction.reduce(g),
                                          trainable_variables),
            self.iterations)


class _TfKerasDistributed:
    """tf_keras (Keras 2) optimizers, new and legacy: `apply_gradients`."""

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        hvd = self.__dict__["_hvd"]
        pairs = list(grads_and_vars)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        parent = super().apply_gradients
        if hvd.accumulation is None:
            return parent(zip(hvd.reduction.reduce(grads), variables),
                          *args, **kwargs)
        if hasattr(self, "build") and not getattr(self, "_built", True):
            self.build(variables)
        return hvd.accumulation.step(
            grads, lambda g: parent(zip(hvd.reduction.reduce(g), variables),
                                    *args, **kwargs),
            getattr(self, "iterations", None))


class _V1Distributed:
    """`tf.compat.v1.train.Optimizer`: reduces in `compute_gradients`."""

    def compute_gradients(self, *args, **kwargs):
        hvd = self.__dict__["_hvd"]
        pairs = super().compute_gradients(*args, **kwargs)
        grads = hvd.reduction.reduce([g for g, _ in pairs])
        return list(zip(grads, [v for _, v in pairs]))


@dataclasses.dataclass
class _Settings:
    reduction: _Reduction
    accumulation: Optional[_Accumulation]


_MIXINS = {"keras3": _Keras3Distributed, "tf_keras": _TfKerasDistributed,
           "v1": _V1Distributed}


def DistributedOptimizer(optimizer, name=None, use_locking=False,
                         device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=ops.Average,
                         gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=ops.global_process_set,
                         scale_local_gradients=True):
    """`optimizer`, made to reduce its gradients over all ranks first.

    The same object is returned, its class now a subclass of its own class
    (named alike, so saved models and configs name the original class).

    Args:
        optimizer: A Keras 3, tf_keras or `tf.compat.v1.train` optimizer.
        compression, sparse_as_dense, op, gradient_predivide_factor,
        num_groups, groups: As for `DistributedGradientTape`.
        backward_passes_per_step: Reduce and apply every that many calls;
            the calls in between sum the gradients locally.
        average_aggregated_gradients: Divide those sums by
            `backward_passes_per_step`.
        name, use_locking, device_dense, device_sparse, process_set,
        scale_local_gradients: Horovod's; the global process set only.

    Raises:
        TypeError: Not an optimizer of those kinds.
    """
    kind = _keras_kind(optimizer)
    if kind is None:
        raise TypeError(
            "tfscale.horovod.DistributedOptimizer wraps Keras 3, tf_keras or "
            f"tf.compat.v1.train optimizers, not {type(optimizer).__name__}")
    if "_hvd" in optimizer.__dict__:
        raise ValueError("this optimizer is already a DistributedOptimizer")
    reduction = _reduction(compression, sparse_as_dense, op,
                           gradient_predivide_factor, num_groups, groups,
                           process_set)
    accumulation = None
    if backward_passes_per_step != 1:
        if kind == "v1":
            raise NotImplementedError(
                "tfscale.horovod: backward_passes_per_step needs a Keras "
                "optimizer (tf.compat.v1 optimizers reduce every step)")
        accumulation = _Accumulation(int(backward_passes_per_step),
                                     bool(average_aggregated_gradients))
    base = type(optimizer)
    distributed = type(base.__name__, (_MIXINS[kind], base),
                       {"__module__": base.__module__,
                        "__qualname__": base.__qualname__})
    optimizer.__dict__["_hvd"] = _Settings(reduction, accumulation)
    optimizer.__class__ = distributed
    return optimizer
