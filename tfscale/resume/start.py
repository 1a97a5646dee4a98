"""Where a `fit` starts, and its input built there: `FitStart.start`.

It reads top to bottom:

1. every worker takes the chief's weights (MPI; a strategy synchronized
   them when it created them); a checkpoint overrides them below;
2. `compile`'s metrics are built from one batch's shapes: their variables
   are in checkpoints and in `BackupAndRestore`'s backups;
3. the latest checkpoint, if any, is restored, once;
4. the callbacks' `on_train_begin` runs, seeing the restored weights: a
   `BackupAndRestore` loads its backup and names its epoch, unless the
   checkpoint was restored (it wins: the backup is then not loaded);
5. the start: the checkpoint's step; without one, `BackupAndRestore`'s
   epoch, or a fresh run's `initial_epoch`;
6. the input is put there once: a positioned input (`dataset_fn.at`, the
   toolkit's record pipelines in the global order) is built at the start's
   global record, on any worker count; any other input was built before
   the restore and takes back its saved `tf.data` iterator state, which
   exists for the same worker count only, or starts over;
7. the noise scale's averages continue from the checkpoint.

What a checkpoint saves, and when a step is saved once, is `Saver`.
Where the run is (step, input position and order) is `resume/position.py`;
the checkpoint files, `resume/checkpoints.py`.
"""

import dataclasses
from typing import Optional

import tensorflow as tf

from tfscale import _compat
from tfscale.errors import ConfigError
from tfscale.keras import callbacks as _compat_callbacks
from tfscale.resume import checkpoints as checkpointing
from tfscale.step.feed import ReplicaFeed
from tfscale.resume.position import RunPosition


def make_keeper(config, model, optimizer, position: RunPosition,
                collectives, *, loss_scale=None, metrics=(),
                noise_scale=None, adascale=None
                ) -> checkpointing.CheckpointKeeper:
    """The run's checkpoints in `config.checkpoint_dir`: everything the run
    is (model, optimizer, step, loss scale, metrics, input position and
    order, noise scale, AdaScale)."""
    trackables = checkpointing.training_trackables(
        model, optimizer, position.step_variable, loss_scale=loss_scale,
        metrics=metrics, input_position=position.input_position,
        input_order=position.input_order,
        run_settings=position.run_settings,
        noise_scale=noise_scale.variables if noise_scale else None,
        adascale=adascale.variables if adascale else None)
    several = collectives.num_workers > 1
    return checkpointing.CheckpointKeeper(
        config.checkpoint_dir, is_chief=collectives.is_chief,
        worker_index=collectives.worker_index,
        num_workers=collectives.num_workers,
        barrier_fn=collectives.barrier if several else None,
        max_to_keep=config.max_checkpoints_to_keep, **trackables)


def is_positioned(dataset_fn) -> bool:
    """The input can start at a global record position (`at`)."""
    return callable(getattr(dataset_fn, "at", None))


def is_resumable(dataset_fn) -> bool:
    """The input's iterator can be saved (a tf.data service's cannot)."""
    return getattr(dataset_fn, "resumable", True)


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a `fit` starts.

    Attributes:
        step: The first step is `step + 1`.
        feed: This worker's input, at the step.
        restored: The checkpoint restored, or None (a fresh start, or one
            from `BackupAndRestore`'s epoch).
        input_line: With a checkpoint, where the input continues, in words.
    """

    step: int
    feed: ReplicaFeed
    restored: Optional[str] = None
    input_line: Optional[str] = None


class FitStart:
    """Starts each `fit` where the run is (see the module docstring).

    Args:
        model, optimizer, metrics: The Trainer's.
        collectives: The backend's collectives (the chief's weights).
        position: The run's `RunPosition`.
        keeper: The `checkpointing.CheckpointKeeper`, or None (no
            checkpoints: every fit starts fresh).
        noise_scale: The `noise_scale.NoiseScale`, or None.
        strategy: The strategy this worker's input feeds (`ReplicaFeed`).
        per_replica_batch_size: What each step takes from each replica's
            input (a positioned input must deliver it: the position
            advances by the global batch).
        batch_words: The global batch's arithmetic, in words, for the
            error when it does not.
    """

    def __init__(self, *, model, optimizer, metrics, collectives,
                 position: RunPosition,
                 keeper: Optional[checkpointing.CheckpointKeeper],
                 noise_scale, strategy,
                 per_replica_batch_size: int, batch_words: str):
        self._model = model
        self._optimizer = optimizer
        self._metrics = metrics
        self._collectives = collectives
        self._position = position
        self._keeper = keeper
        self._noise_scale = noise_scale
        self._strategy = strategy
        self._per_replica_batch_size = per_replica_batch_size
        self._batch_words = batch_words

    def start(self, dataset_fn, callbacks, *, steps_per_epoch: int,
              initial_epoch: int) -> Start:
        """Steps 1-7 of the module docstring; `callbacks` is the fit's
        `keras.callbacks.CallbackList` (its `on_train_begin` runs here).

        Raises:
            checkpointing.RestoreError: The checkpoint does not fit.
            ValueError: A positioned input whose per-replica batch is not
                the Trainer's.
        """
        positioned = is_positioned(dataset_fn)
        self._collectives.broadcast_from_chief(
            self._model.variables + self._optimizer.variables)
        feed = None if positioned else self._make_feed(dataset_fn)
        try:
            _compat.build_compiled_metrics(
                self._model, self._metrics,
                lambda: (feed.iterator.element_spec if feed is not None
                         else self._element_spec(dataset_fn)))
            _compat_callbacks.clear_restored_epoch(self._model)
            restored = self._restore(feed, dataset_fn)
            with _compat_callbacks.backups_not_loaded(
                    callbacks.callbacks, skip=bool(restored)):
                callbacks.on_train_begin()
            if not restored:
                self._start_where_callbacks_say(steps_per_epoch,
                                                initial_epoch)
            changed = self._position.settings_change()
            line = None
            if positioned:
                feed, line = self._positioned_feed(dataset_fn)
            elif restored:
                line = self._restore_input(dataset_fn)
            if restored and self._noise_scale is not None:
                self._noise_scale.load()
            if restored and changed:
                line = f"{line}; {changed}"
        except BaseException:
            if feed is not None:
                feed.close()
            raise
        return Start(self._position.steps_taken, feed, restored,
                     line if restored else None)

    def end(self, feed: Optional[ReplicaFeed],
            wait_seconds: float = 0.0) -> None:
        """After a fit, however it ended: its input closed (waiting up to
        `wait_seconds` for its deletion: `ReplicaFeed.close`), and the
        checkpoints no longer holding it."""
        if self._keeper:
            self._keeper.untrack_input()
            self._keeper.close()
        if feed is not None:
            feed.close(wait_seconds)

    def _make_feed(self, dataset_fn) -> ReplicaFeed:
        """This worker's input from `dataset_fn`."""
        return ReplicaFeed(self._strategy, dataset_fn,
                           num_replicas=self._collectives.num_replicas,
                           num_workers=self._collectives.num_workers,
                           worker_index=self._collectives.worker_index)

    def _restore(self, feed, dataset_fn) -> Optional[str]:
        """The latest checkpoint, restored; its path, or None."""
        restored = None
        if self._keeper:
            if feed is not None and is_resumable(dataset_fn):
                self._keeper.track_input(feed.iterator)
            if self._keeper.latest:
                self._position.forget_input()  # unless the checkpoint has it
            self._check_same_start(self._keeper)
            restored = self._keeper.restore_latest()
        self._position.settle()
        return restored

    def _check_same_start(self, keeper) -> None:
        """Every worker finds the same latest checkpoint, or one line
        naming each worker's (a checkpoint folder the workers do not share:
        the chief would resume, the others start over, and their first
        collective wait for the collective timeout)."""
        exchange = getattr(self._collectives, "exchange", None)
        if exchange is None or self._collectives.num_workers == 1:
            return
        latest = keeper.latest
        mine = (f"step {checkpointing.checkpoint_number(latest)} from "
                f"{latest}" if latest else
                f"step 0 from nothing in {keeper.directory}")
        starts = exchange("resumed", mine, RESUME_MEET_SECONDS)
        if len({where.split(" from ")[0] for where in starts.values()}) > 1:
            raise ConfigError("checkpoint_dir", (
                "the workers would resume at different steps: " + ", ".join(
                    f"worker {i} at {where}"
                    for i, where in sorted(starts.items())) +
                "; every worker must see the chief's checkpoint folder (a "
                "file system all hosts share: --output_dir, "
                "TrainConfig.checkpoint_dir)"))

    def _start_where_callbacks_say(self, steps_per_epoch: int,
                                   initial_epoch: int) -> None:
        """No checkpoint: the epoch `BackupAndRestore` restored (with its
        weights), else `initial_epoch`."""
        backup_epoch = _compat_callbacks.restored_epoch(self._model)
        if backup_epoch:
            self._position.move_to(backup_epoch * steps_per_epoch)
        elif initial_epoch and not self._position.steps_taken:
            self._position.move_to(initial_epoch * steps_per_epoch)

    def _positioned_feed(self, dataset_fn):
        """(the input built at the run's global record, the line saying
        where it continues). A checkpoint of another record set or seed
        moves the position to where the new order starts."""
        reordered = self._position.settle_order(dataset_fn)
        feed = self._make_feed(dataset_fn.at(self._position.records))
        try:
            self._check_batch(feed)
        except BaseException:
            feed.close()
            raise
        return feed, reordered or (
            f"position restored (global record {self._position.records}, "
            "the same order on any worker count)")

    def _restore_input(self, dataset_fn) -> str:
        """A resumed run's saved tf.data iterator state, restored when there
        is one; where the input continues, in words."""
        if not is_resumable(dataset_fn):
            return ("continues where its tf.data service is (its position "
                    "is not in checkpoints)")
        if self._position.batch_moved:
            # A tf.data iterator's saved state brings back its pipeline,
            # batches of the old size included.
            return ("starts over (its saved state yields the checkpoint's "
                    "batches, of another size)")
        if self._keeper.restore_input(self._position.steps_taken):
            return "position restored"
        return (f"starts over (no input state for "
                f"{self._collectives.num_workers} worker(s) at this step)")

    def _element_spec(self, dataset_fn):
        """One batch's shapes without an iterator (a positioned input is
        built later, once its position is known)."""
        context = tf.distribute.InputContext(
            num_input_pipelines=self._collectives.num_workers,
            input_pipeline_id=self._collectives.worker_index,
            num_replicas_in_sync=self._collectives.num_replicas)
        with tf.device("/cpu:0"):
            return dataset_fn(context).element_spec

    def _check_batch(self, feed: ReplicaFeed) -> None:
        """Raises ValueError when the positioned input's per-replica batch
        is not the Trainer's: the position advances by the global batch
        each step, so it would drift from what the input delivered."""
        spec = tf.nest.flatten(feed.iterator.element_spec,
                               expand_composites=True)[0]
        delivered = spec.shape[0] if spec.shape.rank else None
        if delivered is not None and delivered != self._per_replica_batch_size:
            raise ValueError(
                f"the input's batches hold {delivered} examples per replica, "
                f"the Trainer's {self._per_replica_batch_size} "
                f"({self._batch_words}): build the dataset_fn with "
                "trainer.per_replica_batch_size, or the input position in "
                "checkpoints would not be where the input is")


# How long a worker waits for the others' resumed steps (they restore at
# once; a worker that has not come by then fails its next collective).
RESUME_MEET_SECONDS = 120.0


class Saver:
    """Saves the whole run at its current step, once per step.

    Args:
        keeper: The `checkpointing.CheckpointKeeper`, or None (nothing is
            saved).
        position: The run's `RunPosition` (the step saved).
        noise_scale: The `noise_scale.NoiseScale` (its averages are stored
            into its variables first), or None.
        sharded: The `zero.ShardedOptimizer` (its slots are gathered whole
            for the save, a collective), or None.
    """

    def __init__(self, keeper, position: RunPosition, *, noise_scale=None,
                 sharded=None):
        self._keeper = keeper
        self._position = position
        self._noise_scale = noise_scale
        self._sharded = sharded
        self._saved_step = None
        self.path: Optional[str] = None  # the latest checkpoint written
        self.restored: Optional[str] = None  # the one the run resumed from
        self.report = None  # fn(line): says each save

    @property
    def enabled(self) -> bool:
        """Whether there is somewhere to save (a checkpoint directory)."""
        return self._keeper is not None

    def saved_at(self, step: int, path: Optional[str] = None) -> None:
        """A checkpoint of `step` exists (`path`, the one restored)."""
        self._saved_step = step
        self.restored = path

    @property
    def saved_step(self) -> Optional[int]:
        """The step of the run's latest checkpoint on disk (None: none)."""
        return self._saved_step

    @property
    def on_disk(self) -> Optional[str]:
        """The checkpoint of the run's latest saved step: the last one
        written, else the one restored."""
        return self.path or self.restored

    def save(self) -> None:
        """The run at its step, unless that step is saved already (every
        worker calls it at the same, agreed step)."""
        step = self._position.steps_taken
        if not self._keeper or step == self._saved_step:
            return
        if self._noise_scale is not None:
            self._noise_scale.store()
        if self._sharded is not None:
            self._sharded.gather_slots()
        try:
            path = self._keeper.save(step)
        finally:
            if self._sharded is not None:
                self._sharded.release_slots()
        self._saved_step = step
        # Every worker names the chief's checkpoint of this step (the one
        # a rerun resumes from), not its own private copy.
        self.path = path or self._keeper.chief_path(step)
        if path and self.report is not None:
            self.report(f"saved checkpoint {path}")
