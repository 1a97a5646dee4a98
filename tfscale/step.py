"""The distributed training step: compute, sync, apply; several per call.

One optimizer step is three parts:

    compute  per replica: forward and backward over k micro-batches, the
             gradients summed locally and the metrics updated, in one
             XLA-compiled function when asked. No communication.
    sync     one all-reduce of [loss and flags, *gradients] across all
             replicas (through the backend's `collectives.py` object), then
             loss-scale removal, a finite check and global-norm clipping
             (XLA-compiled unless `compile_update` is off: no collective and
             no matmul in it).
    apply    the optimizer update with the reduced gradients: all variables
             in one XLA-compiled function where the worker holds one
             replica (XLA compiles no collective on CPU, and Keras's update
             under a strategy of several local replicas is a `merge_call`
             that XLA cannot hold); the plain per-variable update otherwise.

`execute` runs up to n whole steps in one call (the idea behind Keras's
`steps_per_execution` and Google's `iterations_per_loop`): the input is
read inside the call, the fp16 decision to skip a step with non-finite
gradients is a `tf.cond` on the device, and the loss, flags and noise-scale
sums of every step come back in one tensor, read once. The loop leaves early
at the first step whose all-reduced flags ask to stop or to save for a
preemption, so every worker leaves at the same step.

`compute`, `sync` and `apply` are the same parts as separate calls, for
timing each part: the Trainer runs a few steps per log interval this way,
each part followed by a host wait.

Loss scaling across replicas: each replica's loss is the sum of its
per-example losses divided by the *global* batch (per-replica x replicas x
accumulation steps). Summing gradients over micro-batches and replicas then
yields exactly the gradient of the mean loss over the global batch, which is
why N workers with global batch B match one worker with batch B.
"""

from typing import Callable, Sequence

import keras
import tensorflow as tf

from tfscale import _compat
from tfscale import noise_norms
from tfscale.loss_metrics import add_others, metric_variables, unreduced
from tfscale.replica_feed import input_error, is_input_error
from tfscale.sharded_sync import ShardedSync
from tfscale.step_plan import StepPlan
from tfscale.step_row import RowLayout, StepsResult
from tfscale.train_config import TrainConfig


class TrainStep:
    """Compiled training steps for one model.

    Args:
        model: A built Keras 3 model, created under `strategy.scope()`.
        optimizer: Its optimizer, created under the same scope, with its own
            gradient aggregation switched off
            (`_compat.disable_gradient_aggregation`).
        loss_fn: `keras.losses.Loss` or `fn(y_true, y_pred) -> [batch]`.
        metrics: Keras metrics updated with (y_true, y_pred) per micro-batch.
        strategy: The `tf.distribute` strategy.
        collectives: The backend's collectives (`collectives.py`): the
            all-reduce, and whether metric states must be summed here.
        config: The Trainer's `TrainConfig`.
        feed: `fn(iterator, k) -> k per-replica micro-batches`
            (`ReplicaFeed.take`); it runs inside the compiled call too.
        loss_scale: A `precision.DynamicLossScale` for fp16, else None.
        sharded: A `zero.ShardedOptimizer` (`shard_optimizer_state`): the
            gradients are reduce-scattered, each worker updates its shard
            and the weights are gathered (`zero.py`); None: all-reduce and
            `optimizer.apply`.

    `run` is the one entry point of the training loop: it owns the choice
    between several steps per call and the part-by-part step, and the host
    waits of the latter.
    """

    def __init__(self, *, model, optimizer, loss_fn: Callable,
                 metrics: Sequence[keras.metrics.Metric], strategy,
                 collectives, config: TrainConfig, feed: Callable,
                 loss_scale=None, sharded=None):
        self._model = model
        self._optimizer = optimizer
        self._loss_fn = unreduced(loss_fn)
        self._metrics = list(metrics)
        self._metric_variables = metric_variables(metrics, collectives)
        self._strategy = strategy
        self._collectives = collectives
        self._config = config
        # Which steps each call runs (no TensorFlow in it).
        self.plan = StepPlan(config)
        self._feed = feed
        self._loss_scale = loss_scale
        self._sharded = sharded
        self._split_steps = 0
        self._variables = model.trainable_variables
        self._set_up_noise(config, optimizer, collectives)
        jit = config.jit_compile
        compiled = jit or config.compile_update  # no matmul in them
        self.jit_update = (compiled
                           and len(strategy.extended.worker_devices) == 1)
        self._sharded_sync = (
            ShardedSync(sharded, collectives, self.noise_groups,
                        self._metric_variables, measures_noise=(
                            self.measures_noise), loss_scale=loss_scale,
                        clip_global_norm=config.clip_global_norm,
                        compiled=compiled)
            if sharded is not None else None)
        self._micro_batch = tf.function(self._micro_batch_fn, jit_compile=jit)
        self._after_reduce = tf.function(self._after_reduce_fn,
                                         jit_compile=compiled)
        self._update = tf.function(
            self._update_fn,
            jit_compile=self.jit_update and sharded is None)
        self.execute = tf.function(self._execute)
        self.compute = tf.function(self._compute)
        self.sync = tf.function(self._sync)
        self.apply = tf.function(self._apply)
        # Values this object copied from the device to Python (each a wait
        # for the device): the loop's cost that does not show in a profile.
        self.host_reads = 0

    def _set_up_noise(self, config: TrainConfig, optimizer,
                      collectives) -> None:
        """What the gradient noise scale needs: two batch sizes in a step,
        so at least two micro-batches (replicas x accumulation steps); its
        groups, the row that carries its numbers, its preconditioner."""
        noise = config.noise_scale
        self.micro_batches_per_step = (collectives.num_replicas
                                       * config.num_accumulation_steps)
        self.measures_noise = (noise.enabled
                               and self.micro_batches_per_step >= 2)
        self.noise_groups = noise_norms.assign_groups(self._variables, noise)
        # The row each step returns (`step_row.py`).
        self.row = RowLayout(len(self.noise_groups.names)
                             if self.measures_noise else 0)
        self._preconditioner = (
            noise_norms.Preconditioner(optimizer, self._variables)
            if self.measures_noise and noise.mode == "preconditioned"
            else None)
        # Compiled under op determinism (--deterministic): TensorFlow's CPU
        # reductions of a large tensor split their sums by the intra-op
        # thread count (an embedding's squared norm differs in the last
        # bits at 1 and 8 threads), XLA's do not; so the noise scale (and
        # AdaScale's rate) is the same on workers with other thread counts
        # (a bare mpirun binds a rank to one core). It costs about 5% of a
        # CPU step (BERT-tiny, 30,522-token vocabulary), so only there.
        norms = lambda grads, factors: noise_norms.squared_norms(  # noqa: E731
            grads, self.noise_groups, factors)
        self._squared_norms = (
            tf.function(norms, jit_compile=True)
            if _compat.op_determinism_enabled() and not config.jit_compile
            else norms)

    # ---- per replica -----------------------------------------------------

    def _micro_batch_fn(self, batch, sums, factors):
        """Forward and backward over one micro-batch; its metrics updated;
        (loss, gradients, noise norms) added to `sums` (None: the first)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        scale = (tf.cast(self._loss_scale.scale, tf.float32)
                 if self._loss_scale is not None else None)
        with tf.GradientTape() as tape:
            y_pred = self._model(x, training=True)
            losses = self._loss_fn(y, y_pred, sample_weight)
            loss = tf.reduce_sum(losses) / self._config.global_batch_size
            if self._model.losses:
                # Regularization is counted once per optimizer step in total.
                loss += tf.add_n([tf.cast(l, tf.float32)
                                  for l in self._model.losses]
                                 ) / self.micro_batches_per_step
            scaled = loss * scale if scale is not None else loss
        grads = tape.gradient(scaled, self._variables)
        # Dense gradients: embedding lookups give IndexedSlices, which can
        # neither be summed over micro-batches nor packed into one all-reduce
        # with the rest (an all-gather each). BERT's recipe densifies too.
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(grads, self._variables)]
        for metric in self._metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
        norms = tf.zeros([0])
        if self.measures_noise:
            # This micro-batch's squared gradient norm per group, before it
            # joins the sum (noise_scale.py), without the loss scale.
            norms = self._squared_norms(grads, factors)
            if scale is not None:
                norms = norms / tf.square(scale)
        if sums is not None:
            loss_sum, grad_sum, norm_sum = sums
            loss = loss_sum + loss
            grads = [a + b for a, b in zip(grad_sum, grads)]
            norms = norm_sum + norms
        return loss, grads, norms

    def _replica_compute(self, micro_batches):
        factors = None
        if self._preconditioner is not None:
            factors, _ = self._preconditioner.factors()
        before = [tf.identity(v) for v in self._metric_variables]
        # One compiled function for every micro-batch: with accumulation it
        # adds into sums that start at zero (a second trace would be a
        # second XLA compilation).
        sums = None
        if len(micro_batches) > 1:
            sums = (tf.constant(0.0),
                    [tf.zeros_like(v) for v in self._variables],
                    tf.zeros([len(self.noise_groups.names)
                              if self.measures_noise else 0]))
        for batch in micro_batches:
            sums = self._micro_batch(batch, sums, factors)
        loss_sum, grad_sum, norm_sum = sums
        deltas = [v - b for v, b in zip(self._metric_variables, before)]
        if self.measures_noise:
            # [G squared-norm sums, micro-batch count]: summed over replicas.
            norm_sum = tf.concat(
                [norm_sum, [float(len(micro_batches))]], axis=0)
        return tf.concat([[loss_sum], norm_sum], axis=0), grad_sum, deltas

    def _replica_sync(self, loss, grads, deltas, signals):
        # The loss and the host's flags (stop_training, preemption) ride in
        # the gradients' all-reduce: every worker learns any worker's flags
        # at the same step, with no collective of their own; so do the
        # noise scale's micro-batch norms and count (after the flags).
        # The row's reduced part: [loss, stop, preempt, noise small sums
        # and count] (`step_row.py`).
        control = tf.concat([loss[:1], tf.cast(signals, tf.float32),
                             loss[1:]], axis=0)
        assert control.shape[0] == self.row.reduced_width, control.shape
        if self._sharded_sync is not None:
            return self._sharded_sync.sync(control, grads, deltas)
        # tf.identity gives the values the replica's device: inputs that
        # come from another tf.function carry none, and all_reduce needs it.
        values = ([tf.identity(control)] + [tf.identity(g) for g in grads]
                  + [tf.identity(d) for d in deltas])
        reduced = self._collectives.all_reduce(values)
        add_others(self._metric_variables, deltas, reduced[1 + len(grads):])
        return self._after_reduce(reduced[0], reduced[1:1 + len(grads)])

    def _after_reduce_fn(self, control, grads):
        """Loss-scale removal, the finite check, the noise scale's step
        norms and clipping on the reduced gradients (no collective: compiled
        with XLA on any device when asked)."""
        if self._loss_scale is not None:
            inverse = 1.0 / tf.cast(self._loss_scale.scale, tf.float32)
            grads = [g * tf.cast(inverse, g.dtype) for g in grads]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g))
                                for g in grads])
        if self.measures_noise:
            # The step's gradient per group: after the loss scale, before
            # clipping; then the preconditioner's ready flag.
            factors, ready = (self._preconditioner.factors()
                              if self._preconditioner is not None
                              else (None, tf.constant(1.0)))
            big = noise_norms.squared_norms(grads, self.noise_groups,
                                            factors)
            control = tf.concat([control, big, [ready]], axis=0)
        if self.measures_noise and self._preconditioner is None:
            # The same sums give the global norm (clipping): no second pass.
            norm = tf.sqrt(tf.reduce_sum(big))
        else:
            norm = tf.linalg.global_norm(grads)
        if self._config.clip_global_norm:
            # After the all-reduce: clipping per-replica partial gradients
            # (what Keras's global_clipnorm does, fact 8) is not the same.
            grads, _ = tf.clip_by_global_norm(
                grads, self._config.clip_global_norm, use_norm=norm)
        return control, grads, finite

    def _replica_compute_sync(self, micro_batches, signals):
        loss, grads, deltas = self._replica_compute(micro_batches)
        return self._replica_sync(loss, grads, deltas, signals)

    def _update_fn(self, grads, finite=None):
        if self._sharded is not None:
            self._sharded.apply(grads, finite)
        else:
            self._optimizer.apply(grads, self._variables)

    # ---- cross replica (the compiled entry points) --------------------------

    def _execute(self, iterator, signals, num_steps):
        """Up to `num_steps` whole steps, reading the input from `iterator`.

        Args:
            iterator: This worker's `tf.data` iterator.
            signals: float32 [2]: this worker's (stop, preempt) flags.
            num_steps: int32: the most steps to run; the loop leaves after
                the first step whose reduced flags are raised.

        Returns:
            (rows, metrics): rows [steps run, C], each
            [loss, stop, preempt, noise numbers..., skipped] (the first
            three summed over replicas); metrics: the metric results after
            the last step, packed in one float32 vector.
        """
        def keep_going(i, flags, rows):
            del rows
            return tf.logical_and(i < num_steps, flags <= 0.0)

        def one_step(i, flags, rows):
            del flags
            row = self._one_step(iterator, signals)
            flags = row[RowLayout.STOP] + row[RowLayout.PREEMPT]
            return i + 1, flags, rows.write(i, row)

        rows = tf.TensorArray(tf.float32, size=0, dynamic_size=True,
                              element_shape=[self.row.size])
        _, _, rows = tf.while_loop(keep_going, one_step,
                                   (tf.constant(0), tf.constant(0.0), rows))
        return rows.stack(), self._packed_metrics()

    def _one_step(self, iterator, signals):
        micro_batches = self._feed(iterator,
                                   self._config.num_accumulation_steps)
        control, grads, finite = self._strategy.run(
            self._replica_compute_sync, args=(micro_batches, signals))
        control = self._local(control)
        if self._loss_scale is None:
            self._apply(grads)
            skipped = tf.constant(0.0)
        else:
            # The same decision on every worker: `finite` is computed from
            # the all-reduced gradients. Keras's update is a `merge_call`
            # under a strategy, and TensorFlow refuses a `merge_call` inside
            # a `cond` in a replica function ("merge_call called while
            # defining a new graph", tried under MWMS and Mirrored; Keras's
            # own gradient accumulation fails the same way,
            # keras-team/keras#20582): the `cond` is at this level.
            finite = self._local(finite)
            if self._sharded is not None:
                # Its gather cannot sit in a cond: it keeps the old values
                # itself (`zero.ShardedOptimizer.apply`).
                self._apply(grads, finite)
                self._loss_scale.update(finite)
                return tf.concat(
                    [control, [1.0 - tf.cast(finite, tf.float32)]], axis=0)

            def update():
                self._apply(grads)
                return tf.constant(0.0)

            skipped = tf.cond(finite, update, lambda: tf.constant(1.0))
            self._loss_scale.update(finite)
        return tf.concat([control, [skipped]], axis=0)

    def _packed_metrics(self):
        values = self.metric_results()
        return tf.stack([tf.cast(tf.reshape(v, []), tf.float32)
                         for v in values.values()] or
                        [tf.constant(0.0)])

    def _compute(self, micro_batches):
        return self._strategy.run(self._replica_compute, args=(micro_batches,))

    def _sync(self, loss, grads, deltas, signals):
        return self._strategy.run(self._replica_sync,
                                  args=(loss, grads, deltas, signals))

    def _apply(self, grads, finite=None):
        self._strategy.run(self._update, args=(grads, finite))

    def metric_results(self):
        """{name: value} of every metric (read in the same dispatch)."""
        results = {}
        for metric in self._metrics:
            value = metric.result()
            if isinstance(value, dict):
                results.update(value)
            else:
                results[metric.name] = value
        return results

    # ---- the host side ------------------------------------------------------

    def run(self, step: int, num_steps: int, iterator, signals, timer
            ) -> StepsResult:
        """Runs optimizer steps `step` .. `step + num_steps - 1` (1-based;
        fewer if a flag is raised), from `plan.steps_in_call`.

        Args:
            step: The first step's number.
            num_steps: From `plan.steps_in_call(step, ...)`.
            iterator: This worker's input iterator.
            signals: This worker's [stop, preempt] flags (0.0 / 1.0).
            timer: A `timing.StepTimer`.

        Raises:
            InputPipelineError: Reading the input failed.
        """
        signals = tf.constant(signals, tf.float32)
        if not self.plan.is_timed(step):
            timer.start()
            try:
                rows, metrics = self.execute(iterator, signals,
                                             tf.constant(num_steps))
            except tf.errors.OpError as e:
                if is_input_error(e):
                    raise input_error(e) from e
                raise
            rows = self._read(rows)
            metrics = dict(zip(self.metric_results_names(),
                               self._read(metrics).tolist()))
            timer.stop(timed=False, steps=len(rows))
            return self.row.result(rows, metrics)
        timer.start()
        micro_batches = self._feed(iterator,
                                   self._config.num_accumulation_steps)
        timer.mark("input_wait")
        loss, grads, deltas = self.compute(micro_batches)
        self._read(self._local(loss))  # wait for the backward pass
        timer.mark("compute")
        control, grads, finite = self.sync(loss, grads, deltas, signals)
        control = self._read(self._local(control))
        finite = bool(self._read(self._local(finite)))
        timer.mark("sync")
        if finite or self._loss_scale is None:
            self.apply(grads)
            self._read(self._optimizer.iterations)  # wait for the update
        if self._loss_scale is not None:
            self._loss_scale.update(finite)
        timer.mark("update")
        # The very first part-by-part step traces the functions: not counted.
        timer.stop(timed=self._split_steps > 0)
        self._split_steps += 1
        skipped = float(not finite and self._loss_scale is not None)
        metrics = {k: float(self._read(v))
                   for k, v in self.metric_results().items()}
        return self.row.result([list(control) + [skipped]], metrics)

    def metric_results_names(self) -> list:
        """The names of `metric_results()`, in its order."""
        if not hasattr(self, "_metric_names"):
            self._metric_names = list(self.metric_results())
        return self._metric_names

    def _read(self, value):
        """The value in Python (a wait for the device)."""
        self.host_reads += 1
        return value.numpy()

    def _local(self, value):
        return self._strategy.experimental_local_results(value)[0]
