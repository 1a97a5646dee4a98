"""ZeRO stage 1: each worker keeps the optimizer slots of 1/N of the weights.

With AdamW or LAMB a worker holds 4 bytes of weights, 4 of gradients and 8
of slots (the two moments) per parameter, and every worker holds the same
slots. Sharded (`TrainConfig(shard_optimizer_state=True)`,
`--shard_optimizer_state`), the trainable weights are laid end to end in one
flat vector of P elements, padded to N x S, and worker r owns elements
[r S, (r + 1) S). One step is then:

    reduce-scatter  the summed gradient of its own S elements reaches each
                    worker (MPI `Reduce_scatter_block`; on a strategy, an
                    all-to-all of the N rows and a sum: TensorFlow 2.21's
                    reduce-scatter op has only an NCCL kernel)
    update          each worker updates its S elements with Keras's own
                    formulas (SGD, Adam/AdamW) or LAMB's, holding slots of
                    S elements; LAMB's per-tensor norms are sums over the
                    shards, all-reduced as one vector of 2 numbers a tensor
    all-gather      the new weights of every shard reach every worker,
                    which writes them into the model's variables

The reduce-scatter and the all-gather each move (N - 1) S elements per
worker, what a ring all-reduce of the gradients moves in its two halves:
no more bytes than the plain step. The finite check, the gradient noise
scale's squared norms and the global norm for clipping are sums over the
shards, added to the step's small all-reduce (loss and flags).

The formulas are Keras 3.15's element for element, in the same order, so at
N = 2 (where a sum of two values has one order) SGD and AdamW end
bit-identical to the unsharded run; LAMB's norms are sums in another order
(within 1e-6 relative).

Checkpoints hold the slots whole, under the keys of the unsharded Keras
optimizer (`zero/checkpoint.py`): a sharded run resumes on any worker count,
sharded or not, and an unsharded checkpoint resumes sharded. Saving gathers
the slots (every worker takes part); restoring keeps this worker's slice.
"""

from typing import Optional

import keras
import tensorflow as tf
from keras import ops

from tfscale.cluster import devices
from tfscale import _compat
from tfscale.errors import ConfigError
from tfscale.optim.lamb import Lamb, matches_any
from tfscale.zero.checkpoint import CheckpointView
from tfscale.zero.layout import Layout

# What a worker's update is written for: Keras's SGD, Adam and AdamW, and
# tfscale's LAMB.
SUPPORTED = "keras.optimizers.SGD, Adam, AdamW and tfscale.optim.Lamb"


def optimizer_kind(optimizer) -> str:
    """"sgd", "adam" or "lamb": whose formulas update a shard.

    Raises:
        ConfigError: Another optimizer, or an option the sharded update does
            not have (field "shard_optimizer_state").
    """
    if isinstance(optimizer, Lamb):
        kind = "lamb"
    elif type(optimizer) in (keras.optimizers.Adam, keras.optimizers.AdamW):
        kind = "adam"
    elif type(optimizer) is keras.optimizers.SGD:
        kind = "sgd"
    else:
        raise ConfigError(
            "shard_optimizer_state", f"the sharded update is written for "
            f"{SUPPORTED}, not {type(optimizer).__name__}")
    unsupported = [name for name, on in (
        ("amsgrad", getattr(optimizer, "amsgrad", False)),
        ("use_ema", optimizer.use_ema),
        ("clipnorm", optimizer.clipnorm),
        ("clipvalue", optimizer.clipvalue),
        ("global_clipnorm", optimizer.global_clipnorm),
        ("gradient_accumulation_steps",
         optimizer.gradient_accumulation_steps)) if on]
    if unsupported:
        raise ConfigError(
            "shard_optimizer_state", f"{type(optimizer).__name__} with "
            f"{', '.join(unsupported)} has no sharded update (clip with "
            "TrainConfig.clip_global_norm, accumulate with "
            "num_accumulation_steps)")
    return kind


def slot_names(optimizer, kind: str) -> tuple:
    """The slots Keras keeps per variable, in the order it creates them."""
    if kind == "sgd":
        return ("momentum",) if optimizer.momentum != 0 else ()
    return ("momentum", "velocity")


class ShardedOptimizer:
    """The optimizer update of one worker's shard (see the module
    docstring).

    Args:
        optimizer: The Keras optimizer whose hyperparameters, learning rate
            and `iterations` the update uses; it is never built (its slots
            would be whole).
        variables: The model's trainable variables.
        collectives: The backend's collectives: N = `num_replicas` shards,
            this worker's `worker_index`; `all_reduce`, `all_gather`.
        strategy: The worker's strategy (one replica); the slots live on
            its device.
        jit_compile: XLA-compile the update's arithmetic (no collective).

    Raises:
        ConfigError: An optimizer or option without a sharded update, or
            variables that are not all float32.
    """

    def __init__(self, optimizer, variables, collectives, strategy,
                 jit_compile: bool = False):
        self.kind = optimizer_kind(optimizer)
        self.optimizer = optimizer
        self.variables = list(variables)
        bad = [v.path for v in self.variables if v.dtype != "float32"]
        if bad:
            raise ConfigError(
                "shard_optimizer_state", f"trainable variables must be "
                f"float32 (Keras's mixed precision keeps them so), got "
                f"{bad[0]}")
        if any(getattr(v, "constraint", None) is not None
               for v in self.variables):
            raise ConfigError("shard_optimizer_state", "variables with a "
                              "constraint have no sharded update")
        self._collectives = collectives
        self._strategy = strategy
        device = devices.worker_devices(strategy)[0]
        self.layout = Layout([v.shape for v in self.variables],
                             collectives.num_replicas,
                             collectives.worker_index)
        self.slot_names = slot_names(optimizer, self.kind)
        size = self.layout.shard_size
        with tf.init_scope(), tf.device(device):
            self.slots = {name: tf.Variable(tf.zeros([size]),
                                            trainable=False,
                                            name=f"sharded_{name}")
                          for name in self.slot_names}
        self._decays = [self._decays_variable(v) for v in self.variables]
        self._adapts = [self.kind == "lamb" and not matches_any(
            v.path, optimizer.exclude_from_layer_adaptation_patterns)
            for v in self.variables]
        self._step_fn = tf.function(self._step, jit_compile=jit_compile,
                                    autograph=False)
        self._finish_fn = tf.function(self._finish, jit_compile=jit_compile,
                                      autograph=False)
        self._gather_fn = tf.function(self._gather_all, autograph=False)
        self._gathered = None

    def _decays_variable(self, variable) -> bool:
        if self.kind == "lamb":
            return self.optimizer.weight_decay_rate > 0 and not matches_any(
                variable.path,
                self.optimizer.exclude_from_weight_decay_patterns)
        return (self.optimizer.weight_decay is not None and
                _compat.uses_weight_decay(self.optimizer, variable))

    # ---- sizes ---------------------------------------------------------------

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer slots this worker holds."""
        return 4 * self.layout.shard_size * len(self.slot_names)

    def wire_bytes(self) -> dict:
        """Bytes each worker sends per step for the gradients and weights:
        sharded (all-to-all or reduce-scatter, then all-gather) and what a
        ring all-reduce of the same gradients sends."""
        n, s = self.layout.num_shards, self.layout.shard_size
        return {"sharded": 2 * (n - 1) * s * 4,
                "all_reduce": int(2 * (n - 1) / n * self.layout.total * 4)}

    # ---- the update (in a replica context) -----------------------------------

    def apply(self, grad_shard, finite=None) -> None:
        """Updates this worker's shard with its reduced gradient [S], then
        gathers every shard's new weights into the model's variables.

        `finite` (fp16, a bool tensor the same on every worker): False
        keeps the weights, slots and step count as they were. The update
        runs either way and a select keeps the old values: TensorFlow 2.21
        cannot run the gather's collective inside a `tf.cond` in the
        step's loop (its instance key is fed at call time, and a branch of
        a loop gets none)."""
        before = None
        if finite is not None:
            before = {name: tf.identity(slot)
                      for name, slot in self.slots.items()}
        weights = self._step_fn(grad_shard)
        if self.kind == "lamb":
            weights, partial = weights
            # (One small all-reduce: 2 numbers per variable.)
            norms = self._collectives.all_reduce([partial])[0]
            weights = self._finish_fn(weights, norms)
        if finite is not None:
            old = self.layout.join(self._weight_pieces(None))
            weights = tf.where(finite, weights, old)
            for name, slot in self.slots.items():
                slot.assign(tf.where(finite, slot, before[name]))
        full = self._collectives.all_gather(weights)
        for variable, value in zip(self.variables,
                                   self.layout.unflatten(full)):
            variable.assign(value)
        step = 1 if finite is None else tf.cast(finite, tf.int64)
        self.optimizer.iterations.assign_add(
            tf.cast(step, self.optimizer.iterations.dtype))

    def _weight_pieces(self, learning_rate) -> list:
        """This shard's pieces of the weights; with Keras's decoupled weight
        decay applied (`Optimizer._apply_weight_decay`, before the update)
        unless `learning_rate` is None."""
        pieces = []
        for piece in self.layout.pieces:
            variable = self.variables[piece.variable]
            w = tf.reshape(variable, [-1])[piece.start:piece.stop]
            if (learning_rate is not None and self.kind != "lamb"
                    and self._decays[piece.variable]):
                lr = tf.cast(learning_rate, w.dtype)
                wd = tf.cast(self.optimizer.weight_decay, w.dtype)
                w = w - w * wd * lr
            pieces.append(w)
        return pieces

    def _step(self, gradient):
        learning_rate = self.optimizer.learning_rate
        pieces = self._weight_pieces(learning_rate)
        w = self.layout.join(pieces)
        lr = ops.cast(learning_rate, w.dtype)
        g = ops.cast(gradient, w.dtype)
        if self.kind == "sgd":
            return self._sgd(w, g, lr)
        if self.kind == "adam":
            return self._adam(w, g, lr)
        return self._lamb(pieces, w, g, lr)

    def _sgd(self, w, g, lr):
        # keras.optimizers.SGD.update_step
        opt = self.optimizer
        if opt.momentum == 0:
            return w - ops.multiply(g, lr)
        m = self.slots["momentum"]
        momentum = ops.cast(opt.momentum, w.dtype)
        m.assign(ops.subtract(ops.multiply(m, momentum),
                              ops.multiply(g, lr)))
        if opt.nesterov:
            return w + ops.subtract(ops.multiply(m, momentum),
                                    ops.multiply(g, lr))
        return w + m

    def _adam(self, w, g, lr):
        # keras.optimizers.Adam.update_step (AdamW's decay came first)
        opt = self.optimizer
        m, v = self.slots["momentum"], self.slots["velocity"]
        local_step = ops.cast(opt.iterations + 1, w.dtype)
        beta_1_power = ops.power(ops.cast(opt.beta_1, w.dtype), local_step)
        beta_2_power = ops.power(ops.cast(opt.beta_2, w.dtype), local_step)
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m.assign_add(ops.multiply(ops.subtract(g, m), 1 - opt.beta_1))
        v.assign_add(ops.multiply(ops.subtract(ops.square(g), v),
                                  1 - opt.beta_2))
        return w - ops.divide(ops.multiply(m, alpha),
                              ops.add(ops.sqrt(v), opt.epsilon))

    def _lamb(self, pieces, w, g, lr):
        """LAMB's first half (`Lamb.update_step`): the moments, the update
        u of each piece and [sum w^2, sum u^2] per variable over this shard
        (summed over the shards by `apply`). Returns ((w, u), partial)."""
        opt = self.optimizer
        m, v = self.slots["momentum"], self.slots["velocity"]
        t = ops.cast(opt.iterations + 1, w.dtype)
        m.assign_add((g - m) * (1 - opt.beta_1))
        v.assign_add((ops.square(g) - v) * (1 - opt.beta_2))
        m_hat = m / (1 - ops.power(ops.cast(opt.beta_1, w.dtype), t))
        v_hat = v / (1 - ops.power(ops.cast(opt.beta_2, w.dtype), t))
        update = m_hat / (ops.sqrt(v_hat) + opt.epsilon)
        updates = []
        sums = [tf.zeros([2])] * len(self.variables)
        for piece, weight, u in zip(self.layout.pieces, pieces,
                                    self.layout.split(update)):
            if self._decays[piece.variable]:
                u = u + opt.weight_decay_rate * weight
            updates.append(u)
            sums[piece.variable] = tf.stack([ops.sum(ops.square(weight)),
                                             ops.sum(ops.square(u))])
        return (w, self.layout.join(updates)), tf.stack(sums)

    def _finish(self, weights_and_updates, norms):
        """LAMB's second half: the trust ratio from the summed norms."""
        w, update = weights_and_updates
        lr = ops.cast(self.optimizer.learning_rate, w.dtype)
        new = []
        for piece, weight, u in zip(self.layout.pieces, self.layout.split(w),
                                    self.layout.split(update)):
            if self._adapts[piece.variable]:
                w_norm = ops.sqrt(norms[piece.variable, 0])
                u_norm = ops.sqrt(norms[piece.variable, 1])
                ratio = ops.where(ops.logical_and(w_norm > 0, u_norm > 0),
                                  w_norm / ops.maximum(u_norm, 1e-30),
                                  ops.ones_like(w_norm))
                u = u * ratio
            new.append(weight - lr * u)
        return self.layout.join(new)

    # ---- checkpoints -----------------------------------------------------------

    def gather_slots(self) -> None:
        """Every worker calls it before a save: the slots, whole, held until
        `release_slots` (the checkpoint writes them per variable)."""
        self._gathered = dict(zip(self.slots, self._gather_fn()))

    def release_slots(self) -> None:
        self._gathered = None

    def _gather_all(self):
        def replica_fn():
            return [self._collectives.all_gather(tf.identity(slot))
                    for slot in self.slots.values()]
        values = self._strategy.run(replica_fn)
        return [self._strategy.experimental_local_results(v)[0]
                for v in values]

    def whole_slot(self, name: str, index: int) -> tf.Tensor:
        """Variable `index`'s slot `name`, whole (after `gather_slots`)."""
        if self._gathered is None:
            raise RuntimeError("gather_slots() before saving a sharded "
                               "optimizer")
        offset, size = self.layout.offsets[index], self.layout.sizes[index]
        flat = self._gathered[name][offset:offset + size]
        return tf.reshape(flat, self.layout.shapes[index])

    def restore_slot(self, name: str, index: int, value) -> None:
        """Keeps this worker's part of variable `index`'s slot `name`."""
        expected = self.layout.shapes[index]
        value = tf.convert_to_tensor(value)
        if value.shape.rank is not None and tuple(value.shape) != expected:
            from tfscale.resume.checkpoints import RestoreError
            raise RestoreError(
                f"optimizer slot {name} of {self.variables[index].path} has "
                f"shape {value.shape.as_list()} in the checkpoint but "
                f"{list(expected)} in the model")
        # (Restore ops may give no static shape: checked when run.)
        value = tf.ensure_shape(value, expected)
        flat = tf.reshape(value, [-1])
        for piece in self.layout.pieces:
            if piece.variable == index:
                size = piece.stop - piece.start
                self.slots[name][piece.offset:piece.offset + size].assign(
                    flat[piece.start:piece.stop])

    def checkpoint_view(self):
        """What a checkpoint holds of the optimizer
        (`zero_checkpoint.CheckpointView`)."""
        return CheckpointView(self)


def sharded_optimizer(optimizer, variables, collectives, strategy,
                      jit_compile: bool, noise_mode: str = "plain"
                      ) -> Optional[ShardedOptimizer]:
    """The sharded update for `TrainConfig.shard_optimizer_state`, or None
    with one replica (nothing to shard).

    Raises:
        ConfigError: The preconditioned noise scale (`noise_mode`: it reads
            every variable's second moments), a strategy with several
            replicas per worker (each worker must hold one shard), or an
            unsupported optimizer.
    """
    if noise_mode == "preconditioned":
        raise ConfigError(
            "shard_optimizer_state", "the preconditioned noise scale "
            "reads every variable's second moments, which a sharded "
            "optimizer holds 1/N of: use noise_scale mode 'plain'")
    if collectives.num_replicas == 1:
        return None
    if collectives.num_replicas != collectives.num_workers:
        raise ConfigError(
            "shard_optimizer_state", f"each worker must run one replica "
            f"(here {collectives.num_replicas} replicas on "
            f"{collectives.num_workers} worker(s)): start one process per "
            "device")
    return ShardedOptimizer(optimizer, variables, collectives, strategy,
                            jit_compile=jit_compile)
