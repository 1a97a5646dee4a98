"""What one replica computes in a training step, in its replica context.

    compute       forward and backward over the step's k micro-batches,
                  the gradients summed locally and the metrics updated (k
                  > 1: a loop over the stacked micro-batches, so a compiled
                  step holds one forward/backward whatever k is);
    after_reduce  on the all-reduced gradients: loss-scale removal, the
                  finite check, the noise scale's norms and clipping;
    update        the optimizer's update of every variable.

None of these holds a collective, so XLA may compile each; `step/train_step.py`
decides where the compilation sits (around `strategy.run` where a worker
holds one replica, inside it otherwise) and where the all-reduce goes.

Loss scaling across replicas: each replica's loss is the sum of its
per-example losses divided by the *global* batch (per-replica x replicas x
accumulation). Summing gradients over micro-batches and replicas then
yields exactly the gradient of the mean loss over the global batch, which is
why N workers with global batch B match one worker with batch B.
"""

from typing import Callable, Sequence

import keras
import tensorflow as tf

from tfscale import _compat
from tfscale.noise import norms as noise_norms
from tfscale.step.losses import unreduced
from tfscale.step.row import RowLayout
from tfscale.train_config import TrainConfig


class ReplicaStep:
    """One replica's part of a step (see the module docstring).

    Args:
        model: A built Keras 3 model, created under `strategy.scope()`.
        optimizer: Its optimizer (gradient aggregation switched off).
        loss_fn: `keras.losses.Loss` or `fn(y_true, y_pred) -> [batch]`.
        metrics: Keras metrics updated with (y_true, y_pred) per micro-batch.
        metric_variables: The metric states the step sums itself (MPI).
        config: The Trainer's `TrainConfig`.
        num_replicas: Replicas in the job (micro-batches per step are
            `num_replicas x num_accumulation_steps`).
        loss_scale: fp16's `precision.DynamicLossScale`, or None.
        nested_jit: Compile compute (with `config.jit_compile`) and
            after_reduce (with XLA on at all) as functions of their own,
            called inside the replica function: the layout for several
            replicas per worker, where XLA cannot compile around
            `strategy.run`. False: plain Python, compiled by the caller.
    """

    def __init__(self, *, model, optimizer, loss_fn: Callable,
                 metrics: Sequence[keras.metrics.Metric], metric_variables,
                 config: TrainConfig, num_replicas: int, loss_scale=None,
                 nested_jit: bool = False):
        self._model = model
        self._optimizer = optimizer
        self._loss_fn = unreduced(loss_fn)
        self._metrics = list(metrics)
        self.metric_variables = list(metric_variables)
        self._config = config
        self._loss_scale = loss_scale
        self.variables = model.trainable_variables
        self._set_up_noise(config, optimizer, num_replicas)
        compiled = config.jit_compile or config.compile_update
        self._micro_batch = (
            tf.function(self._micro_batch_fn, jit_compile=config.jit_compile,
                        autograph=False)
            if nested_jit else self._micro_batch_fn)
        self.after_reduce = (
            tf.function(self._after_reduce_fn, jit_compile=compiled,
                        autograph=False)
            if nested_jit else self._after_reduce_fn)

    def _set_up_noise(self, config: TrainConfig, optimizer,
                      num_replicas: int) -> None:
        """What the gradient noise scale needs: two batch sizes in a step,
        so at least two micro-batches (replicas x accumulation steps); its
        groups, the row that carries its numbers, its preconditioner."""
        noise = config.noise_scale
        self.micro_batches_per_step = (num_replicas
                                       * config.num_accumulation_steps)
        self.measures_noise = (noise.enabled
                               and self.micro_batches_per_step >= 2)
        self.noise_groups = noise_norms.assign_groups(self.variables, noise)
        # The row each step returns (`step/row.py`).
        self.row = RowLayout(len(self.noise_groups.names)
                             if self.measures_noise else 0)
        self._preconditioner = (
            noise_norms.Preconditioner(optimizer, self.variables)
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
            tf.function(norms, jit_compile=True, autograph=False)
            if _compat.op_determinism_enabled() and not config.jit_compile
            else norms)

    # ---- compute ---------------------------------------------------------

    def compute(self, micro_batches):
        """(the replica's row part [loss, noise sums, count], its gradient
        sums, its metric updates (MPI) ) over `micro_batches`."""
        factors = None
        if self._preconditioner is not None:
            factors, _ = self._preconditioner.factors()
        before = [tf.identity(v) for v in self.metric_variables]
        if len(micro_batches) == 1:
            loss, grads, norms = self._micro_batch(micro_batches[0], factors)
        else:
            loss, grads, norms = self._accumulate(micro_batches, factors)
        deltas = [v - b for v, b in zip(self.metric_variables, before)]
        if self.measures_noise:
            # [G squared-norm sums, micro-batch count]: summed over replicas.
            norms = tf.concat([norms, [float(len(micro_batches))]], axis=0)
        return tf.concat([[loss], norms], axis=0), grads, deltas

    def _accumulate(self, micro_batches, factors):
        """The sums over k micro-batches, in order, from zero: a loop over
        them stacked, so the traced (and compiled) step holds one
        forward/backward however many there are."""
        stacked = tf.nest.map_structure(lambda *parts: tf.stack(parts),
                                        *micro_batches)
        width = len(self.noise_groups.names) if self.measures_noise else 0

        def body(i, loss_sum, grad_sum, norm_sum):
            batch = tf.nest.map_structure(lambda t: t[i], stacked)
            loss, grads, norms = self._micro_batch(batch, factors)
            return (i + 1, loss_sum + loss,
                    [a + b for a, b in zip(grad_sum, grads)],
                    norm_sum + norms)

        _, loss, grads, norms = tf.while_loop(
            lambda i, *_: i < len(micro_batches), body,
            (tf.constant(0), tf.constant(0.0),
             [tf.zeros_like(v) for v in self.variables], tf.zeros([width])))
        return loss, grads, norms

    def _micro_batch_fn(self, batch, factors):
        """(loss, gradients, noise norms) of one micro-batch; its metrics
        updated."""
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
        grads = tape.gradient(scaled, self.variables)
        # Dense gradients: embedding lookups give IndexedSlices, which can
        # neither be summed over micro-batches nor packed into one all-reduce
        # with the rest (an all-gather each). BERT's recipe densifies too.
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(grads, self.variables)]
        for metric in self._metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
        norms = tf.zeros([0])
        if self.measures_noise:
            # This micro-batch's squared gradient norm per group, before it
            # joins the sum (noise/scale.py), without the loss scale.
            norms = self._squared_norms(grads, factors)
            if scale is not None:
                norms = norms / tf.square(scale)
        return loss, grads, norms

    # ---- after the all-reduce --------------------------------------------

    def _after_reduce_fn(self, control, grads):
        """(control with the noise scale's step norms, the gradients
        unscaled and clipped, whether all are finite) from the reduced row
        part and gradients."""
        # The finite check decides fp16's skips; without a loss scale
        # nothing reads it (a pass over every gradient saved).
        finite = tf.constant(True)
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
            # (what Keras's global_clipnorm does) is not the same.
            grads, _ = tf.clip_by_global_norm(
                grads, self._config.clip_global_norm, use_norm=norm)
        return control, grads, finite

    # ---- the update ------------------------------------------------------

    def update(self, grads) -> None:
        """The optimizer's update of every trainable variable."""
        self._optimizer.apply(grads, self.variables)
