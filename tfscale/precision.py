"""Numeric precision: the global Keras dtype policy and fp16 loss scaling.

The global precision policy is set here and nowhere else. float16 needs
dynamic loss scaling (small gradients underflow in half precision); bfloat16
has float32's exponent range and needs none.
"""

import keras
import tensorflow as tf

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")


def set_precision(precision: str) -> None:
    """Sets Keras's global dtype policy. Call before building the model.

    Raises:
        ValueError: `precision` is not one of PRECISIONS.
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {PRECISIONS}, got {precision!r}")
    keras.mixed_precision.set_global_policy(precision)


def needs_loss_scaling(precision: str) -> bool:
    return precision == "mixed_float16"


# fp16's first loss scale unless a TrainConfig says otherwise.
INITIAL_LOSS_SCALE = 2.0**15


def unwrap_loss_scaling(model, optimizer):
    """(the optimizer to update with, whether the loss needs scaling). A
    `keras.optimizers.LossScaleOptimizer` (what `compile` makes under a
    mixed_float16 policy) gives its inner optimizer: the Trainer scales the
    loss itself, after the all-reduce. Loss scaling follows the model's
    dtype policy (or such a wrapper), whatever built it."""
    inner = getattr(optimizer, "inner_optimizer", None)
    scaled = needs_loss_scaling(model.dtype_policy.name) or inner is not None
    return (inner if inner is not None else optimizer), scaled


def loss_scale(initial_scale=None, dynamic: bool = True
               ) -> "DynamicLossScale":
    """fp16's loss scale (`TrainConfig.initial_loss_scale`,
    `dynamic_loss_scale`): not dynamic, a fixed scale that neither grows
    nor falls. Create it under the strategy's scope."""
    initial = initial_scale or INITIAL_LOSS_SCALE
    if dynamic:
        return DynamicLossScale(initial_scale=initial)
    return DynamicLossScale(initial_scale=initial, growth_steps=2**62,
                            min_scale=initial)


class DynamicLossScale(tf.Module):
    """Dynamic loss scaling as in Micikevicius et al. (2018).

    The loss is multiplied by `scale` before the backward pass and the
    gradients divided by it after the all-reduce. A step whose reduced
    gradients are not all finite is skipped and the scale halved; after
    `growth_steps` finite steps in a row it doubles. The decision is made on
    all-reduced gradients, so every worker makes the same one.

    Build it under `strategy.scope()` so its state is checkpointed with the
    model and restored on resume.
    """

    def __init__(self, initial_scale: float = INITIAL_LOSS_SCALE,
                 growth_steps: int = 2000,
                 min_scale: float = 1.0):
        super().__init__(name="dynamic_loss_scale")
        if initial_scale < 1 or growth_steps < 1:
            raise ValueError("initial_scale must be >= 1 and growth_steps >= 1")
        self.scale = tf.Variable(float(initial_scale), trainable=False,
                                 dtype=tf.float32, name="scale")
        self.good_steps = tf.Variable(0, trainable=False, dtype=tf.int64,
                                      name="good_steps")
        self.growth_steps = growth_steps
        self.min_scale = float(min_scale)

    def update(self, finite) -> None:
        """Adjusts the scale after a step: eagerly on the host, or inside a
        compiled step (`finite` a boolean tensor); the same arithmetic."""
        finite = tf.convert_to_tensor(finite, tf.bool)
        grow = tf.logical_and(finite,
                              self.good_steps + 1 >= self.growth_steps)
        scale = self.scale.read_value()
        self.scale.assign(tf.where(
            finite, tf.where(grow, scale * 2.0, scale),
            tf.maximum(self.min_scale, scale / 2.0)))
        self.good_steps.assign(tf.where(
            tf.logical_and(finite, tf.logical_not(grow)),
            self.good_steps + 1, tf.constant(0, tf.int64)))
