"""Chief-only files for Keras's own callbacks, on disk on every way out.

Keras 3's file-writing callbacks have no notion of a chief (docs/facts.md, fact
9): under MultiWorkerMirroredStrategy every worker would write, and race on,
the same paths. Each worker still runs every callback (a callback may take
part in collectives or decide `stop_training`), but on non-chief workers the
files go to a private temporary directory that is removed at the end.

Keras closes a callback's files in `on_train_end`, which a run that fails or
is preempted never reaches; the Trainer closes them when `fit` unwinds with
an error (`close_writers`), so a process that goes on (or leaves) holds
nothing half-written. (What is logged is on disk before the next step can
block: TensorBoard's writer is flushed at every batch's begin, CSVLogger's
file after every row.) BackupAndRestore's backup is kept then: only a normal
end deletes it.

BackupAndRestore is special: every worker must *restore* from the chief's
backup (so all start from the same weights), and only then are its writes
redirected.
"""

import os
from typing import Optional

from absl import logging

import keras

from tfscale.keras import callbacks as _compat_callbacks
from tfscale.errors import ConfigError

# Callback class -> attributes that name where it writes.
_WRITE_TARGETS = (
    (keras.callbacks.ModelCheckpoint, ("filepath",)),
    (keras.callbacks.TensorBoard, ("log_dir",)),
    (keras.callbacks.CSVLogger, ("filename",)),
)


def _private_path(path: str, worker_dir: str) -> str:
    return os.path.join(worker_dir, os.path.basename(os.path.normpath(path)))


def route_writes(callbacks, worker_dir: str) -> None:
    """Points the write targets of Keras's file callbacks into `worker_dir`.

    Call on non-chief workers only, before `set_model`.
    """
    for callback in callbacks:
        for cls, attributes in _WRITE_TARGETS:
            if isinstance(callback, cls):
                for attribute in attributes:
                    setattr(callback, attribute, _private_path(
                        getattr(callback, attribute), worker_dir))


def make_backups_atomic(callbacks) -> None:
    """Every BackupAndRestore writes its backup through files renamed into
    place (`_compat_callbacks.atomic_backup`): a worker killed while
    writing it leaves the previous backup whole."""
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            _compat_callbacks.atomic_backup(callback)


def route_backup_writes(callbacks, worker_dir: str) -> None:
    """Redirects BackupAndRestore's writes after it restored from the chief.

    Call on non-chief workers only, after `on_train_begin`.
    """
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            _compat_callbacks.redirect_backup(
                callback, os.path.join(worker_dir, "backup"))


def close_writers(callbacks) -> None:
    """Flushes and closes the files of Keras's TensorBoard and CSVLogger
    callbacks, as their `on_train_end` would, without the rest of
    `on_train_end` (which a failed run must not run: BackupAndRestore's
    deletes the backup)."""
    for callback in callbacks:
        try:
            if isinstance(callback, keras.callbacks.TensorBoard):
                for writer in _compat_callbacks.tensorboard_writers(callback):
                    writer.close()
            elif isinstance(callback, keras.callbacks.CSVLogger):
                csv_file = getattr(callback, "csv_file", None)
                if csv_file is not None and not csv_file.closed:
                    csv_file.close()
        except Exception as e:  # noqa: BLE001 - the run's own error matters
            logging.warning("tfscale: could not close the files of %s: %s",
                            type(callback).__name__, e)


def fit_callbacks(callbacks, model, worker_dir: Optional[str], *,
                  verbose: int, progress_bar: bool, epochs: int,
                  steps_per_epoch: int, sharded: bool = False):
    """(the callbacks as a list, the `keras.callbacks.CallbackList` a fit
    calls) with every BackupAndRestore committing atomically and, on a
    worker (`worker_dir`), every file write routed there.

    Raises:
        ConfigError: A BackupAndRestore, or a ModelCheckpoint of the whole
            model (`save_weights_only=False`), with the optimizer state
            sharded (`sharded`): its file would hold the weights but not
            the moments, which the workers hold in slices.
    """
    callbacks = list(callbacks)
    if sharded and any(isinstance(c, keras.callbacks.BackupAndRestore)
                       for c in callbacks):
        raise ConfigError(
            "shard_optimizer_state", "keras.callbacks.BackupAndRestore "
            "cannot restore a run whose optimizer state is sharded "
            "(shard_optimizer_state=True): its backup holds the weights and "
            "the step, not the moments each worker holds a slice of. Resume "
            "from the Trainer's own checkpoints (TrainConfig(checkpoint_dir="
            "...)), which hold the whole optimizer state, or train unsharded")
    if sharded and any(isinstance(c, keras.callbacks.ModelCheckpoint)
                       and not c.save_weights_only for c in callbacks):
        raise ConfigError(
            "shard_optimizer_state", "keras.callbacks.ModelCheckpoint(save_"
            "weights_only=False) cannot save a model whose optimizer state "
            "is sharded (shard_optimizer_state=True): its .keras file would "
            "hold the weights and none of the moments each worker holds a "
            "slice of, and a load_model resume would restart the optimizer "
            "from zero. Pass save_weights_only=True (and resume from the "
            "Trainer's own checkpoints, TrainConfig(checkpoint_dir=...), "
            "which hold the whole optimizer state), or train unsharded")
    make_backups_atomic(callbacks)
    if worker_dir:
        route_writes(callbacks, worker_dir)
    return callbacks, keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=progress_bar, model=model,
        verbose=verbose, epochs=epochs, steps=steps_per_epoch)
