"""`Trainer`: a `fit`-like loop for any Keras 3 model under any strategy.

Keras 3's `model.fit` fails under MultiWorkerMirroredStrategy (docs/facts.md, fact
1) and lacks what large-scale training needs (facts 7-11). The Trainer keeps
`fit`'s contract (a dataset, epochs, steps, standard `keras.callbacks`) and
adds: one all-reduce per optimizer step with gradient accumulation, clipping
after the all-reduce, XLA for the forward/backward on any device, fp16 loss
scaling, chief-only files, checkpoints that hold the whole run (model, RNG
states, optimizer, input position: see `checkpointing.py`) with automatic
and exact resume, preemption (SIGTERM -> agreed step -> checkpoint -> exit
143, see `preemption.py`), and a per-step time split (input wait, compute,
gradient sync, update).

The math lives in `step.py`; this file is the loop around it. Where the run
is (step, input position and order) lives in `run_position.py`; what a log
interval reports, in `reporting.py`.
"""

import shutil
import tempfile
from typing import Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfscale import _compat
from tfscale import callback_files
from tfscale import checkpointing
from tfscale import collectives as collectives_lib
from tfscale import fail_fast
from tfscale import fit_arguments
from tfscale import memory
from tfscale import noise_scale as noise_lib
from tfscale import precision as precision_lib
from tfscale import zero
from tfscale.errors import ConfigError
from tfscale.preemption import Preempted, SignalWatch
from tfscale.replica_feed import (InputPipelineError, ReplicaFeed,
                                  delete_in_background, input_error,
                                  is_input_error)
from tfscale.reporting import IntervalReport
from tfscale.run_position import RunPosition
from tfscale.step import EvalStep, TrainStep
from tfscale.timing import StepTimer
from tfscale.train_config import TrainConfig


def _check_fits(model, config: TrainConfig, replicas: int) -> None:
    """Raises ConfigError (global_batch_size) when the batch does not divide
    into replicas x accumulation steps, ValueError when the model is not
    built or its dtype policy is not `config.precision`."""
    divisor = replicas * config.num_accumulation_steps
    if config.global_batch_size % divisor:
        raise ConfigError(
            "global_batch_size", f"global batch size "
            f"{config.global_batch_size} is not divisible by replicas "
            f"({replicas}) x accumulation steps "
            f"({config.num_accumulation_steps})")
    if not model.built:
        raise ValueError("build the model (call it on a batch or build it "
                         "with shapes) under strategy.scope() first")
    policy = model.dtype_policy.name
    if config.precision != "float32" and config.precision != policy:
        raise ValueError(
            f"TrainConfig.precision is {config.precision!r} but the model "
            f"was built with dtype policy {policy!r}: call "
            "tfscale.precision.set_precision before building the model")


def _unwrap_and_scale(model, optimizer, strategy, config: TrainConfig,
                      build: bool = True):
    """(the optimizer the Trainer updates with, built; fp16's loss scale or
    None). A keras.optimizers.LossScaleOptimizer (what `compile` makes under
    a mixed_float16 policy) gives its inner optimizer: the Trainer scales
    the loss itself, after the all-reduce. Loss scaling follows the model's
    dtype policy (or such a wrapper), whatever built it. Not built when
    `build` is False (its sharded update keeps the slots: `zero.py`)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    scaled = (precision_lib.needs_loss_scaling(model.dtype_policy.name)
              or inner is not None)
    optimizer = inner if inner is not None else optimizer
    with strategy.scope():
        if build:
            optimizer.build(model.trainable_variables)
        loss_scale = _loss_scale(config) if scaled else None
    return optimizer, loss_scale


def _loss_scale(config: TrainConfig):
    """fp16's loss scale as `config` sets it (a fixed scale: one that
    neither grows nor falls)."""
    initial = config.initial_loss_scale or precision_lib.INITIAL_LOSS_SCALE
    if config.dynamic_loss_scale:
        return precision_lib.DynamicLossScale(initial_scale=initial)
    return precision_lib.DynamicLossScale(
        initial_scale=initial, growth_steps=2**62, min_scale=initial)


class Trainer:
    """Trains a Keras 3 model under a `tf.distribute` strategy.

    Args:
        model: A built Keras 3 model, created under `strategy.scope()`.
        optimizer: Its optimizer, created under `strategy.scope()`.
        loss_fn: `keras.losses.Loss` or `fn(y_true, y_pred)` returning one
            loss per example.
        strategy: The strategy (from `tfscale.strategies.make_strategy`, or any
            `MirroredStrategy` / `MultiWorkerMirroredStrategy`; with backend
            "mpi", a single-replica one such as `tfscale.mpi.make_strategy()`).
        config: A `TrainConfig`.
        metrics: Keras metrics, created under `strategy.scope()`.
        backend: How workers sum gradients: "mwms" (default: the
            strategy's collectives, gRPC on CPUs, NCCL on GPUs) or "mpi"
            (`MPI.Allreduce` between processes started by mpirun,
            `launch.local --backend mpi` or `srun --mpi=pmix`; see
            `tfscale/mpi.py`); or a collectives object (`collectives.py`).

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
        self.collectives = (collectives_lib.make(backend, strategy)
                            if isinstance(backend, str) else backend)
        divisor = self.collectives.num_replicas * config.num_accumulation_steps
        _check_fits(model, config, self.collectives.num_replicas)
        shards = (config.shard_optimizer_state
                  and self.collectives.num_replicas > 1)
        optimizer, self.loss_scale = _unwrap_and_scale(
            model, optimizer, strategy, config, build=not shards)
        self._sharded = (self._shard(optimizer, model, strategy, config)
                         if shards else None)
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy
        self.config = config
        self.metrics = list(metrics)
        self.is_chief = self.collectives.is_chief
        self.num_workers = self.collectives.num_workers
        self.worker_index = self.collectives.worker_index
        self.per_replica_batch_size = config.global_batch_size // divisor
        if self.num_workers > 1:
            # An uncaught exception on this worker ends the job at once
            # (not after a collective timeout): see fail_fast.py.
            fail_fast.install(f"worker {self.worker_index}",
                              self.collectives.abort)
        self.position = RunPosition(config.global_batch_size)
        _compat.disable_gradient_aggregation(optimizer)
        # Keras callbacks (TensorBoard, BackupAndRestore, ModelCheckpoint)
        # look for the optimizer where `compile` would have put it.
        model.optimizer = optimizer
        # The input of the current `fit` (a `ReplicaFeed`): None between
        # fits; the step reads it through the lambda below.
        self._feed = None
        self._train_step = TrainStep(
            model=model, optimizer=optimizer, loss_fn=loss_fn,
            metrics=self.metrics, strategy=strategy,
            collectives=self.collectives, config=config,
            feed=lambda iterator, k: self._feed.take(iterator, k),
            loss_scale=self.loss_scale, sharded=self._sharded)
        # The gradient noise scale's running estimates (noise_scale.py).
        self.noise_scale = (
            noise_lib.NoiseScale(config.noise_scale,
                                 self._train_step.noise_groups,
                                 config.global_batch_size,
                                 optimizer=type(optimizer).__name__.lower())
            if self._train_step.measures_noise else None)
        self._adascale = self._find_adascale(optimizer)
        self._eval_step = EvalStep(model=model, loss_fn=loss_fn,
                                   metrics=self.metrics, strategy=strategy,
                                   collectives=self.collectives)
        self.timer = StepTimer(examples_per_step=config.global_batch_size)
        self._interval = IntervalReport(
            self.timer, loss_scale=self.loss_scale,
            noise_scale=self.noise_scale, adascale=self._adascale)
        self._noise_notice_given = False
        self._adascale_end_logged = False
        self.checkpoint_path = None
        self._saved_step = None
        self._verbose = config.verbose
        self._keeper = (self._make_keeper() if config.checkpoint_dir
                        else None)

    def _shard(self, optimizer, model, strategy, config):
        """The sharded update of `shard_optimizer_state` (`zero.py`).

        Raises:
            ConfigError: The preconditioned noise scale (it reads every
                variable's second moments), or what `zero.py` refuses.
        """
        if config.noise_scale.mode == "preconditioned":
            raise ConfigError(
                "shard_optimizer_state", "the preconditioned noise scale "
                "reads every variable's second moments, which a sharded "
                "optimizer holds 1/N of: use noise_scale mode 'plain'")
        return zero.sharded_optimizer(
            optimizer, model.trainable_variables, self.collectives,
            strategy, jit_compile=config.jit_compile or config.compile_update)

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer slots this worker holds (moments, momentum;
        not the step count or the rate): the Keras optimizer's own (none
        when sharded: it is never built) and the sharded update's."""
        own = {id(self.optimizer.iterations),
               id(getattr(self.optimizer, "_learning_rate", None))}
        held = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                   for v in self.optimizer.variables if id(v) not in own)
        if self._sharded is not None:
            held += self._sharded.state_bytes
        return held

    def memory_summary(self) -> dict:
        """What each worker holds and sends (summary.json): the optimizer
        slots' bytes, every worker's peak resident memory (a collective:
        every worker calls it), and the bytes a worker sends per step for
        the gradients (and, sharded, the weights) against a ring
        all-reduce of the gradients."""
        peak = memory.peak_resident_bytes() or 0
        peaks = [int(self.collectives.agree(
            float(peak) if i == self.worker_index else 0.0))
            for i in range(self.num_workers)]
        n = self.collectives.num_replicas
        params = sum(int(np.prod(v.shape))
                     for v in self.model.trainable_variables)
        all_reduce = int(2 * (n - 1) / n * 4 * params)
        sent = (self._sharded.wire_bytes()["sharded"]
                if self._sharded is not None else all_reduce)
        return {"shard_optimizer_state": self._sharded is not None,
                "optimizer_state_bytes_per_worker": self.optimizer_state_bytes,
                "peak_resident_bytes": peaks,
                "gradient_bytes_sent_per_step": sent,
                "all_reduce_bytes_sent_per_step": all_reduce}

    def _find_adascale(self, optimizer):
        """The optimizer's AdaScale schedule, or None; it needs the plain
        noise scale.

        Raises:
            ConfigError: AdaScale without the plain noise scale.
        """
        adascale = _compat.learning_rate_schedule(optimizer)
        if not getattr(adascale, "follows_noise_scale", False):
            return None
        if self.noise_scale is None:
            raise ConfigError(
                "scaling_rule", "AdaScale needs the gradient noise scale, "
                "measured with at least 2 micro-batches per step (replicas x"
                " accumulation steps: "
                f"{self._train_step.micro_batches_per_step}) and noise_scale"
                " mode 'plain'")
        if self.config.noise_scale.mode != "plain":
            raise ConfigError(
                "scaling_rule", "AdaScale needs noise_scale mode 'plain' (its "
                "gain is defined for SGD's gradients)")
        return adascale

    def _make_keeper(self) -> checkpointing.CheckpointKeeper:
        """The checkpoints: everything the run is (model, optimizer, step,
        loss scale, metrics, input position and order, noise scale,
        AdaScale)."""
        position = self.position
        optimizer = (self._sharded.checkpoint_view()
                     if self._sharded is not None else self.optimizer)
        trackables = checkpointing.training_trackables(
            self.model, optimizer, position.step,
            loss_scale=self.loss_scale, metrics=self.metrics,
            input_position=position.input_position,
            input_order=position.input_order,
            noise_scale=(self.noise_scale.variables
                         if self.noise_scale else None),
            adascale=(self._adascale.variables if self._adascale else None))
        barrier = self.collectives.barrier if self.num_workers > 1 else None
        return checkpointing.CheckpointKeeper(
            self.config.checkpoint_dir, is_chief=self.is_chief,
            worker_index=self.worker_index, num_workers=self.num_workers,
            barrier_fn=barrier,
            max_to_keep=self.config.max_checkpoints_to_keep, **trackables)

    # ---- public API --------------------------------------------------------

    @property
    def step(self) -> tf.Variable:
        """Steps taken (including fp16 steps skipped): a host variable."""
        return self.position.step

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
        if getattr(model, "optimizer", None) is None or not getattr(
                model, "compiled", False):
            raise ValueError("compile the model first (optimizer, loss, "
                             "metrics), or use the Trainer constructor")
        loss = model.loss
        if isinstance(loss, (list, tuple, dict)) or loss is None:
            raise ValueError(f"the compiled loss must be one loss, got "
                             f"{loss!r}; pass loss_fn to the constructor")
        if isinstance(loss, str):
            loss = keras.losses.get(loss)
        metrics = _compat.compiled_metrics(model)
        return cls(model=model, optimizer=model.optimizer, loss_fn=loss,
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
        input position, so the run continues exactly where it stopped.

        The input position: a `dataset_fn` with `at(position)` (the
        toolkit's record pipelines in the global order,
        `input_pipelines.tfrecord.PositionedDatasetFn`) is started at the
        global record position the checkpoint holds, on any worker count.
        Any other input is resumed from each worker's saved `tf.data`
        iterator state, which exists only for the same worker count; on
        another count it starts over (docs/checkpoints.md). The Trainer's checkpoint wins over a `BackupAndRestore`
        callback; without one, `BackupAndRestore`'s epoch is used.

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
            initial_epoch: Epoch to start from (a fresh run only; a resumed
                run starts where its checkpoint is).
            steps_per_epoch: Optimizer steps per epoch (default: one pass
                over a finite dataset or the arrays).
            validation_steps: Limit on validation batches.

        Returns:
            The `keras.callbacks.History` (epoch logs).

        Raises:
            Preempted: A worker got SIGTERM; the checkpoint of the step all
                workers agreed on is saved (a `SystemExit` with code 143).
            checkpointing.RestoreError: The checkpoint does not fit.
            InputPipelineError: The input pipeline failed.
            ValueError: Inputs that do not fit the Trainer (batch size,
                too little data, unknown length without steps_per_epoch).
        """
        if fit_arguments.is_dataset_fn(x):
            if steps_per_epoch is None:
                raise ValueError("steps_per_epoch is required with a "
                                 "dataset_fn")
            dataset_fn = x
        else:
            dataset_fn, steps_per_epoch = fit_arguments.training_input(
                x, y, sample_weight, batch_size=batch_size,
                global_batch_size=self.config.global_batch_size,
                per_replica_batch_size=self.per_replica_batch_size,
                steps_per_epoch=steps_per_epoch, shuffle=shuffle)
        if steps_per_epoch < 1 or epochs < 1:
            raise ValueError("steps_per_epoch and epochs must be >= 1")
        validation_fn = None
        if validation_data is not None:
            validation_fn = self._evaluation_fn(validation_data)
        verbose = (self.config.verbose if verbose in (None, "auto")
                   else int(verbose))
        # A positioned input is built once the checkpoint says where it
        # starts (in _fit); any other now, so its iterator can be restored.
        self._feed = (None if _positioned(dataset_fn)
                      else self._make_feed(dataset_fn))
        worker_dir = None if self.is_chief else tempfile.mkdtemp(
            prefix="tfscale-worker-")
        callbacks = list(callbacks)
        callback_files.make_backups_atomic(callbacks)
        if worker_dir:
            callback_files.route_writes(callbacks, worker_dir)
        callback_list = keras.callbacks.CallbackList(
            callbacks, add_history=True,
            add_progbar=self.is_chief and verbose == 1,
            model=self.model, verbose=verbose, epochs=epochs,
            steps=steps_per_epoch)
        self._verbose = verbose
        # SIGTERM from now on is a preemption request (see preemption.py).
        try:
            with SignalWatch() as watch:
                return self._fit(dataset_fn, callbacks, callback_list,
                                 worker_dir, watch, steps_per_epoch, epochs,
                                 validation_fn, validation_steps,
                                 initial_epoch)
        except BaseException:
            # An error, a preemption (Preempted) or Ctrl-C: on_train_end
            # will not run, so what the callbacks logged is closed here.
            callback_files.close_writers(callbacks)
            raise
        finally:
            self._verbose = self.config.verbose
            if self._keeper:
                self._keeper.untrack_input()
                self._keeper.close()
            if self._feed is not None:
                self._feed.close()
                self._feed = None
            if worker_dir:
                shutil.rmtree(worker_dir, ignore_errors=True)

    def _evaluation_fn(self, data, batch_size=None, y=None,
                       sample_weight=None):
        if fit_arguments.is_dataset_fn(data):
            return data
        if isinstance(data, tuple):
            data, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        return fit_arguments.evaluation_input(
            data, y, sample_weight,
            batch_size=batch_size or self.config.global_batch_size,
            per_replica_batch_size=self.per_replica_batch_size)

    def _make_feed(self, dataset_fn) -> ReplicaFeed:
        return ReplicaFeed(self.strategy, dataset_fn,
                         num_replicas=self.collectives.num_replicas,
                         num_workers=self.num_workers,
                         worker_index=self.worker_index)

    def _position_feed(self, dataset_fn) -> None:
        """(Re)builds a positioned input at `input_position`.

        Raises:
            ValueError: Its per-replica batch is not the Trainer's: the
                position advances by the global batch each step, so it
                would drift from what the input delivered.
        """
        if self._feed is not None:
            self._feed.close()
        self._feed = self._make_feed(
            dataset_fn.at(self.position.records))
        spec = tf.nest.flatten(self._feed.iterator.element_spec,
                               expand_composites=True)[0]
        delivered = spec.shape[0] if spec.shape.rank else None
        if delivered is not None and delivered != self.per_replica_batch_size:
            raise ValueError(
                f"the input's batches hold {delivered} examples per replica, "
                f"the Trainer's {self.per_replica_batch_size} (global batch "
                f"{self.config.global_batch_size} over "
                f"{self.collectives.num_replicas} replica(s) x "
                f"{self.config.num_accumulation_steps} accumulation step(s)):"
                " build the dataset_fn with trainer.per_replica_batch_size, "
                "or the input position in checkpoints would not be where the "
                "input is")

    def _fit(self, dataset_fn, callbacks, callback_list, worker_dir, watch,
             steps_per_epoch, epochs, validation_fn, validation_steps,
             initial_epoch):
        self.model.stop_training = False
        self._interval.reset()
        positioned = _positioned(dataset_fn)
        restored, reordered = self._restore(dataset_fn, positioned)
        _compat.clear_restored_epoch(self.model)
        _compat.build_compiled_metrics(self.model, self.metrics,
                                       self._feed.iterator.element_spec)
        callback_list.on_train_begin()
        if worker_dir:
            callback_files.route_backup_writes(callbacks, worker_dir)
        self._start_where_callbacks_say(restored, dataset_fn, positioned,
                                        steps_per_epoch, initial_epoch)
        self._resume_noise_scale(restored)
        start = self.position.steps
        if restored:
            self._saved_step = start
            where = self._resume_input(dataset_fn, positioned, reordered,
                                       start)
            self._log(f"resumed from {restored} at step {start}; input "
                      f"{where}")
        _compat.continue_tensorboard_steps(callbacks, start)
        logs = {}
        for epoch in range(start // steps_per_epoch, epochs):
            logs = self._train_epoch(self._feed, callback_list, epoch,
                                     steps_per_epoch, watch)
            if validation_fn is not None:
                val = self.evaluate(validation_fn, steps=validation_steps)
                logs.update({f"val_{k}": v for k, v in val.items()})
            callback_list.on_epoch_end(epoch, logs)
            if self._agreed_stop():
                break
        self._save()
        callback_list.on_train_end(logs)
        return self.model.history

    # ---- resume ----------------------------------------------------------------

    def _restore(self, dataset_fn, positioned: bool):
        """Starts from the chief's weights, then the latest checkpoint (read
        by every worker) when there is one; settles the input position and
        builds a positioned input there. Returns (the checkpoint restored
        or None, the line saying the input order moved or None)."""
        # A fresh start begins from the chief's weights (MPI; a strategy
        # synchronized them when it created them); a checkpoint overrides.
        self.collectives.broadcast_from_chief(
            self.model.variables + self.optimizer.variables)
        restored = None
        if self._keeper:
            if not positioned and _resumable(dataset_fn):
                self._keeper.track_input(self._feed.iterator)
            if self._keeper.latest:
                self.position.forget_input()  # unless the checkpoint has it
            restored = self._keeper.restore_latest()
        self.position.settle()
        reordered = None
        if positioned:
            reordered = self.position.settle_order(dataset_fn)
            self._position_feed(dataset_fn)
        return restored, reordered

    def _start_where_callbacks_say(self, restored, dataset_fn, positioned,
                                   steps_per_epoch, initial_epoch) -> None:
        """After `on_train_begin`: BackupAndRestore may have loaded its own
        weights (the Trainer's checkpoint wins) or restored an epoch (the
        run starts there), or `initial_epoch` sets a fresh run's start."""
        backup_epoch = _compat.restored_epoch(self.model)
        if restored and backup_epoch is not None:
            # BackupAndRestore loaded its weights over ours: ours win.
            self._keeper.restore_latest()
            return
        if backup_epoch:
            # BackupAndRestore restored weights at an epoch boundary.
            self.position.move_to(backup_epoch * steps_per_epoch)
        elif initial_epoch and not self.position.steps:
            self.position.move_to(initial_epoch * steps_per_epoch)
        else:
            return
        if positioned:
            self._position_feed(dataset_fn)

    def _resume_noise_scale(self, restored) -> None:
        if restored and self.noise_scale is not None:
            self.noise_scale.load()
        if (self.noise_scale is None and self.config.noise_scale.enabled
                and not self._noise_notice_given):
            self._noise_notice_given = True
            self._log("gradient noise scale not measured: it needs at least "
                      "2 micro-batches per step (replicas x accumulation "
                      "steps; here 1)")

    def _resume_input(self, dataset_fn, positioned, reordered,
                      start: int) -> str:
        """Where a resumed run's input continues (restoring a tf.data
        iterator's saved state when that is how it resumes), in words."""
        if reordered:
            return reordered
        if positioned:
            return (f"position restored (global record "
                    f"{self.position.records}, the same order on "
                    "any worker count)")
        if not _resumable(dataset_fn):
            return ("continues where its tf.data service is (its position "
                    "is not in checkpoints)")
        if self._keeper.restore_input(start):
            return "position restored"
        return (f"starts over (no input state for {self.num_workers} "
                "worker(s) at this step)")

    def evaluate(self, x=None, y=None, batch_size: Optional[int] = None,
                 steps: Optional[int] = None, sample_weight=None) -> dict:
        """Mean loss and metrics over a finite dataset, on all workers.

        Args:
            x: A finite `dataset_fn`, a `tf.data.Dataset` of global batches,
                or arrays (with `y`, `sample_weight`, `batch_size`).
            steps: Limit on (global) batches.

        Every example is counted once even when workers hold uneven numbers
        of batches (the distributed iterator pads and agrees on the end).
        """
        dataset_fn = self._evaluation_fn(x, batch_size, y, sample_weight)
        for metric in self.metrics:
            metric.reset_state()
        if self.collectives.num_replicas > self.strategy.num_replicas_in_sync:
            # One replica per process (MPI): this process's shard; the
            # others may have more batches (run_empty matches them).
            iterator = ReplicaFeed(self.strategy, dataset_fn,
                                 num_replicas=self.collectives.num_replicas,
                                 num_workers=self.num_workers,
                                 worker_index=self.worker_index).iterator
        else:
            # The distributed iterator pads and agrees on the end.
            iterator = iter(self.strategy.distribute_datasets_from_function(
                dataset_fn))
        loss_sum = count = 0.0
        batches = 0
        try:
            while steps is None or batches < steps:
                try:
                    optional = iterator.get_next_as_optional()
                    has_value = bool(optional.has_value())
                except tf.errors.OpError as e:
                    raise InputPipelineError(
                        e.message.strip().splitlines()[0]) from e
                totals = (self._eval_step.run(optional.get_value())
                          if has_value else self._eval_step.run_empty())
                total, n, had_batch = self._local(totals).numpy()
                if not had_batch:
                    break
                loss_sum += float(total)
                count += float(n)
                batches += 1
        finally:
            holder = [iterator]
            del iterator
            delete_in_background(holder)
        logs = {"loss": loss_sum / max(count, 1.0)}
        logs.update(self._metric_logs())
        return logs

    # ---- the loop ------------------------------------------------------------

    def _train_epoch(self, feed, callback_list, epoch, steps_per_epoch, watch):
        callback_list.on_epoch_begin(epoch)
        # The step in Python (the variable is for checkpoints): the loop
        # reads the device once per call of the compiled step.
        step = self.position.steps
        if step % steps_per_epoch == 0:
            # (A resume inside an epoch keeps the restored running values.)
            for metric in self.metrics:
                metric.reset_state()
        loss_total, seen = 0.0, 0
        logs = {}
        batch = step % steps_per_epoch
        while batch < steps_per_epoch:
            # TensorBoard counts batch callbacks; its steps are the
            # optimizer's: it adds 1 here, the call's first step.
            _compat.continue_tensorboard_steps(callback_list.callbacks, step)
            callback_list.on_train_batch_begin(batch)
            result = self._run_steps(feed, step + 1, steps_per_epoch - batch,
                                     watch)
            self._count(result)
            step += result.steps
            batch += result.steps
            loss_total += sum(result.losses)
            seen += result.steps
            # As in Keras's fit: "loss" is the running mean over the epoch.
            logs = {"loss": loss_total / seen, **result.metrics}
            # An interval ends every log_steps and at the epoch's end, so a
            # run shorter than log_steps still reports the steps it ran.
            if (step % self.config.log_steps == 0
                    or batch == steps_per_epoch):
                logs["learning_rate"] = self._learning_rate()
                logs.update(self._report(step))
            # Batch callbacks run once per call, with the last step's index
            # (as Keras's fit does with steps_per_execution).
            _compat.continue_tensorboard_steps(callback_list.callbacks, step)
            callback_list.on_train_batch_end(batch - 1, logs)
            if self._after_call(result, step, watch):
                # Set on some worker during the previous call: all stop here.
                # (AdaScale's progress is the same on every worker: its
                # gains come from the all-reduced estimates.)
                self.model.stop_training = True
                break
        logs["learning_rate"] = self._learning_rate()
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

    def _after_call(self, result, step: int, watch) -> bool:
        """After a call's callbacks: preempted (saves, leaves together,
        raises `Preempted`), a checkpoint when due; True when the run stops
        here (a stop flag, or AdaScale at the reference run's end)."""
        stop, preempt = result.stop, result.preempt
        if self.num_workers == 1:
            # No peer to agree with: act on the flags at once.
            stop, preempt = self.model.stop_training, watch.requested
        if preempt:
            self._save()
            # Exit together: an MPI launcher ends the job as soon as one
            # rank exits, possibly before the chief's checkpoint is done.
            self.leave_together()
            self._log(f"preempted (SIGTERM/SIGUSR1): saved step {step}, "
                      "exiting with code 143")
            raise Preempted(step, self.checkpoint_path)
        if (self.config.save_checkpoints_steps
                and step % self.config.save_checkpoints_steps == 0):
            self._save()
        return stop or self._adascale_finished()

    def _run_steps(self, feed, first: int, most: int, watch):
        """The next call of the compiled step: one or more optimizer steps
        from step number `first` (`StepPlan.steps_in_call`), with this
        worker's flags."""
        count = (1 if self._adascale is not None  # its rate moves each step
                 else self._train_step.plan.steps_in_call(first, most))
        signals = [float(bool(self.model.stop_training)),
                   float(watch.requested)]
        try:
            return self._train_step.run(first, count, feed.iterator,
                                        signals, self.timer)
        except tf.errors.OpError as e:
            if is_input_error(e):
                raise input_error(e) from e
            raise

    def adascale_summary(self) -> Optional[dict]:
        """AdaScale's steps, progress, mean gain and examples; None
        without AdaScale."""
        if self._adascale is None:
            return None
        return self._adascale.summary(self.position.steps)

    def _adascale_finished(self) -> bool:
        """AdaScale's progress reached the reference run's length: the run
        has trained as far as the reference run (the paper's end)."""
        if self._adascale is None or not self._adascale.finished():
            return False
        if not self._adascale_end_logged:
            self._adascale_end_logged = True
            self._log(f"AdaScale: progress {self._adascale.progress():.1f} "
                      f"reached the reference run's "
                      f"{self._adascale.reference_steps} steps at step "
                      f"{self.position.steps}; the run ends here")
        return True

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

    def _local(self, value):
        return self.strategy.experimental_local_results(value)[0]

    def _metric_logs(self) -> dict:
        return {k: float(v)
                for k, v in self._train_step.metric_results().items()}

    def _learning_rate(self) -> float:
        return float(keras.ops.convert_to_numpy(self.optimizer.learning_rate))

    def _report(self, step: int) -> dict:
        """Closes the log interval: its numbers, and its line at verbose 2."""
        summary, line = self._interval.close(step)
        if self._verbose == 2:
            self._log(line)
        return summary

    def _save(self):
        step = self.position.steps
        if self._keeper and step != self._saved_step:
            # (Every worker takes the same branch: the step is agreed.)
            if self.noise_scale is not None:
                self.noise_scale.store()
            if self._sharded is not None:
                # The slots whole, in the unsharded layout (a collective).
                self._sharded.gather_slots()
            try:
                path = self._keeper.save(step)
            finally:
                if self._sharded is not None:
                    self._sharded.release_slots()
            self._saved_step = step
            if path:
                self.checkpoint_path = path

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
        if self.is_chief:
            logging.info("tfscale: %s", message)


def _resumable(dataset_fn) -> bool:
    """The input's iterator can be saved (a tf.data service's cannot)."""
    return getattr(dataset_fn, "resumable", True)


def _positioned(dataset_fn) -> bool:
    """The input can start at a global record position (`at`)."""
    return callable(getattr(dataset_fn, "at", None))
