"""`model.fit` preemptible, as the Trainer is: a signal -> an agreed batch
-> the BackupAndRestore backup there -> exit 143 -> the rerun resumes in
the middle of the epoch.

Under `enable_multi_worker_fit()` a `fit` records SIGTERM, SIGUSR1 and
Ctrl-C (`SignalWatch`; under MultiWorkerMirroredStrategy TensorFlow's
coordination service would otherwise catch SIGTERM and train on until the
SIGKILL). `FitAgreement`, the last callback, learns of a signal on any
worker at the end of the same batch on every worker, in the one all-reduce
per batch that already makes `stop_training` the same everywhere. There:

  * each `keras.callbacks.BackupAndRestore` writes its backup (atomically,
    `callbacks.atomic_backup`) with the epoch in progress and the batches
    of it trained on; once every worker's write is done the chief prints
    `contract.CHECKPOINT_COMPLETE` and the backup folder (what launchers
    check), and every worker leaves with 143 (130 for Ctrl-C), without
    TensorFlow's teardown (`fail_fast.leave`);
  * with no BackupAndRestore nothing can resume the run: one line,
    "nothing saved", exit 3, which launchers do not restart.

From a signal to the exit: the batch in flight and the backup's write.

The rerun's BackupAndRestore restores the weights, the optimizer and the
epoch; `FitAgreement` then makes that epoch's first calls take their
batches from the input without training on them, so the batches left train
as in an uninterrupted run and the run ends on its weights (given the same
batches: no reshuffling between epochs, the same worker count). The
skipped batches' callbacks run with the epoch's metrics at zero; the
epoch's metrics average the batches trained in it.
"""

import sys
from typing import Callable, Optional, Sequence

import keras

from tfscale.cluster import fail_fast, heartbeat
from tfscale.cluster.collectives import StrategyCollectives
from tfscale.cluster.contract import (CHECKPOINT_COMPLETE, PREEMPTED_EXIT_CODE,
                                      PREEMPTED_UNSAVED_EXIT_CODE)
from tfscale.cluster.signal_watch import INTERRUPTED_EXIT_CODE, SignalWatch
from tfscale.keras.callbacks import backup_at, restored_epoch


def signal_watch():
    """A `SignalWatch` for a fit; a no-op context in an interactive session
    (a notebook's interrupt stops the cell, as it always did)."""
    import contextlib
    if hasattr(sys, "ps1") or sys.flags.interactive or (
            "IPython" in sys.modules):
        return contextlib.nullcontext()
    return SignalWatch()


class FitAgreement(keras.callbacks.Callback):
    """Makes `model.stop_training` the same on every worker (set on any
    one, set on all), acts on a preemption signal at the batch every worker
    learns of it, and resumes a backup written mid-epoch where it was
    written (see the module docstring). Goes last in the callback list
    (after whatever may set `stop_training`, after BackupAndRestore).

    Args:
        strategy: The strategy of a multi-worker fit; None for one worker
            (nothing to agree with).
        callbacks: The fit's callbacks (its BackupAndRestore ones save).
        before_exit: Called before the process leaves (files closed, a
            worker's private folder removed).
    """

    def __init__(self, strategy, callbacks: Sequence,
                 before_exit: Optional[Callable[[], None]] = None):
        super().__init__()
        self._collectives = (StrategyCollectives(strategy)
                             if strategy is not None else None)
        self._backups = [c for c in callbacks
                         if isinstance(c, keras.callbacks.BackupAndRestore)]
        self._before_exit = before_exit
        self.watch = None  # set by the fit while its SignalWatch is active
        self._heartbeat = heartbeat.from_environment()
        self._batches = 0  # batches trained in this fit
        self._epoch = 0
        self._skipping = 0  # calls of the resumed epoch still to skip

    @property
    def _is_chief(self) -> bool:
        return self._collectives is None or self._collectives.is_chief

    def on_train_begin(self, logs=None):
        done = max((getattr(c, "_tfscale_resume_batches", 0)
                    for c in self._backups), default=0)
        if done:
            self._skip_batches(done)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def opener(self) -> keras.callbacks.Callback:
        """The callback that goes first: it says when the epoch's end and
        an evaluation begin (long host phases a heartbeat must name)."""
        beat = self.beat

        class Opener(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                beat("epoch_end")

            def on_test_begin(self, logs=None):
                beat("evaluation")

        return Opener()

    def beat(self, phase: str) -> None:
        """This worker's heartbeat: in `phase`, after the batches trained
        in this fit."""
        self._heartbeat.beat(phase, self._batches)

    def on_train_batch_begin(self, batch, logs=None):
        # (Keras gives no hook between a batch's call and the callbacks
        # before it: the host's work counts as the call's.)
        self._heartbeat.beat("compile" if not self._batches else "call",
                             self._batches)

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        self._heartbeat.beat("step", self._batches)
        self._agree(self._epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        self._agree(epoch + 1, 0)

    def _agree(self, epoch: int, batches_done: int) -> None:
        requested = self.watch is not None and self.watch.requested
        if self._collectives is None:
            stop, preempt = self.model.stop_training, requested
        else:
            stop, preempt = self._collectives.agree_flags(
                self.model.stop_training, requested)
        self.model.stop_training = bool(stop)
        # (While batches are skipped the weights are those of the batch the
        # backup was written at: a preemption waits for the first trained.)
        if preempt and not self._skipping:
            self._leave(epoch, batches_done)

    def _skip_batches(self, done: int) -> None:
        """The resumed epoch's first `done` batches are read, not trained
        on: its first calls only take their batches from the iterator."""
        model = self.model
        train = model.train_function
        per_call = int(getattr(model, "steps_per_execution", 1) or 1)
        self._skipping = done // per_call

        def skip(iterator):
            for _ in range(per_call):
                next(iterator)
            self._skipping -= 1
            if self._skipping == 0:
                model.train_function = train
            return model.get_metrics_result()

        model.train_function = skip
        if self._is_chief:
            print(f"tfscale: resuming epoch {(restored_epoch(model) or 0) + 1} "
                  f"after its batch {done}: its first {done} batches are read, "
                  "not trained on", flush=True)

    def _leave(self, epoch: int, batches_done: int) -> None:
        """Every worker at the same batch: the backups written there, one
        line, the exit. Never returns."""
        name = self.watch.signal_name
        where = (f"in epoch {epoch + 1} after batch {batches_done}"
                 if batches_done else f"at the start of epoch {epoch + 1}")
        if not self._backups:
            if self._is_chief:
                print(f"tfscale: preempted ({name}) {where}: no "
                      "keras.callbacks.BackupAndRestore: nothing saved (add "
                      "one to the fit's callbacks to resume); exiting with "
                      f"code {PREEMPTED_UNSAVED_EXIT_CODE}", flush=True)
            self._exit(INTERRUPTED_EXIT_CODE if self.watch.interrupted
                       else PREEMPTED_UNSAVED_EXIT_CODE)
        for callback in self._backups:
            backup_at(callback, epoch, batches_done)
        if self._collectives is not None:
            self._collectives.agree(1.0)  # every worker's backup written
        folder = self._backups[0].backup_dir
        if self._is_chief:
            print(f"tfscale: {CHECKPOINT_COMPLETE} {folder} (epoch "
                  f"{epoch + 1}, batch {batches_done}, {name})", flush=True)
            what = "interrupted" if self.watch.interrupted else "preempted"
            print(f"tfscale: {what} ({name}) {where}: saved the backup in "
                  f"{folder}; rerun the same command to resume there",
                  flush=True)
        self._exit(INTERRUPTED_EXIT_CODE if self.watch.interrupted
                   else PREEMPTED_EXIT_CODE)

    def _exit(self, code: int) -> None:
        if self._before_exit is not None:
            self._before_exit()
        fail_fast.leave(code)
