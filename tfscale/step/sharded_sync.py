"""The sync of a step whose optimizer state is sharded (`zero/optimizer.py`).

In place of the one all-reduce of [loss and flags, *gradients]: a
reduce-scatter of the gradients gives this worker its shard of their sum;
one small all-reduce then carries the loss and flags with the shard's own
sums (non-finite count, squared norms per noise group), from which every
worker removes the loss scale, clips and decides to skip alike. The step
(`step/train_step.py`) then updates the shard and gathers the weights.
"""

import tensorflow as tf

from tfscale.noise import norms as noise_norms
from tfscale.step.losses import add_others


class ShardedSync:
    """The sharded step's sync (see the module docstring).

    Args:
        sharded: The `zero.ShardedOptimizer`.
        collectives: The backend's collectives.
        noise_groups: The step's `noise_norms.Groups`.
        metric_variables: The metric states summed here (MPI), or [].
        measures_noise: Whether the row carries the noise numbers.
        loss_scale: fp16's `precision.DynamicLossScale`, or None.
        clip_global_norm: `TrainConfig.clip_global_norm`.
        compiled: XLA-compile the arithmetic (no collective in it).
    """

    def __init__(self, sharded, collectives, noise_groups, metric_variables,
                 *, measures_noise: bool, loss_scale, clip_global_norm,
                 compiled: bool):
        self._sharded = sharded
        self._collectives = collectives
        self._metric_variables = metric_variables
        self._measures_noise = measures_noise
        self._loss_scale = loss_scale
        self._clip_global_norm = clip_global_norm
        # The noise groups of the shard's pieces.
        self._piece_groups = noise_norms.Groups(
            noise_groups.names,
            tuple(noise_groups.of_variable[p.variable]
                  for p in sharded.layout.pieces))
        self._shard_stats = tf.function(self._shard_stats_fn,
                                        jit_compile=compiled, autograph=False)
        self._after_reduce = tf.function(self._after_reduce_fn,
                                         jit_compile=compiled, autograph=False)

    def sync(self, control, grads, deltas):
        """(the row's reduced part with the reduced gradient's norms, this
        worker's shard of the summed gradients, whether all are finite),
        from a replica's `control` (the row's reduced part, unreduced), its
        gradients and its metric updates."""
        flat = self._sharded.layout.flatten([tf.identity(g) for g in grads])
        shard = self._collectives.reduce_scatter(flat)
        shard, sums = self._shard_stats(shard)
        values = ([tf.identity(tf.concat([control, sums], axis=0))]
                  + [tf.identity(d) for d in deltas])
        reduced = self._collectives.all_reduce(values)
        add_others(self._metric_variables, deltas, reduced[1:])
        return self._after_reduce(reduced[0], shard, control.shape[0])

    def _shard_stats_fn(self, shard):
        """The shard without the loss scale, and its sums: [non-finite
        count, squared norm per noise group (or in all)]."""
        if self._loss_scale is not None:
            inverse = 1.0 / tf.cast(self._loss_scale.scale, tf.float32)
            shard = shard * tf.cast(inverse, shard.dtype)
        bad = tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(shard)),
                                    tf.float32))
        if self._measures_noise:
            norms = noise_norms.squared_norms(
                self._sharded.layout.split(shard), self._piece_groups)
        else:
            norms = tf.reshape(2.0 * tf.nn.l2_loss(shard), [1])
        return shard, tf.concat([[bad], norms], axis=0)

    def _after_reduce_fn(self, reduced, shard, size: int):
        control, bad, norms = (reduced[:size], reduced[size],
                               reduced[size + 1:])
        if self._measures_noise:
            # The step's norms by group, then the (plain) ready flag.
            control = tf.concat([control, norms, [1.0]], axis=0)
        if self._clip_global_norm:
            norm = tf.sqrt(tf.reduce_sum(norms))
            (shard,), _ = tf.clip_by_global_norm(
                [shard], self._clip_global_norm, use_norm=norm)
        return control, shard, tf.equal(bad, 0.0)
