"""`Trainer`: a `fit`-like loop for any Keras 3 model under any strategy.

Keras 3's `model.fit` fails under MultiWorkerMirroredStrategy (DESIGN.md fact
1) and lacks what large-scale training needs (facts 7-11). The Trainer keeps
`fit`'s contract (a dataset, epochs, steps, standard `keras.callbacks`) and
adds: one all-reduce per optimizer step with gradient accumulation, clipping
after the all-reduce, XLA for the forward/backward on any device, fp16 loss
scaling, chief-only files, checkpoints with automatic resume, and a per-step
time split (input wait, compute, gradient sync, update).

The math lives in `step.py`; this file is the loop around it.
"""

import shutil
import tempfile
from typing import Callable, Optional, Sequence

import keras
import tensorflow as tf
from absl import logging

from tfscale import _compat
from tfscale import callback_files
from tfscale import precision as precision_lib
from tfscale.checkpointing import CheckpointKeeper
from tfscale.cluster import chief_and_worker_count
from tfscale.step import EvalStep, StepConfig, TrainStep
from tfscale.timing import StepTimer
from tfscale.train_config import TrainConfig


class Trainer:
    """Trains a Keras 3 model under a `tf.distribute` strategy.

    Args:
        model: A built Keras 3 model, created under `strategy.scope()`.
        optimizer: Its optimizer, created under `strategy.scope()`.
        loss_fn: `keras.losses.Loss` or `fn(y_true, y_pred)` returning one
            loss per example.
        strategy: The strategy (from `tfscale.cluster.make_strategy`, or any
            `MirroredStrategy` / `MultiWorkerMirroredStrategy`).
        config: A `TrainConfig`.
        metrics: Keras metrics, created under `strategy.scope()`.
        communication_options: `CommunicationOptions` for the all-reduce.

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
                 communication_options=None):
        replicas = strategy.num_replicas_in_sync
        divisor = replicas * config.num_accumulation_steps
        if config.global_batch_size % divisor:
            raise ValueError(
                f"global batch size {config.global_batch_size} is not "
                f"divisible by replicas ({replicas}) x accumulation steps "
                f"({config.num_accumulation_steps})")
        if not model.built:
            raise ValueError("build the model (call it on a batch or build "
                             "it with shapes) under strategy.scope() first")
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy
        self.config = config
        self.metrics = list(metrics)
        self.is_chief, self.num_workers = chief_and_worker_count(strategy)
        self.per_replica_batch_size = config.global_batch_size // divisor
        with strategy.scope():
            optimizer.build(model.trainable_variables)
            self.loss_scale = (precision_lib.DynamicLossScale()
                               if precision_lib.needs_loss_scaling(
                                   config.precision) else None)
        # Steps taken, including fp16 steps skipped for non-finite gradients
        # (optimizer.iterations counts applied ones only). A plain host
        # variable: identical on every worker by construction, and a
        # MirroredVariable costs about a millisecond per step to update.
        with tf.device("/cpu:0"):
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                    name="train_step")
        _compat.disable_gradient_aggregation(optimizer)
        # Keras callbacks (TensorBoard, BackupAndRestore, ModelCheckpoint)
        # look for the optimizer where `compile` would have put it.
        model.optimizer = optimizer
        self._train_step = TrainStep(
            model=model, optimizer=optimizer, loss_fn=loss_fn,
            metrics=self.metrics, strategy=strategy,
            config=StepConfig(config.global_batch_size,
                              config.num_accumulation_steps,
                              config.jit_compile, config.clip_global_norm),
            communication_options=communication_options,
            loss_scale=self.loss_scale)
        self._eval_step = EvalStep(model=model, loss_fn=loss_fn,
                                   metrics=self.metrics, strategy=strategy)
        self._agree = tf.function(self._agree_fn)
        self.timer = StepTimer(examples_per_step=config.global_batch_size)
        self._interval_loss, self._interval_steps = 0.0, 0
        self._split_steps = 0
        self._skipped_steps = 0  # fp16 steps skipped in this log interval
        self.checkpoint_path = None
        self._keeper = None
        if config.checkpoint_dir:
            trackables = dict(model=model, optimizer=optimizer, step=self.step)
            if self.loss_scale is not None:
                trackables["loss_scale"] = self.loss_scale
            self._keeper = CheckpointKeeper(
                config.checkpoint_dir, is_chief=self.is_chief,
                max_to_keep=config.max_checkpoints_to_keep, **trackables)

    # ---- public API --------------------------------------------------------

    def fit(self, dataset_fn: Callable, *, steps_per_epoch: int, epochs: int = 1,
            callbacks: Sequence[keras.callbacks.Callback] = (),
            validation_fn: Optional[Callable] = None,
            validation_steps: Optional[int] = None) -> keras.callbacks.History:
        """Trains for `epochs` x `steps_per_epoch` optimizer steps.

        Resumes from the latest checkpoint in `config.checkpoint_dir` (or the
        epoch a `BackupAndRestore` callback restored), skipping the batches
        the earlier run consumed so a deterministic pipeline continues where
        it left off.

        Args:
            dataset_fn: `fn(tf.distribute.InputContext) -> tf.data.Dataset`
                of per-replica batches (`(x, y)` or `(x, y, sample_weight)`)
                of size `per_replica_batch_size`, repeated.
            steps_per_epoch: Optimizer steps per epoch.
            epochs: Number of epochs.
            callbacks: `keras.callbacks.Callback` objects.
            validation_fn: Like `dataset_fn`, finite; evaluated each epoch.
            validation_steps: Limit on validation batches.

        Returns:
            The `keras.callbacks.History` (epoch logs).
        """
        if steps_per_epoch < 1 or epochs < 1:
            raise ValueError("steps_per_epoch and epochs must be >= 1")
        worker_dir = None if self.is_chief else tempfile.mkdtemp(
            prefix="tfscale-worker-")
        callbacks = list(callbacks)
        if worker_dir:
            callback_files.route_writes(callbacks, worker_dir)
        callback_list = keras.callbacks.CallbackList(
            callbacks, add_history=True,
            add_progbar=self.is_chief and self.config.verbose == 1,
            model=self.model, verbose=self.config.verbose, epochs=epochs,
            steps=steps_per_epoch)
        self.model.stop_training = False
        self.timer.reset()
        self._interval_loss, self._interval_steps = 0.0, 0
        restored = self._keeper.restore_latest() if self._keeper else None
        self.model._initial_epoch = None
        callback_list.on_train_begin()
        if worker_dir:
            callback_files.route_backup_writes(callbacks, worker_dir)
        if not restored and self.model._initial_epoch:
            # BackupAndRestore restored weights at an epoch boundary.
            self.step.assign(self.model._initial_epoch * steps_per_epoch)
        start = int(self.step.numpy())
        if restored:
            self._log(f"resumed from {restored} at step {start}")
        iterator = iter(self.strategy.distribute_datasets_from_function(
            self._skipping(dataset_fn, start)))
        logs = {}
        try:
            for epoch in range(start // steps_per_epoch, epochs):
                logs = self._train_epoch(iterator, callback_list, epoch,
                                         steps_per_epoch)
                if validation_fn is not None:
                    val = self.evaluate(validation_fn, steps=validation_steps)
                    logs.update({f"val_{k}": v for k, v in val.items()})
                callback_list.on_epoch_end(epoch, logs)
                if self.model.stop_training:
                    break
            self._save()
            callback_list.on_train_end(logs)
        finally:
            if self._keeper:
                self._keeper.close()
            if worker_dir:
                shutil.rmtree(worker_dir, ignore_errors=True)
        return self.model.history

    def evaluate(self, dataset_fn: Callable, steps: Optional[int] = None) -> dict:
        """Mean loss and metrics over a finite dataset, on all workers.

        Every example is counted once even when workers hold uneven numbers
        of batches (the distributed iterator pads and agrees on the end).
        """
        for metric in self.metrics:
            metric.reset_state()
        iterator = iter(self.strategy.distribute_datasets_from_function(
            dataset_fn))
        loss_sum = count = 0.0
        batches = 0
        while steps is None or batches < steps:
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            total, n = self._eval_step.run(optional.get_value())
            loss_sum += float(self._local(total))
            count += float(self._local(n))
            batches += 1
        logs = {"loss": loss_sum / max(count, 1.0)}
        logs.update(self._metric_logs())
        return logs

    # ---- the loop ------------------------------------------------------------

    def _train_epoch(self, iterator, callback_list, epoch, steps_per_epoch):
        callback_list.on_epoch_begin(epoch)
        for metric in self.metrics:
            metric.reset_state()
        loss_total, seen = 0.0, 0
        first = int(self.step.numpy()) % steps_per_epoch
        logs = {}
        for batch in range(first, steps_per_epoch):
            callback_list.on_train_batch_begin(batch)
            loss, metric_logs = self._train_one_step(iterator,
                                                     first_of_fit=not seen)
            self.step.assign_add(1)
            step = int(self.step.numpy())
            loss_total += loss
            seen += 1
            self._interval_loss += loss
            self._interval_steps += 1
            # As in Keras's fit: "loss" is the running mean over the epoch.
            logs = {"loss": loss_total / seen, **metric_logs}
            if step % self.config.log_steps == 0:
                logs["learning_rate"] = self._learning_rate()
                logs.update(self._report(step))
            callback_list.on_train_batch_end(batch, logs)
            if (self.config.save_checkpoints_steps
                    and step % self.config.save_checkpoints_steps == 0):
                self._save()
            if self._should_stop():
                break
        logs["learning_rate"] = self._learning_rate()
        return dict(logs)

    def _is_timed(self, step: int, first_of_fit: bool) -> bool:
        """Whether step number `step` (1-based) is run part by part.

        Also the first step of every fit, so that the part functions are
        traced there and not inside a measured interval.
        """
        if self.loss_scale is not None or first_of_fit:
            return True  # fp16 needs the host between sync and apply
        remainder = step % self.config.log_steps
        return (self.config.timed_steps_per_log > 0 and (
            remainder == 0 or
            remainder > self.config.log_steps - self.config.timed_steps_per_log))

    def _train_one_step(self, iterator, first_of_fit=False):
        """One optimizer step; returns (reduced loss, metric logs)."""
        timer = self.timer
        timed = self._is_timed(int(self.step.numpy()) + 1, first_of_fit)
        timer.start()
        micro_batches = tuple(next(iterator)
                              for _ in range(self.config.num_accumulation_steps))
        timer.mark("input_wait")
        if not timed:
            loss, metrics = self._train_step.fused(micro_batches)
            loss = float(self._local(loss))
            timer.stop(timed=False)
            return loss, {k: float(v) for k, v in metrics.items()}
        loss, grads = self._train_step.compute(micro_batches)
        self._local(loss).numpy()  # wait for the backward pass
        timer.mark("compute")
        loss, grads, finite, _ = self._train_step.sync(loss, grads)
        loss = float(self._local(loss))
        finite = bool(self._local(finite))
        timer.mark("sync")
        if finite or self.loss_scale is None:
            self._train_step.apply(grads)
            self.optimizer.iterations.numpy()  # wait for the update
        if self.loss_scale is not None:
            self.loss_scale.update(finite)
            self._skipped_steps += 0 if finite else 1
        timer.mark("update")
        # The very first part-by-part step traces the functions: not counted.
        timer.stop(timed=self._split_steps > 0)
        self._split_steps += 1
        return loss, self._metric_logs()

    def _should_stop(self) -> bool:
        """`model.stop_training` agreed by all workers (any one stops all: the
        flags are summed).

        Callbacks see identical reduced logs on every worker, but one that
        decides from local state would otherwise leave the others waiting
        in the next collective forever.
        """
        if self.num_workers == 1:
            return bool(self.model.stop_training)
        flag = tf.constant(1.0 if self.model.stop_training else 0.0)
        stop = bool(self._local(self._agree(flag)) > 0)
        self.model.stop_training = stop
        return stop

    def _agree_fn(self, flag):
        def replica_fn():
            return tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, tf.identity(flag))
        return self.strategy.run(replica_fn)

    # ---- helpers -------------------------------------------------------------

    def _skipping(self, dataset_fn, start_step):
        """Wraps `dataset_fn` to skip the batches `start_step` steps used."""
        if start_step == 0:
            return dataset_fn
        local_replicas = self.strategy.num_replicas_in_sync // self.num_workers
        skip = start_step * self.config.num_accumulation_steps * local_replicas
        return lambda context: dataset_fn(context).skip(skip)

    def _local(self, value):
        return self.strategy.experimental_local_results(value)[0]

    def _metric_logs(self) -> dict:
        return {k: float(v)
                for k, v in self._train_step.metric_results().items()}

    def _learning_rate(self) -> float:
        return float(keras.ops.convert_to_numpy(self.optimizer.learning_rate))

    def _report(self, step: int) -> dict:
        """Throughput, time split and mean loss of the last log interval."""
        summary = self.timer.summary()
        summary["interval_loss"] = self._interval_loss / max(
            self._interval_steps, 1)
        self.timer.reset()
        self._interval_loss, self._interval_steps = 0.0, 0
        fp16 = ""
        if self.loss_scale is not None:
            summary["loss_scale"] = float(self.loss_scale.scale.numpy())
            summary["skipped_steps"] = float(self._skipped_steps)
            self._skipped_steps = 0
            fp16 = (f"; loss scale {summary['loss_scale']:g}, "
                    f"{summary['skipped_steps']:g} step(s) skipped")
        line = (f"step {step}: loss {summary['interval_loss']:.4f}, "
                f"{summary['examples_per_second']:.1f} examples/s, "
                f"step {1000 * summary['step_time']:.1f} ms; timed steps "
                f"{1000 * summary['timed_step_time']:.1f} ms "
                f"(input {1000 * summary['input_wait']:.1f}, "
                f"compute {1000 * summary['compute']:.1f}, "
                f"sync {1000 * summary['sync']:.1f}, "
                f"update {1000 * summary['update']:.1f}){fp16}")
        if self.config.verbose == 2:
            self._log(line)
        return summary

    def _save(self):
        if self._keeper:
            path = self._keeper.save(int(self.step.numpy()))
            if path:
                self.checkpoint_path = path

    def _log(self, message: str):
        if self.is_chief:
            logging.info("tfscale: %s", message)
