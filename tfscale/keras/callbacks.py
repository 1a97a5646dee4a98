"""Version workarounds for Keras's callbacks: TensorBoard's step counter and
writers, BackupAndRestore's epoch, paths and saves.

Shims as in `_compat.py` (gated on the versions they were checked with by
`_compat.shim`; a private name that is gone raises, naming it); with it,
the only files of tfscale that touch private Keras names.
"""

import contextlib
import glob
import json
import os
import shutil

import keras

from tfscale._compat import shim


@shim
def continue_tensorboard_steps(callbacks, step: int) -> None:
    """Makes Keras's TensorBoard callbacks count steps from `step`.

    `keras.callbacks.TensorBoard.on_train_begin` resets its private batch
    counter to 0, so after a resume every scalar would be written again at
    steps 1, 2, ... over the first run's. Call after `on_train_begin`.
    """
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.TensorBoard):
            callback._global_train_batch = step


@shim
def tensorboard_records_at(callbacks, step: int) -> None:
    """Makes Keras's TensorBoard callbacks that write per batch record the
    call that ended at `step` by that step, as their `on_train_batch_end`
    is about to.

    Keras 3.15 decides whether a batch's summaries are recorded in
    `on_train_batch_begin`, from its step count then (`_push_writer`'s
    `record_if(step % update_freq == 0)`): for a call of several steps,
    the call's first step, so `batch_loss` would be written only when a
    call happened to start on a multiple of `update_freq`. Here the
    writer is pushed again at the call's last step.
    """
    for callback in callbacks:
        if (isinstance(callback, keras.callbacks.TensorBoard)
                and callback.update_freq != "epoch"
                and callback._prev_summary_state):
            callback._global_train_batch = step
            callback._pop_writer()
            callback._push_writer(callback._train_writer, step)


@shim
def tensorboard_writers(callback) -> list:
    """The summary writers a `keras.callbacks.TensorBoard` has opened.

    Keras 3.15 keeps them in the private `_writers` dict (train, val) and
    flushes them only when a run ends normally (`on_train_end`).
    """
    return list(getattr(callback, "_writers", {}).values())


@shim
def tensorboard_train_writer(callback):
    """The summary writer of a `keras.callbacks.TensorBoard`'s train logs
    (Keras 3.15's private `_train_writer`, made on first use)."""
    return callback._train_writer


@shim
def clear_restored_epoch(model) -> None:
    """Forgets the epoch a `BackupAndRestore` callback restored before."""
    model._initial_epoch = None


@shim
def restored_epoch(model):
    """The epoch Keras 3's `BackupAndRestore` restored in `on_train_begin`
    (it sets `model._initial_epoch`, not public API), or None."""
    return getattr(model, "_initial_epoch", None)


@shim
@contextlib.contextmanager
def backups_not_loaded(callbacks, skip: bool):
    """Inside: every `keras.callbacks.BackupAndRestore` in `callbacks`
    loads nothing in `on_train_begin` when `skip` (the Trainer's checkpoint
    was restored and wins): Keras 3's private `_load_model` is replaced by
    a no-op on each instance, and put back after."""
    skipped = []
    if skip:
        for callback in callbacks:
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                _require_backup_attributes(callback, ["_load_model"])
                callback._load_model = lambda: None
                skipped.append(callback)
    try:
        yield
    finally:
        for callback in skipped:
            del callback._load_model


@shim
def _require_backup_attributes(callback, names) -> None:
    """Raises naming the first of BackupAndRestore's private `names` this
    Keras lacks."""
    missing = [n for n in names if not hasattr(callback, n)]
    if missing:
        raise RuntimeError(f"tfscale: this Keras ({keras.__version__}) has no "
                           f"BackupAndRestore.{missing[0]} (checked with "
                           "3.15)")


@shim
def redirect_backup(callback, backup_dir: str) -> None:
    """Points a `keras.callbacks.BackupAndRestore`'s writes at `backup_dir`.

    Keras 3.15 derives four private paths from `backup_dir` in `__init__`
    (the weights, the training metadata and their ".bkp" copies), so setting
    `backup_dir` later moves nothing by itself.
    """
    _require_backup_attributes(callback, (
        "_weights_path", "_training_metadata_path", "_prev_weights_path",
        "_prev_training_metadata_path"))
    callback.backup_dir = backup_dir
    callback._weights_path = os.path.join(backup_dir, "latest.weights.h5")
    callback._training_metadata_path = os.path.join(
        backup_dir, "training_metadata.json")
    callback._prev_weights_path = callback._weights_path + ".bkp"
    callback._prev_training_metadata_path = (
        callback._training_metadata_path + ".bkp")


@shim
def atomic_backup(callback) -> None:
    """Makes a `keras.callbacks.BackupAndRestore` commit its backup at one
    point, durably.

    Keras 3.15's `_save_model` writes `latest.weights.h5` and the training
    metadata in place: a process killed while writing them (a launcher's
    SIGKILL, the OOM killer) leaves a truncated file, and the restart fails
    in `on_train_begin`; two renames would leave, killed between them, the
    newer weights under the older epoch. Here the weights go to a hidden
    file of their own, then the metadata (epoch, batch and that file's name)
    is renamed into place: the commit. Last the weights file is renamed
    over `latest.weights.h5`; a kill before that is finished by the next
    restore (`_load_model` first moves the file the metadata names into
    place). Each file is flushed to disk before its rename, and the folder
    after it (`durable.replace`). So a kill at any point restores the
    previous backup whole or the new one whole.
    """
    _require_backup_attributes(callback, (
        "_weights_path", "_training_metadata_path", "_current_epoch",
        "_last_batch_seen", "_prev_weights_path",
        "_prev_training_metadata_path", "_load_model"))
    if getattr(callback, "_tfscale_atomic", False):
        return
    load_model = callback._load_model

    def settled_load_model():
        _settle_backup(callback)
        load_model()
        callback._tfscale_resume_batches = _batches_done(callback)

    callback._save_model = lambda: _save_backup(callback)
    callback._load_model = settled_load_model
    callback._tfscale_atomic = True


@shim
def backup_at(callback, epoch: int, batches_done: int) -> None:
    """A `BackupAndRestore` made atomic (`atomic_backup`) writes its backup
    as of `batches_done` batches into `epoch` (0-based): what a preemption
    in the middle of an epoch saves (`fit_preemption.py`)."""
    _require_backup_attributes(callback, ("_current_epoch",
                                          "_last_batch_seen"))
    callback._current_epoch = epoch
    callback._last_batch_seen = max(batches_done - 1, 0)
    callback._tfscale_batches_done = batches_done
    try:
        callback._save_model()
    finally:
        callback._tfscale_batches_done = 0


@shim
def _batches_done(callback) -> int:
    """The batches of its epoch a backup just restored had trained on (0:
    a backup of an epoch's end, Keras's)."""
    try:
        with open(callback._training_metadata_path) as f:
            return int(json.load(f).get("tfscale_batches_done", 0))
    except (OSError, ValueError, TypeError):
        return 0


@shim
def _settle_backup(callback) -> None:
    """Moves the weights the committed metadata names into place (a save
    killed after its commit)."""
    from tfscale import durable
    try:
        with open(callback._training_metadata_path) as f:
            named = json.load(f).get("tfscale_weights")
    except (OSError, ValueError):
        return
    if not named:
        return
    folder = os.path.dirname(callback._weights_path)
    pending = os.path.join(folder, named)
    if not os.path.exists(pending):
        return  # in place already
    try:
        os.replace(pending, callback._weights_path)
    except FileNotFoundError:
        return  # put in place by another worker just now
    durable.flush_folder(folder)


@shim
def _save_backup(callback) -> None:
    """`BackupAndRestore._save_model`, committed at one point."""
    from tfscale import durable
    os.makedirs(callback.backup_dir, exist_ok=True)
    _settle_backup(callback)
    # What an attempt killed mid-write left (hidden, uuid-named).
    for final in (callback._weights_path, callback._training_metadata_path,
                  callback._prev_weights_path,
                  callback._prev_training_metadata_path):
        folder, base = os.path.split(final)
        for left in glob.glob(os.path.join(glob.escape(folder),
                                           f".{'[0-9a-f]' * 32}.{base}")):
            os.remove(left)
    if callback.double_checkpoint:
        for latest, previous in (
                (callback._weights_path, callback._prev_weights_path),
                (callback._training_metadata_path,
                 callback._prev_training_metadata_path)):
            if os.path.exists(latest):
                durable.commit(lambda p, s=latest: shutil.copyfile(s, p),
                               previous)
    weights = durable.hidden_name(callback._weights_path)
    metadata = {"epoch": callback._current_epoch,
                "batch": callback._last_batch_seen,
                "tfscale_weights": os.path.basename(weights)}
    if getattr(callback, "_tfscale_batches_done", 0):
        # A backup in the middle of `epoch` (a preemption's): the batches
        # of it the weights have trained on (`fit_preemption.py`).
        metadata["tfscale_batches_done"] = callback._tfscale_batches_done

    def write_metadata(path):
        with open(path, "w") as f:
            json.dump(metadata, f)
    try:
        callback.model.save_weights(weights, overwrite=True)
        durable.flush_file(weights)
        durable.commit(write_metadata, callback._training_metadata_path)
    except BaseException:
        if os.path.exists(weights):
            os.remove(weights)
        raise
    _settle_backup(callback)
