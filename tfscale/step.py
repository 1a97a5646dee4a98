"""The distributed training step, as three compiled functions.

One optimizer step is three parts:

    compute  per replica: forward and backward over k micro-batches, gradients
             summed locally (XLA-compiled when asked). No communication.
    sync     one all-reduce of [loss and flags, *gradients] across all
             replicas (through the backend's `collectives.py` object), then
             loss-scale removal, a finite check and global-norm clipping.
    apply    the optimizer update with the reduced gradients.

XLA cannot compile collectives on CPU (DESIGN.md fact 2), so only the
per-replica forward/backward is jit-compiled; the all-reduce sits outside it.

`fused` runs the three parts in one compiled function (one dispatch, the
normal step). `compute`, `sync` and `apply` are the same parts as separate
functions, for two uses: timing each part (the Trainer samples a few steps
per log interval this way, since every dispatch and host wait costs time),
and fp16, which skips a step whose reduced gradients are not finite: Keras's
`optimizer.apply` cannot run inside a `cond` under a strategy (fact 7), so the
host decides and simply does not call `apply`.

Loss scaling across replicas: each replica's loss is the sum of its
per-example losses divided by the *global* batch (per-replica x replicas x
accumulation steps). Summing gradients over micro-batches and replicas then
yields exactly the gradient of the mean loss over the global batch, which is
why N workers with global batch B match one worker with batch B.
"""

import copy
import dataclasses
from typing import Callable, Optional, Sequence

import keras
import tensorflow as tf

from tfscale import noise_scale as noise_lib


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the step needs to know.

    Attributes:
        global_batch_size: Examples per optimizer step over all replicas and
            micro-batches.
        num_accumulation_steps: Micro-batches per optimizer step (k).
        jit_compile: XLA-compile the per-replica forward/backward.
        clip_global_norm: Clip the reduced gradients to this global norm.
    """

    global_batch_size: int
    num_accumulation_steps: int = 1
    jit_compile: bool = False
    clip_global_norm: Optional[float] = None
    log_steps: int = 100
    timed_steps_per_log: int = 4
    noise_scale: noise_lib.NoiseScaleConfig = noise_lib.NoiseScaleConfig(
        mode="off")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports to the loop.

    Attributes:
        loss: The global batch's loss (reduced over all replicas).
        stop, preempt: Whether any worker raised the flag for this step.
        metrics: {name: value} of the metrics after this step.
        skipped: fp16: the update was skipped (non-finite gradients).
        noise: The gradient noise scale's numbers for this step
            (`noise_scale.NoiseScale.update`), or None when not measured.
    """

    loss: float
    stop: bool
    preempt: bool
    metrics: dict
    skipped: bool = False
    noise: Optional[tuple] = None


def unreduced(loss_fn) -> Callable:
    """`loss_fn` as `fn(y_true, y_pred, sample_weight) -> [batch]` float32.

    A `keras.losses.Loss` goes through its own `__call__` (its dtype
    conversion of y_true / y_pred, masks and sample weights) with the
    reduction switched off, on a copy: the step divides by the global batch
    itself (Keras's reduction would also divide by the number of replicas).
    Any other callable must return one value per example (or per token:
    extra axes are averaged); sample weights multiply it.
    """
    if isinstance(loss_fn, keras.losses.Loss):
        per_example = copy.copy(loss_fn)
        per_example.reduction = None

        def call(y_true, y_pred, sample_weight):
            return _per_example(per_example(y_true, y_pred,
                                            sample_weight=sample_weight))
        return call

    def call(y_true, y_pred, sample_weight):
        values = _per_example(loss_fn(y_true, y_pred))
        if sample_weight is not None:
            values = values * tf.cast(sample_weight, values.dtype)
        return values
    return call


def _per_example(values):
    values = tf.cast(values, tf.float32)
    # Per-token losses (more axes than the batch) are averaged per example.
    if values.shape.rank and values.shape.rank > 1:
        values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
    return values


class TrainStep:
    """Compiled compute / sync / apply functions for one model.

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
        config: A `StepConfig`.
        loss_scale: A `precision.DynamicLossScale` for fp16, else None.

    `run` is the one entry point of the training loop: it owns the choice
    between the fused step and the part-by-part one, the host waits, and
    the fp16 decision to skip an update.
    """

    def __init__(self, *, model, optimizer, loss_fn: Callable,
                 metrics: Sequence[keras.metrics.Metric], strategy,
                 collectives, config: StepConfig, loss_scale=None):
        self._model = model
        self._optimizer = optimizer
        self._loss_fn = unreduced(loss_fn)
        self._metrics = list(metrics)
        self._metric_variables = _metric_variables(metrics, collectives)
        self._strategy = strategy
        self._collectives = collectives
        self._config = config
        self._loss_scale = loss_scale
        self._split_steps = 0
        self._variables = model.trainable_variables
        # The gradient noise scale needs two batch sizes in a step: at least
        # two micro-batches (replicas x accumulation steps).
        noise = config.noise_scale
        self.micro_batches_per_step = (collectives.num_replicas
                                       * config.num_accumulation_steps)
        self.measures_noise = (noise.enabled
                               and self.micro_batches_per_step >= 2)
        self.noise_groups = noise_lib.assign_groups(self._variables, noise)
        self._preconditioner = (
            noise_lib.Preconditioner(optimizer, self._variables)
            if self.measures_noise and noise.mode == "preconditioned"
            else None)
        self._forward_backward = tf.function(
            self._forward_backward_fn, jit_compile=config.jit_compile)
        self.fused = tf.function(self._fused)
        self.compute = tf.function(self._compute)
        self.sync = tf.function(self._sync)
        self.apply = tf.function(self._apply)

    # ---- per replica -----------------------------------------------------

    def _forward_backward_fn(self, x, y, sample_weight, factors=None):
        scale = (tf.cast(self._loss_scale.scale, tf.float32)
                 if self._loss_scale is not None else None)
        with tf.GradientTape() as tape:
            y_pred = self._model(x, training=True)
            losses = self._loss_fn(y, y_pred, sample_weight)
            loss = tf.reduce_sum(losses) / self._config.global_batch_size
            if self._model.losses:
                # Regularization is counted once per optimizer step in total.
                replicas = (self._collectives.num_replicas *
                            self._config.num_accumulation_steps)
                loss += tf.add_n([tf.cast(l, tf.float32)
                                  for l in self._model.losses]) / replicas
            scaled = loss * scale if scale is not None else loss
        grads = tape.gradient(scaled, self._variables)
        # Dense gradients: embedding lookups give IndexedSlices, which can
        # neither be summed over micro-batches nor packed into one all-reduce
        # with the rest (an all-gather each). BERT's recipe densifies too.
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(grads, self._variables)]
        if not self.measures_noise:
            return loss, grads, y_pred, tf.zeros([0])
        # This micro-batch's squared gradient norm per group, before it joins
        # the sum (noise_scale.py), without the loss scale (squared).
        norms = noise_lib.squared_norms(grads, self.noise_groups, factors)
        if scale is not None:
            norms = norms / tf.square(scale)
        return loss, grads, y_pred, norms

    def _replica_compute(self, micro_batches):
        loss_sum = tf.constant(0.0)
        grad_sum = None
        factors = None
        if self._preconditioner is not None:
            factors, _ = self._preconditioner.factors()
        norm_sum = tf.zeros([len(self.noise_groups.names)
                             if self.measures_noise else 0])
        before = [tf.identity(v) for v in self._metric_variables]
        for batch in micro_batches:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            loss, grads, y_pred, norms = self._forward_backward(
                x, y, sample_weight, factors)
            for metric in self._metrics:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
            loss_sum += loss
            norm_sum += norms
            grad_sum = grads if grad_sum is None else [
                a + b for a, b in zip(grad_sum, grads)]
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
        control = tf.concat([loss[:1], tf.cast(signals, tf.float32),
                             loss[1:]], axis=0)
        # tf.identity gives the values the replica's device: inputs that
        # come from another tf.function carry none, and all_reduce needs it.
        values = ([tf.identity(control)] + [tf.identity(g) for g in grads]
                  + [tf.identity(d) for d in deltas])
        reduced = self._collectives.all_reduce(values)
        control = reduced[0]
        grads = reduced[1:1 + len(grads)]
        _add_others(self._metric_variables, deltas, reduced[1 + len(grads):])
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
            big = noise_lib.squared_norms(grads, self.noise_groups, factors)
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
        return control, grads, finite, norm

    def _replica_apply(self, grads):
        self._optimizer.apply(grads, self._variables)

    def _replica_fused(self, micro_batches, signals):
        loss, grads, deltas = self._replica_compute(micro_batches)
        control, grads, _, _ = self._replica_sync(loss, grads, deltas,
                                                  signals)
        self._replica_apply(grads)
        return control

    # ---- the host side: one optimizer step ------------------------------------

    def is_timed(self, step: int) -> bool:
        """Whether step number `step` (1-based) runs part by part.

        A function of the step number alone, so an interrupted and resumed
        run takes exactly the same path at every step as an uninterrupted one.
        Part by part: a few steps per log interval, to time each part, and
        every fp16 step (the host decides whether to apply).
        """
        if self._loss_scale is not None:
            return True
        config = self._config
        remainder = step % config.log_steps
        return config.timed_steps_per_log > 0 and (
            remainder == 0 or
            remainder > config.log_steps - config.timed_steps_per_log)

    def run(self, step: int, fetch: Callable[[], tuple], signals, timer
            ) -> StepResult:
        """Runs optimizer step number `step` (1-based).

        Args:
            step: The step's number.
            fetch: `fn() -> micro-batches` (the input; timed as input wait).
            signals: This worker's [stop, preempt] flags (0.0 / 1.0).
            timer: A `timing.StepTimer`.
        """
        timed = self.is_timed(step)
        signals = tf.constant(signals, tf.float32)
        timer.start()
        micro_batches = fetch()
        timer.mark("input_wait")
        if not timed:
            control, metrics = self.fused(micro_batches, signals)
            loss, stop, preempt, noise = self._control(control)
            timer.stop(timed=False)
            return StepResult(loss, stop, preempt,
                              {k: float(v) for k, v in metrics.items()},
                              noise=noise)
        loss, grads, deltas = self.compute(micro_batches)
        self._local(loss).numpy()  # wait for the backward pass
        timer.mark("compute")
        control, grads, finite, _ = self.sync(loss, grads, deltas, signals)
        loss, stop, preempt, noise = self._control(control)
        finite = bool(self._local(finite))
        timer.mark("sync")
        if finite or self._loss_scale is None:
            self.apply(grads)
            self._optimizer.iterations.numpy()  # wait for the update
        if self._loss_scale is not None:
            self._loss_scale.update(finite)
        timer.mark("update")
        # The very first part-by-part step traces the functions: not counted.
        timer.stop(timed=self._split_steps > 0)
        self._split_steps += 1
        metrics = {k: float(v) for k, v in self.metric_results().items()}
        return StepResult(loss, stop, preempt, metrics,
                          skipped=not finite and self._loss_scale is not None,
                          noise=noise)

    def _local(self, value):
        return self._strategy.experimental_local_results(value)[0]

    def _control(self, control):
        """[loss, stop, preempt, noise...] (reduced) -> (loss, stop,
        preempt, noise numbers or None)."""
        values = self._local(control).numpy()
        noise = tuple(values[3:].tolist()) if self.measures_noise else None
        return (float(values[0]), bool(values[1] > 0), bool(values[2] > 0),
                noise)

    # ---- cross replica (the compiled entry points) --------------------------

    def _fused(self, micro_batches, signals):
        """One whole step.

        Args:
            micro_batches: Per-replica batches, one per accumulation step.
            signals: float32 [2]: this worker's (stop, preempt) flags.

        Returns:
            (control, metric results); control = [loss, stop, preempt]
            summed over replicas (the flags are > 0 if any worker set them).
        """
        control = self._strategy.run(self._replica_fused,
                                     args=(micro_batches, signals))
        return control, self.metric_results()

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

    def _compute(self, micro_batches):
        return self._strategy.run(self._replica_compute, args=(micro_batches,))

    def _sync(self, loss, grads, deltas, signals):
        return self._strategy.run(self._replica_sync,
                                  args=(loss, grads, deltas, signals))

    def _apply(self, grads):
        self._strategy.run(self._replica_apply, args=(grads,))


def _metric_variables(metrics, collectives) -> list:
    """The metric states the step must sum over processes (MPI backend; a
    strategy's own metric variables aggregate on read)."""
    if not collectives.reduces_metrics:
        return []
    return [v for m in metrics for v in m.variables]


def _add_others(variables, local_deltas, summed_deltas) -> None:
    """Adds the other processes' metric updates: each process then holds the
    global states (every metric state of Keras's metrics is a sum)."""
    for v, mine, total in zip(variables, local_deltas, summed_deltas):
        v.assign_add(total - mine)


class EvalStep:
    """Compiled evaluation step: loss and metrics, all-reduced.

    Returns the summed per-example loss, the example count and the number of
    processes that had a batch, so the mean over a whole (possibly uneven)
    evaluation set is exact. `run_empty` is the same collective for a
    process whose input has ended while others' has not (MPI backend).
    """

    def __init__(self, *, model, loss_fn, metrics, strategy, collectives):
        self._model = model
        self._loss_fn = unreduced(loss_fn)
        self._metrics = list(metrics)
        self._metric_variables = _metric_variables(metrics, collectives)
        self._strategy = strategy
        self._collectives = collectives
        self.run = tf.function(self._run)
        self.run_empty = tf.function(self._run_empty)

    def _replica_step(self, batch):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        before = [tf.identity(v) for v in self._metric_variables]
        y_pred = self._model(x, training=False)
        losses = self._loss_fn(y, y_pred, sample_weight)
        count = tf.cast(tf.shape(losses)[0], tf.float32)
        for metric in self._metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
        deltas = [v - b for v, b in zip(self._metric_variables, before)]
        return self._reduce(tf.reduce_sum(losses), count, 1.0, deltas)

    def _replica_empty(self):
        deltas = [tf.zeros_like(v) for v in self._metric_variables]
        return self._reduce(0.0, 0.0, 0.0, deltas)

    def _reduce(self, total, count, has_batch, deltas):
        values = [tf.stack([tf.cast(total, tf.float32), count,
                            tf.constant(has_batch)])] + deltas
        reduced = self._collectives.all_reduce(values)
        _add_others(self._metric_variables, deltas, reduced[1:])
        return reduced[0]

    def _run(self, batch):
        return self._strategy.run(self._replica_step, args=(batch,))

    def _run_empty(self):
        return self._strategy.run(self._replica_empty)
