"""Horovod's Keras callbacks (`hvd.callbacks.*`), for Keras 3 and tf_keras.

They subclass `tf.keras.callbacks.Callback`, which is Keras 3 or tf_keras
(`TF_USE_LEGACY_KERAS=1`) as the process chose.
"""

import sys

import numpy as np
import tensorflow as tf

from tfscale.horovod import _state, functions


def _variables(holder) -> list:
    """`holder.variables` as a list (a method in Keras 2, a list in 3)."""
    if holder is None:
        return []
    variables = holder.variables
    if callable(variables) and not isinstance(variables, (list, tuple)):
        variables = variables()
    return list(variables)


def _say(message: str) -> None:
    if _state.rank() == 0:
        sys.stderr.write(f"tfscale.horovod: {message}\n")
        sys.stderr.flush()


class BroadcastGlobalVariablesCallback(tf.keras.callbacks.Callback):
    """Gives every rank rank `root_rank`'s weights and optimizer state.

    At the start of training it broadcasts every variable the model and its
    optimizer have, so the first step starts from the same weights on every
    rank. Variables created by the first step (tf_keras builds optimizers
    and subclassed models lazily) are broadcast after it, as Horovod does.
    XLA is turned off for `fit` (with a note): MPI is called from the host.
    """

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self._seen = None

    def set_model(self, model):
        super().set_model(model)
        if getattr(model, "jit_compile", None) is True:
            model.jit_compile = False
            _say("jit_compile turned off for fit(): the all-reduce runs on "
                 "the host (tfscale's Trainer --xla compiles the step and "
                 "reduces outside it)")

    def _all(self) -> list:
        return _variables(self.model) + _variables(
            getattr(self.model, "optimizer", None))

    def on_train_begin(self, logs=None):
        variables = self._all()
        functions.broadcast_variables(variables, self.root_rank)
        self._seen = len(variables)

    def on_train_batch_end(self, batch, logs=None):
        if self._seen is None:
            return
        variables = self._all()
        if len(variables) != self._seen:
            functions.broadcast_variables(variables, self.root_rank)
        self._seen = None


class MetricAverageCallback(tf.keras.callbacks.Callback):
    """Replaces each epoch's logged metrics by their mean over all ranks.

    Put it before callbacks that read the logs (checkpoints, early
    stopping, schedulers on a metric), as with Horovod.
    """

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or _state.size() == 1:
            return
        numeric = {k: float(np.asarray(v)) for k, v in logs.items()
                   if np.ndim(v) == 0 and _is_number(v)}
        everyone = functions.allgather_object(numeric)
        keys = sorted(numeric)
        for rank, theirs in enumerate(everyone):
            if sorted(theirs) != keys:
                raise ValueError(
                    f"tfscale.horovod: MetricAverageCallback: rank {rank} "
                    f"logged {sorted(theirs)}, rank {_state.rank()} {keys}")
        for key in keys:
            logs[key] = float(np.mean([theirs[key] for theirs in everyone]))


def _is_number(value) -> bool:
    try:
        float(np.asarray(value))
        return True
    except (TypeError, ValueError):
        return False


class LearningRateScheduleCallback(tf.keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` between
    `start_epoch` and `end_epoch` (Horovod's semantics).

    Args:
        initial_lr: The learning rate the multiplier scales.
        multiplier: A float, or a function of the (fractional) epoch.
        start_epoch, end_epoch: Epochs [start, end) it applies to (end None:
            to the end).
        staircase: Change at epoch starts (True) or at every batch, with
            the epoch as a fraction (False).
        momentum_correction: Scale the momentum by new/old learning rate for
            the batch the rate changes in, where the optimizer keeps its
            momentum in a variable (tf_keras legacy optimizers); Keras 3's
            momentum is a constant of the compiled step, so it is skipped
            there with a note.
        steps_per_epoch: Batches per epoch (default: fit's `steps`).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None,
                 staircase=True, momentum_correction=True,
                 steps_per_epoch=None):
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self._restore_momentum = None
        self._noted = False
        self.multiplier = (multiplier if callable(multiplier)
                           else (lambda epoch: multiplier))

    def _in_range(self, epoch) -> bool:
        return self.start_epoch <= epoch and (
            self.end_epoch is None or epoch < self.end_epoch)

    def _optimizer(self):
        optimizer = self.model.optimizer
        return getattr(optimizer, "inner_optimizer", optimizer)

    def _adjust(self, epoch):
        optimizer = self._optimizer()
        old = _learning_rate(optimizer)
        new = self.initial_lr * self.multiplier(epoch)
        _set_learning_rate(optimizer, new)
        momentum = getattr(optimizer, "momentum", None)
        if not self.momentum_correction or not momentum or old == new:
            return
        if hasattr(momentum, "assign"):
            value = float(np.asarray(momentum.numpy()))
            self._restore_momentum = (momentum, value)
            momentum.assign(value * new / old)
        elif not self._noted:
            self._noted = True
            _say("momentum correction skipped: this optimizer's momentum is "
                 "a constant of the compiled step, not a variable")

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError(
                f"tfscale.horovod: {type(self).__name__} needs "
                "steps_per_epoch: the input's length is unknown (pass "
                "steps_per_epoch= to the callback or to fit)")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase and self._in_range(self.current_epoch):
            self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            variable, value = self._restore_momentum
            variable.assign(value)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _learning_rate(self._optimizer())


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warmup: the learning rate climbs from
    `initial_lr / size()` to `initial_lr` over `warmup_epochs`, batch by
    batch (Horovod's formula, with round values at each epoch's end)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            size = _state.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0,
                         end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and (
                _state.rank() == 0):
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate "
                  f"warmup to {_learning_rate(self._optimizer()):g}.")


def _learning_rate(optimizer) -> float:
    value = optimizer.learning_rate
    if callable(value) and not hasattr(value, "numpy"):
        raise ValueError(
            "tfscale.horovod: the optimizer's learning rate is a schedule; "
            "the learning-rate callbacks set a float learning rate")
    return float(np.asarray(value.numpy() if hasattr(value, "numpy")
                            else value))


def _set_learning_rate(optimizer, value: float) -> None:
    rate = getattr(optimizer, "_learning_rate", None)
    if isinstance(rate, (tf.keras.optimizers.schedules.LearningRateSchedule,)):
        raise ValueError(
            "tfscale.horovod: the optimizer's learning rate is a schedule; "
            "the learning-rate callbacks set a float learning rate")
    optimizer.learning_rate = value
