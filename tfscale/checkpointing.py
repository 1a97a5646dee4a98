"""Training checkpoints: model, optimizer, step, loss scale; chief writes.

Every worker calls `save` at the same steps (saving can read SyncOnRead
variables, which takes a collective), but only the chief writes into the
checkpoint directory; the others write to a private temporary directory.
Every worker *restores* from the chief's directory, so all resume from the
same state. TensorFlow writes a checkpoint's files before it updates the
`checkpoint` index, so an interrupted save never becomes "latest".
"""

import shutil
import tempfile
from typing import Optional

import tensorflow as tf


class CheckpointKeeper:
    """Saves and restores training state with `tf.train.CheckpointManager`.

    Args:
        directory: The chief's checkpoint directory.
        is_chief: Whether this worker owns `directory`.
        max_to_keep: How many checkpoints to keep.
        **trackables: What to save (model=..., optimizer=..., step=...).
    """

    def __init__(self, directory: str, *, is_chief: bool, max_to_keep: int = 5,
                 **trackables):
        self.directory = directory
        self._checkpoint = tf.train.Checkpoint(**trackables)
        self._is_chief = is_chief
        if is_chief:
            write_dir = directory
            self._private_dir = None
        else:
            self._private_dir = tempfile.mkdtemp(prefix="tfscale-ckpt-")
            write_dir = self._private_dir
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, write_dir, max_to_keep=max_to_keep)

    @property
    def latest(self) -> Optional[str]:
        """The newest complete checkpoint in the chief's directory."""
        return tf.train.latest_checkpoint(self.directory)

    def restore_latest(self) -> Optional[str]:
        """Restores the newest checkpoint, if any; returns its path."""
        path = self.latest
        if path:
            self._checkpoint.restore(path).assert_existing_objects_matched()
        return path

    def save(self, step: int) -> Optional[str]:
        """Saves at `step`; returns the chief's path (None elsewhere)."""
        path = self._manager.save(checkpoint_number=step)
        return path if self._is_chief else None

    def close(self):
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)
