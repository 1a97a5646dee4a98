"""Where a run is: its step, and its input's global record position and
order. Three host variables, identical on every worker by construction (a
MirroredVariable costs about a millisecond per step to update), kept in
every checkpoint:

- step: steps taken, including fp16 steps skipped for non-finite gradients
  (`optimizer.iterations` counts applied ones only);
- input_position: records consumed (the global batch per step), where a
  positioned input (`dataset_fn.at`) resumes on any worker count; -1:
  unknown (a checkpoint from before it was kept, or a step set by
  BackupAndRestore or `initial_epoch`), settled to step x global batch;
- input_order: what the position counts in (a positioned input's
  `order()`: its record set and seed); "" when unknown;
- run_settings: the run's global batch (and what its job adds, such as the
  peak learning rate), so a run resumed with others says so
  (`settings_change`): NVIDIA's per-rank batch and rate follow the rank
  count, and a resume on another count goes on with new ones.
"""

import json
from typing import Optional

import tensorflow as tf


class RunPosition:
    """The run's step and input position (see the module docstring).

    Args:
        global_batch_size: Records each step consumes.
    """

    def __init__(self, global_batch_size: int):
        self.global_batch_size = global_batch_size
        with tf.device("/cpu:0"):
            self.step_variable = tf.Variable(0, dtype=tf.int64, trainable=False,
                                    name="train_step")
            self.input_position = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="input_position")
            self.input_order = tf.Variable("", dtype=tf.string,
                                           trainable=False,
                                           name="input_order")
            self.run_settings = tf.Variable("", dtype=tf.string,
                                            trainable=False,
                                            name="run_settings")
        # What `run_settings` holds for this run ({name: value}), and what
        # the checkpoint restored last held (`settings_change`).
        self.settings = {"global batch": global_batch_size}
        self.checkpoint_settings = {}

    @property
    def batch_moved(self) -> bool:
        """The restored checkpoint's run had another global batch."""
        before = self.checkpoint_settings.get("global batch")
        return before is not None and before != self.global_batch_size

    @property
    def steps_taken(self) -> int:
        return int(self.step_variable.numpy())

    @property
    def records(self) -> int:
        return int(self.input_position.numpy())

    def advance(self, steps: int) -> None:
        """`steps` steps taken, each one global batch of records."""
        # Without reading the new values back: 38 us for both, against 66.
        self.step_variable.assign_add(steps, read_value=False)
        self.input_position.assign_add(steps * self.global_batch_size,
                                       read_value=False)

    def forget_input(self) -> None:
        """Before restoring a checkpoint: what it does not hold is unknown."""
        self.input_position.assign(-1)
        self.input_order.assign("")
        self.run_settings.assign("")

    def settings_change(self) -> Optional[str]:
        """After a restore: the checkpoint's run settings against this
        run's, in words ("the checkpoint's run: global batch 8, ...; this
        run: global batch 12, ..."), or None when they agree or the
        checkpoint holds none. This run's are recorded for its checkpoints
        either way."""
        saved = self.run_settings.numpy().decode()
        self.run_settings.assign(json.dumps(self.settings, sort_keys=True))
        before = self.checkpoint_settings = json.loads(saved) if saved else {}
        if not saved or before == json.loads(
                self.run_settings.numpy().decode()):
            return None

        def words(settings):
            return ", ".join(f"{k} {v:g}" if isinstance(v, float)
                             else f"{k} {v}" for k, v in settings.items())
        return (f"the checkpoint's run: {words(before)}; this run: "
                f"{words(self.settings)}")

    def move_to(self, step: int) -> None:
        """The run starts at `step` (an epoch BackupAndRestore restored, or
        `initial_epoch`); the input at that many global batches."""
        self.step_variable.assign(step)
        self.input_position.assign(-1)
        self.settle()

    def settle(self) -> None:
        """An unknown position is the step's global batches."""
        if self.records < 0:
            self.input_position.assign(
                self.steps_taken * self.global_batch_size)

    def settle_order(self, dataset_fn) -> Optional[str]:
        """Checks that a restored position counts in this input's order (its
        record set and seed); when they differ, moves the position to where
        the input says the new order starts and returns the line saying so.
        Records this input's order for the next checkpoint."""
        order = getattr(dataset_fn, "order", None)
        if order is None:
            return None
        current = order()
        saved = self.input_order.numpy().decode()
        self.input_order.assign(current)
        if not saved:  # a fresh run, or a checkpoint from before orders
            return None
        position, message = dataset_fn.reorder(saved, self.records,
                                               self.global_batch_size)
        if message is None:
            return None
        self.input_position.assign(position)
        return message
