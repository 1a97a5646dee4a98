"""`Trainer`: a `fit`-like loop for any Keras 3 model under any strategy.

Keras 3's `model.fit` fails under MultiWorkerMirroredStrategy (docs/facts.md, fact
1) and lacks what large-scale training needs (facts 7-11). The Trainer keeps
`fit`'s contract (a dataset, epochs, steps, standard `keras.callbacks`) and
adds: one all-reduce per optimizer step with gradient accumulation, clipping
after the all-reduce, XLA for the forward/backward on any device, fp16 loss
scaling, chief-only files, checkpoints that hold the whole run (model, RNG
states, optimizer, input position: see `resume/checkpoints.py`) with automatic
and exact resume, preemption (SIGTERM -> agreed step -> checkpoint -> exit
143, see `preemption.py`), and a per-step time split (input wait, compute,
gradient sync, update).

The math lives in `step/train_step.py`; this file is the loop around it. Where a fit
starts and what a save writes: `resume/start.py`; where the run is:
`resume/position.py`; evaluation: `evaluation.py`; a log interval:
`reporting.py`; what a worker holds and sends: `memory.py`; what it says
to a person: `console.py`.
"""

import functools
import shutil
import tempfile
import time
from typing import Callable, Optional, Sequence

import keras
import tensorflow as tf

from tfscale.cluster import all_reduce_impl, devices, heartbeat
from tfscale.keras import callback_files
from tfscale.trainer import console
from tfscale.trainer import evaluation
from tfscale.keras import fit_arguments
from tfscale.trainer import memory
from tfscale.trainer import parts as trainer_parts
from tfscale.keras.callbacks import (continue_tensorboard_steps,
                                     tensorboard_records_at)
from tfscale.cluster.contract import CHECKPOINT_COMPLETE
from tfscale.resume import preemption
from tfscale.cluster.signal_watch import SignalWatch
from tfscale.resume.preemption import Preempted
from tfscale.step.pace import CallPace
from tfscale.trainer.peers import PeerIntervals
from tfscale.trainer.reporting import IntervalReport
from tfscale.trainer.timing import StepTimer
from tfscale.train_config import TrainConfig, resolve_auto


# How long `evaluate()` waits for every worker to call it.
EVALUATE_MEET_SECONDS = 60.0


class Trainer:
    """Trains a Keras 3 model under a `tf.distribute` strategy.

    Args:
        model: A built Keras 3 model, created under `strategy.scope()`.
        optimizer: Its optimizer, created under `strategy.scope()`.
        loss_fn: `keras.losses.Loss` or `fn(y_true, y_pred)` returning one
            loss per example.
        strategy: The strategy (from `tfscale.cluster.strategies.make_strategy`, or any
            `MirroredStrategy` / `MultiWorkerMirroredStrategy`; with backend
            "mpi", a single-replica one such as `tfscale.cluster.mpi.make_strategy()`).
        config: A `TrainConfig`.
        metrics: Keras metrics, created under `strategy.scope()`.
        backend: How workers sum gradients: "mwms" (default: the
            strategy's collectives, gRPC on CPUs, NCCL on GPUs) or "mpi"
            (`MPI.Allreduce` between processes started by mpirun,
            `launch.local --backend mpi` or `srun --mpi=pmix`; see
            `tfscale/cluster/mpi.py`); or a collectives object (`collectives.py`).

    Raises:
        ValueError: The global batch does not divide into replicas x
            accumulation steps.

    Example:
        with strategy.scope():
            model = make_model(); optimizer = keras.optimizers.SGD(0.1)
        trainer = Trainer(model=model, optimizer=optimizer,
                          loss_fn=keras.losses.MeanSquaredError(),
                          strategy=strategy,
                          config=TrainConfig(global_batch_size=256))
        trainer.fit(dataset_fn, epochs=2, steps_per_epoch=100,
                    callbacks=[keras.callbacks.CSVLogger("log.csv")])
    """

    def __init__(self, *, model: keras.Model, optimizer, loss_fn: Callable,
                 strategy, config: TrainConfig,
                 metrics: Sequence[keras.metrics.Metric] = (),
                 backend="mwms"):
        self.metrics = list(metrics)
        config = resolve_auto(config, strategy)
        # The input of the current `fit` (a `ReplicaFeed`): None between
        # fits; the step reads it through the lambda below.
        self._replica_feed = None
        parts = trainer_parts.assemble(
            model=model, optimizer=optimizer, loss_fn=loss_fn,
            strategy=strategy, config=config, metrics=self.metrics,
            backend=backend,
            take_batches=lambda iterator, k: self._replica_feed.take(
                iterator, k))
        self.model = model
        self.optimizer = parts.optimizer
        self.strategy = strategy
        config = self.config = parts.config  # accumulation for its replicas
        self.collectives = parts.collectives
        self.is_chief = self.collectives.is_chief
        self.num_workers = self.collectives.num_workers
        self.worker_index = self.collectives.worker_index
        self.per_replica_batch_size = parts.per_replica_batch_size
        self.loss_scale = parts.loss_scale
        self.position = parts.position
        self.noise_scale = parts.noise_scale
        self._sharded = parts.sharded
        self._train_step = parts.train_step
        self._borrowed = lambda: trainer_parts.borrowed(model, self.optimizer)
        self.step_layout = parts.train_step.layout.describe(
            config.steps_per_launch)  # in words
        # Where this worker's replicas and variables are (checked).
        self.placement = parts.placement
        self._adascale = parts.adascale
        self._eval_step = parts.eval_step
        self._fit_start = parts.fit_start
        self._saver = parts.saver
        self._saver.report = self._log
        self._noise_notice = parts.noise_notice  # said by the first fit
        self.timer = StepTimer(examples_per_step=config.global_batch_size)
        # How many steps a call runs within `max_call_seconds`, agreed by
        # all workers through the step's own all-reduce (`step/pace.py`).
        self._pace = CallPace(
            config.max_call_seconds,
            local_replicas=len(devices.worker_devices(strategy)),
            is_chief=self.is_chief)
        self._interval = IntervalReport(
            self.timer, optimizer=self.optimizer, loss_scale=self.loss_scale,
            noise_scale=self.noise_scale, adascale=self._adascale,
            peers=PeerIntervals(self.collectives,
                                config.straggler_threshold))
        self._start_run_state(config)
        if config.say_placement and config.verbose:
            console.say(self.placement.describe())
            console.say(all_reduce_impl.numerics_words(
                strategy, config.precision, config.jit_compile))

    def _start_run_state(self, config: TrainConfig) -> None:
        """What this process has done so far: nothing."""
        self._adascale_end_logged = False
        self._verbose = config.verbose
        # A fit returned on this Trainer: the next counts its epochs from
        # where it starts, as Keras's fit does (the first fit of a process
        # counts from the run's start, so a resumed run ends where it would).
        self._fitted = False
        # Steps were trained in this process (a preemption saves them).
        self._trained = False
        # A launch of K steps (`steps_per_launch`) has run: its program,
        # compiled at its first call, is ready.
        self._launch_ran = config.steps_per_launch <= 1
        # The phase this worker is in, for its launcher's hang watch
        # (written only under a launcher that asks for it).
        self._heartbeat = heartbeat.from_environment()
        self._calls = 0  # calls of the step in this process

    @property
    def launch_ran(self) -> bool:
        """Whether every program of the step has run once in this
        process: with `steps_per_launch` K > 1, whether a launch of K steps
        has (XLA compiles it at its first call); always True for K = 1."""
        return self._launch_ran

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer slots this worker holds (`memory.py`)."""
        return memory.optimizer_state_bytes(self.optimizer, self._sharded)

    def memory_summary(self) -> dict:
        """What each worker holds and sends, for summary.json (a collective:
        every worker calls it; `memory.worker_summary`)."""
        return memory.worker_summary(self.collectives, self.model,
                                     self.optimizer, self._sharded)

    # ---- public API --------------------------------------------------------

    @property
    def intervals(self) -> list:
        """Every log interval's numbers so far (`reporting.py`)."""
        return self._interval.rows

    @property
    def step(self) -> tf.Variable:
        """Steps taken (including fp16 steps skipped): a host variable."""
        return self.position.step_variable

    @property
    def checkpoint_path(self) -> Optional[str]:
        """The latest checkpoint this run wrote (the chief's, named alike
        on every worker), or None."""
        return self._saver.path

    @classmethod
    def from_compiled(cls, model: keras.Model, config: TrainConfig,
                      strategy=None, backend="mwms") -> "Trainer":
        """A Trainer with the optimizer, loss and metrics of `model.compile`.

        Args:
            model: A built, compiled model, created and compiled under
                `strategy.scope()`.
            config: A `TrainConfig` (global batch size, checkpoints, ...).
            strategy: Default: the strategy the model was compiled under.
            backend: As in the constructor.

        Raises:
            ValueError: The model is not compiled, or its loss is a list or
                dict (one loss per output is not supported).
        """
        optimizer, loss, metrics = fit_arguments.compiled_parts(model)
        return cls(model=model, optimizer=optimizer, loss_fn=loss,
                   strategy=strategy or model.distribute_strategy,
                   config=config, metrics=metrics, backend=backend)

    def fit(self, x=None, y=None, batch_size: Optional[int] = None,
            epochs: int = 1, verbose=None,
            callbacks: Sequence[keras.callbacks.Callback] = (),
            validation_data=None, shuffle: bool = True, sample_weight=None,
            initial_epoch: int = 0, steps_per_epoch: Optional[int] = None,
            validation_steps: Optional[int] = None
            ) -> keras.callbacks.History:
        """Trains for `epochs` x `steps_per_epoch` optimizer steps.

        Takes what `model.fit` takes (see `fit_arguments.py`) or, the fast
        path, a `dataset_fn`. Resumes from the latest checkpoint in
        `config.checkpoint_dir`: model, RNG states, optimizer, step and the
        input position, so the run continues exactly where it stopped; a
        `dataset_fn` with `at(position)` on any worker count, any other
        input from its saved `tf.data` state on the same count (`resume/start.py`,
        docs/checkpoints.md). The Trainer's checkpoint wins over a
        `BackupAndRestore` callback; without one, its epoch is used.

        Epochs: the first fit of a Trainer counts them from the run's
        start (a resumed run trains what is left of `epochs`); a later fit
        of the same Trainer trains `epochs - initial_epoch` more, as
        Keras's `fit` does when called again.

        Args:
            x: `fn(tf.distribute.InputContext) -> tf.data.Dataset` of
                per-replica batches (`(x, y)` or `(x, y, sample_weight)`) of
                size `per_replica_batch_size`, repeated (needs
                `steps_per_epoch`); or a `tf.data.Dataset` of global batches;
                or arrays / a dict of arrays.
            y, sample_weight: Arrays, with array `x`.
            batch_size: Global batch size (arrays); must equal the config's.
            epochs: Index of the last epoch, as in Keras.
            verbose: 0 silent, 1 progress bar, 2 one line per log interval;
                None or "auto": `config.verbose`. The chief only.
            callbacks: `keras.callbacks.Callback` objects.
            validation_data: Evaluated after each epoch: a `dataset_fn`
                (finite), a `tf.data.Dataset` of global batches, or a tuple
                `(x, y[, sample_weight])` of arrays.
            shuffle: Shuffle arrays each epoch (the same order on all
                workers).
            initial_epoch: Epoch to start from (a fresh run only).
            steps_per_epoch: Optimizer steps per epoch (default: one pass
                over a finite dataset or the arrays).
            validation_steps: Limit on validation batches.
        Returns:
            The `keras.callbacks.History` (epoch logs).

        Raises:
            Preempted: A worker got SIGTERM (or SIGUSR1), in training or
                validation: the checkpoint of the step all workers agreed
                on is on disk (a `SystemExit` with code 143; with no
                checkpoint directory, code 3 and nothing saved). Before
                the first call ends the process exits at once instead
                (nothing trained to save: `preemption.py`).
            KeyboardInterrupt: Ctrl-C (SIGINT), after the same save.
            checkpointing.RestoreError: The checkpoint does not fit.
            InputPipelineError: The input pipeline failed.
            ValueError: Inputs that do not fit the Trainer (batch size,
                too little data, unknown length without steps_per_epoch).
        """
        dataset_fn, steps_per_epoch = fit_arguments.training_input(
            x, y, sample_weight, batch_size=batch_size,
            global_batch_size=self.config.global_batch_size,
            per_replica_batch_size=self.per_replica_batch_size,
            steps_per_epoch=steps_per_epoch, shuffle=shuffle)
        if steps_per_epoch < 1 or epochs < 1:
            raise ValueError("steps_per_epoch and epochs must be >= 1")
        validation_fn = (None if validation_data is None
                         else self._evaluation_input(validation_data))
        verbose = (self.config.verbose if verbose in (None, "auto")
                   else int(verbose))
        worker_dir = None if self.is_chief else tempfile.mkdtemp(
            prefix="tfscale-worker-")
        callbacks, callback_list = callback_files.fit_callbacks(
            callbacks, self.model, worker_dir, verbose=verbose,
            progress_bar=self.is_chief and verbose == 1, epochs=epochs,
            steps_per_epoch=steps_per_epoch, sharded=self._sharded is not None)
        self._verbose = verbose
        # SIGTERM from now on is a preemption request (see preemption.py).
        try:
            with SignalWatch() as watch, self._borrowed():
                history = self._fit(dataset_fn, callbacks, callback_list,
                                    worker_dir, watch, steps_per_epoch,
                                    epochs, validation_fn, validation_steps,
                                    initial_epoch)
            self._fitted = True
            return history
        except BaseException:
            # An error, a preemption (Preempted) or Ctrl-C: on_train_end
            # will not run, so what the callbacks logged is closed here.
            callback_files.close_writers(callbacks)
            raise
        finally:
            self._verbose = self.config.verbose
            self._fit_start.end(self._replica_feed)
            self._replica_feed = None
            if worker_dir:
                shutil.rmtree(worker_dir, ignore_errors=True)

    def _evaluation_input(self, data, **arrays):
        return evaluation.evaluation_input(
            data, global_batch_size=self.config.global_batch_size,
            per_replica_batch_size=self.per_replica_batch_size, **arrays)

    def _fit(self, dataset_fn, callbacks, callback_list, worker_dir, watch,
             steps_per_epoch, epochs, validation_fn, validation_steps,
             initial_epoch):
        self.model.stop_training = False
        self._interval.start_fit()
        # Until the first call ends (the restore, tracing, compiling), no
        # step changes what is on disk: a signal ends the process at once.
        watch.exit_at_once(functools.partial(
            self._exit_at_once_line, phase="restoring, tracing, compiling"))
        self._heartbeat.beat("restore")
        start = self._fit_start.start(dataset_fn, callback_list,
                                      steps_per_epoch=steps_per_epoch,
                                      initial_epoch=initial_epoch)
        self._replica_feed = start.feed
        if worker_dir:
            callback_files.route_backup_writes(callbacks, worker_dir)
        if start.restored:
            self._saver.saved_at(start.step, start.restored)
            self._log(f"resumed from {start.restored} at step {start.step}; "
                      f"input {start.input_line}")
        if self._noise_notice:
            self._log(self._noise_notice)
            self._noise_notice = None
        continue_tensorboard_steps(callbacks, start.step)
        # The step epoch 0 of this fit starts at: the run's start, or for a
        # later fit of this Trainer, where it begins (less initial_epoch's).
        origin = (start.step - initial_epoch * steps_per_epoch
                  if self._fitted else 0)
        logs = {}
        for epoch in range((start.step - origin) // steps_per_epoch, epochs):
            logs = self._train_epoch(self._replica_feed, callback_list, epoch,
                                     steps_per_epoch, watch, origin)
            if validation_fn is not None:
                val = self.evaluate(validation_fn, steps=validation_steps)
                logs.update({f"val_{k}": v for k, v in val.items()})
            self._heartbeat.beat("epoch_end", self.position.steps_taken)
            callback_list.on_epoch_end(epoch, logs)
            if self._agreed_stop():
                break
        watch.exit_at_once(None)  # (a fit with nothing left to train)
        self._saver.save()
        callback_list.on_train_end(logs)
        if watch.requested:
            # During the last call or the final save: the run's end is on
            # disk; stop as asked (a restart trains nothing more).
            self._leave_preempted(watch)
        return self.model.history

    def _exit_at_once_line(self, signal_name: str, phase: str) -> tuple:
        """(line, exit code) of a signal while a call compiles (the first
        call of a fit; with `steps_per_launch`, the first launch): the
        process ends at once, and the run is what is on disk. Steps trained
        since the last checkpoint (a few: calls grow from one step) run
        again on restart, to the same weights."""
        saved = self._saver.enabled
        code = (preemption.INTERRUPTED_EXIT_CODE if signal_name == "SIGINT"
                else preemption.PREEMPTED_EXIT_CODE if saved
                else preemption.PREEMPTED_UNSAVED_EXIT_CODE)
        taken = self.position.steps_taken
        if not saved:
            what = ("nothing saved: no checkpoint directory, nothing to "
                    "resume from")
        else:
            since = self._saver.on_disk or "the run's start"
            saved_step = self._saver.saved_step or 0
            what = (f"nothing trained since {since}" if taken == saved_step
                    else f"steps {saved_step + 1}-{taken} not saved (the "
                    f"restart runs them again from {since})")
        return (f"tfscale: worker {self.worker_index}: {signal_name} before "
                f"step {taken + 1}'s call ended ({phase}): {what}; exiting "
                f"at once with code {code}", code)

    def evaluate(self, x=None, y=None, batch_size: Optional[int] = None,
                 steps: Optional[int] = None, sample_weight=None) -> dict:
        """Mean loss and metrics over a finite dataset, on all workers
        (`evaluation.py`): every example counted once, also when workers
        hold uneven numbers of batches.

        Args:
            x: A finite `dataset_fn`, a `tf.data.Dataset` of global batches,
                or arrays (with `y`, `sample_weight`, `batch_size`).
            steps: Limit on (global) batches.

        Raises:
            errors.CollectiveMisuse: A worker did not call it within
                `EVALUATE_MEET_SECONDS` (60 s): call it on every worker.
            Preempted: A preemption signal during it, as in `fit`.
        """
        dataset_fn = self._evaluation_input(
            x, batch_size=batch_size, y=y, sample_weight=sample_weight)
        # A collective: refused in one line when a worker does not come
        # (a Keras habit: `if is_chief: evaluate(...)`), instead of failing
        # later in a collective another one never joins.
        rendezvous = getattr(self.collectives, "rendezvous", None)
        if rendezvous is not None:
            rendezvous("evaluate()", EVALUATE_MEET_SECONDS)
        self._heartbeat.beat("evaluation", self.position.steps_taken)
        for metric in self.metrics:
            metric.reset_state()
        # A signal is taken between batches, agreed by all workers as in
        # training (`evaluation.py`); a fit's watch is shared.
        with SignalWatch() as watch, self._borrowed():
            try:
                logs = evaluation.evaluate(
                    self._eval_step, dataset_fn, strategy=self.strategy,
                    collectives=self.collectives, steps=steps,
                    stop_requested=lambda: watch.requested)
            except evaluation.Stopped:
                self._leave_preempted(watch)
        logs.update({k: float(v) for k, v in
                     self._train_step.metric_results().items()})
        return logs

    def leave_if_preempted(self, watch: SignalWatch) -> None:
        """Between the phases of a job (after `fit` and `evaluate`, before
        the chief's exports): when `watch` (a `SignalWatch` around them
        all, `tfscale.jobs.run`) recorded a preemption signal or Ctrl-C on
        any worker (a collective: every worker calls it), leaves as `fit`
        does (`Preempted`; nothing new to save after a fit)."""
        asked = float(watch.requested)
        if self.num_workers > 1:
            asked = self.collectives.agree(asked)
        if asked:
            self._leave_preempted(watch)

    # ---- the loop ------------------------------------------------------------

    def _train_epoch(self, feed, callback_list, epoch, steps_per_epoch, watch,
                     origin: int = 0):
        callback_list.on_epoch_begin(epoch)
        # The step in Python (the variable is for checkpoints): the loop
        # reads the device once per call of the compiled step.
        step = self.position.steps_taken
        batch = (step - origin) % steps_per_epoch
        if batch == 0:
            # (A resume inside an epoch keeps the restored running values.)
            for metric in self.metrics:
                metric.reset_state()
        loss_total, seen, logs = 0.0, 0, {}
        while batch < steps_per_epoch:
            # TensorBoard counts batch callbacks; its steps are the
            # optimizer's: it adds 1 here, the call's first step.
            continue_tensorboard_steps(callback_list.callbacks, step)
            callback_list.on_train_batch_begin(batch)
            result = self._run_steps(feed, step + 1, steps_per_epoch - batch,
                                     watch)
            self._count(result)
            step += result.steps
            batch += result.steps
            # Its summaries are the call's last step's (recorded when that
            # step is a multiple of TensorBoard's update_freq).
            tensorboard_records_at(callback_list.callbacks, step)
            loss_total += sum(result.losses)
            seen += result.steps
            # As in Keras's fit ("loss": the epoch's running mean); the
            # interval's numbers go elsewhere (`reporting.py`).
            logs = {"loss": loss_total / seen, **result.metrics}
            # An interval ends every log_steps and at the epoch's end, so a
            # run shorter than log_steps still reports the steps it ran.
            if (step % self.config.log_steps == 0
                    or batch == steps_per_epoch):
                line = self._interval.close(step, callback_list.callbacks)
                if self._verbose == 2:
                    self._log(line)
                if self._verbose:
                    for notice in self._interval.notices:
                        self._log(notice)
            # Batch callbacks run once per call, with the last step's index
            # (as Keras's fit does with steps_per_execution).
            callback_list.on_train_batch_end(batch - 1, logs)
            if self._after_call(result, step, watch):
                # Set on some worker during the previous call: all stop here.
                # (AdaScale's progress is the same on every worker: its
                # gains come from the all-reduced estimates.)
                self.model.stop_training = True
                break
        return dict(logs)

    def _count(self, result) -> None:
        """A call's steps join the run: the log interval, the noise scale
        and AdaScale's progress, the step and the input position."""
        self._interval.add(result)
        for noise in result.noise:
            self.noise_scale.update(noise)
            if self._adascale is not None:
                # (One step per call: `skipped` is this step's.)
                self._adascale.advance(self.noise_scale.estimate(),
                                       skipped=bool(result.skipped))
        self.position.advance(result.steps)
        self._trained = True

    def _after_call(self, result, step: int, watch) -> bool:
        """After a call's callbacks: preempted (saves, leaves together,
        raises `Preempted`), a checkpoint when due; True when the run stops
        here (a stop flag, or AdaScale at the reference run's end)."""
        stop, preempt = result.stop, result.preempt
        if self.num_workers == 1:
            # No peer to agree with: act on the flags at once.
            stop, preempt = self.model.stop_training, watch.requested
        if preempt:
            self._leave_preempted(watch)
        if (self.config.save_checkpoints_steps
                and step % self.config.save_checkpoints_steps == 0):
            self._heartbeat.beat("checkpoint", step)
            self._saver.save()
            self._heartbeat.beat("step", step)
        return stop or self._adascale_finished()

    def _leave_preempted(self, watch) -> None:
        """Every worker at the same step (or evaluation batch): saves the
        run there (nothing new when nothing was trained since the last
        save), says so once the checkpoint is complete on disk, leaves
        with the others and raises `Preempted` (KeyboardInterrupt for
        Ctrl-C). Never returns."""
        step = self.position.steps_taken
        if self._trained:
            self._heartbeat.beat("checkpoint", step)
            self._saver.save()
        saved = self._saver.enabled
        path = self._saver.on_disk
        if saved and self.is_chief:
            if not preemption.checkpoint_on_disk(path):
                raise RuntimeError(f"the checkpoint of step {step} is not "
                                   f"on disk ({path}.index is missing)")
            # Said at any verbosity: launchers read it (`contract.py`).
            console.say(f"{CHECKPOINT_COMPLETE} {path} (step {step}, "
                        f"{watch.signal_name})")
        # The input's iterator is deleted in the background, not waited
        # for (TF 2.21's deletion can take seconds: step/feed.py): the
        # checkpoint is whole, and the entry points leave without
        # TensorFlow's teardown (`tfscale.cli.leave`).
        self._fit_start.end(self._replica_feed)
        self._replica_feed = None
        # Exit together: an MPI launcher ends the job as soon as one rank
        # exits, and the chief's save is complete once all pass this.
        self.leave_together()
        if watch.interrupted:
            console.say(f"interrupted (SIGINT) at step {step}"
                        + (f": saved {path}" if saved and path else ""))
            raise KeyboardInterrupt
        if not saved:
            if self.is_chief:
                console.say(
                    f"preempted ({watch.signal_name}) at step {step}: no "
                    "checkpoint directory: nothing saved (set "
                    "TrainConfig.checkpoint_dir); exiting with code "
                    f"{preemption.PREEMPTED_UNSAVED_EXIT_CODE}")
            raise Preempted(step, None, saved=False)
        if self.is_chief:
            console.say(f"preempted ({watch.signal_name}): saved step {step} "
                        f"to {path}, exiting with code "
                        f"{preemption.PREEMPTED_EXIT_CODE}")
        raise Preempted(step, path)

    def _run_steps(self, feed, first: int, most: int, watch):
        """The next call of the compiled step: one or more optimizer steps
        from step number `first` (`StepPlan.steps_in_call`, within the
        agreed wall-time bound: `step/pace.py`), with this worker's flags
        and pace proposal."""
        plan = self._train_step.plan
        count = (1 if self._adascale is not None  # its rate moves each step
                 else self._pace.steps(plan.steps_in_call(first, most)))
        launch = self.config.steps_per_launch
        if launch > 1 and count > launch:
            # Whole launches: steps left over run one at a time only
            # before a boundary (a log, a checkpoint, the epoch's end).
            count -= count % launch
        part_by_part = plan.part_by_part(first, most)
        first_launch = (not self._launch_ran and not part_by_part
                        and count >= launch)
        if first_launch:
            # XLA compiles the launch's program in this call (minutes for
            # BERT on a GPU), with the main thread inside TensorFlow: as in
            # a fit's first call, a signal ends the process at once.
            watch.exit_at_once(functools.partial(
                self._exit_at_once_line,
                phase=f"compiling its {launch}-step launch"))
        signals = [float(bool(self.model.stop_training)),
                   float(watch.requested), self._pace.proposal()]
        started = time.perf_counter()
        self._heartbeat.beat("compile" if not self._calls or first_launch
                             else "call", first - 1)
        result = self._train_step.run(first, count, feed.iterator, signals,
                                      self.timer, part_by_part)
        self._calls += 1
        self._heartbeat.beat("step", first - 1 + result.steps)
        # The first call (and launch) has ended: from here a signal is
        # acted on at the next call's first step, with a save.
        watch.exit_at_once(None)
        self._launch_ran = self._launch_ran or first_launch
        if not part_by_part and not first_launch:
            # (A compiling call's time says nothing of the step's.)
            self._pace.observe(result.steps, time.perf_counter() - started)
        self._pace.agree(result.pace)
        return result

    def adascale_summary(self) -> Optional[dict]:
        """AdaScale's steps, progress, mean gain and examples; None
        without AdaScale."""
        return (None if self._adascale is None
                else self._adascale.summary(self.position.steps_taken))

    def _adascale_finished(self) -> bool:
        """AdaScale's progress reached the reference run's length: the run
        has trained as far as the reference run (the paper's end)."""
        finished = self._adascale is not None and self._adascale.finished()
        if finished and not self._adascale_end_logged:
            self._adascale_end_logged = True
            self._log(self._adascale.end_line(self.position.steps_taken))
        return finished

    def _agreed_stop(self) -> bool:
        """`model.stop_training` at an epoch's end, agreed by all workers
        (any one stops all: the flags are summed). One collective per epoch;
        inside an epoch the flag rides in the step's all-reduce instead."""
        if self.num_workers == 1:
            return bool(self.model.stop_training)
        stop = self.collectives.agree(float(bool(self.model.stop_training))) > 0
        self.model.stop_training = stop
        return stop

    # ---- helpers -------------------------------------------------------------

    def barrier(self) -> None:
        """Returns when every worker has called it."""
        if self.num_workers > 1:
            self.collectives.barrier()

    def leave_together(self) -> None:
        """The last call before this process exits (after the chief's last
        writes): returns when no other worker needs this one any more, so
        that no worker fails on a peer that left first (see
        `collectives.StrategyCollectives.leave_together`)."""
        if self.num_workers > 1:
            self.collectives.leave_together()

    def _log(self, message: str):
        """A line for a person (`console.py`), the chief's; none at 0."""
        if self.is_chief and self._verbose > 0:
            console.say(message)

