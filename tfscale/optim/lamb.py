"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning").

The update, per variable w with gradient g at step t:

    m = beta_1 * m + (1 - beta_1) * g
    v = beta_2 * v + (1 - beta_2) * g**2
    u = (m / (1 - beta_1**t)) / (sqrt(v / (1 - beta_2**t)) + epsilon)
    u = u + weight_decay_rate * w          (unless excluded from decay)
    r = ||w|| / ||u|| if both > 0 else 1    (1 if excluded from adaptation)
    w = w - learning_rate * r * u

Weight decay sits inside the trust ratio, as in the paper, BERT's and NVIDIA's
LAMB. Keras 3's built-in `Lamb` applies decay outside it (docs/facts.md, fact 10),
which is a different optimizer.

Exclusions are regular expressions searched in each variable's *path*
(`encoder/layer_0/attention_layer_norm/gamma`), not its short name, so a
BERT-style `LayerNorm|layer_norm|bias` pattern does what it says.
"""

import re
from typing import Optional, Sequence

import keras
from keras import ops

from tfscale import _compat

DEFAULT_EXCLUDE = ("layer_norm", "LayerNorm", "bias")


def matches_any(path: str, patterns: Sequence[str]) -> bool:
    """True if any regular expression in `patterns` is found in `path`."""
    return any(re.search(p, path) for p in patterns)


@keras.saving.register_keras_serializable(package="tfscale")
class Lamb(keras.optimizers.Optimizer):
    """LAMB with decay inside the trust ratio.

    Args:
        learning_rate: A float or a `LearningRateSchedule`.
        beta_1, beta_2, epsilon: Adam's moment parameters.
        weight_decay_rate: Decoupled L2 decay, added to the update before the
            trust ratio.
        exclude_from_weight_decay: Path patterns of variables with no decay.
        exclude_from_layer_adaptation: Path patterns of variables with trust
            ratio 1. Defaults to `exclude_from_weight_decay`.
        **kwargs: Passed to `keras.optimizers.Optimizer` (name, clipnorm,
            ema, ...). `weight_decay` is refused: use `weight_decay_rate`.
    """

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-6, weight_decay_rate=0.0,
                 exclude_from_weight_decay: Sequence[str] = DEFAULT_EXCLUDE,
                 exclude_from_layer_adaptation: Optional[Sequence[str]] = None,
                 name="lamb", **kwargs):
        if kwargs.get("weight_decay"):
            raise ValueError("Lamb takes weight_decay_rate (inside the trust "
                             "ratio), not weight_decay")
        kwargs.pop("weight_decay", None)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.weight_decay_rate = weight_decay_rate
        self.exclude_from_weight_decay_patterns = tuple(exclude_from_weight_decay)
        self.exclude_from_layer_adaptation_patterns = tuple(
            exclude_from_weight_decay if exclude_from_layer_adaptation is None
            else exclude_from_layer_adaptation)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = self.add_optimizer_variables(
            var_list, ["momentum", "velocity"])
        # Resolved once, by index: inside update_step the TensorFlow backend
        # hands over the raw tf.Variable, which has no Keras path.
        self._decays = [self.weight_decay_rate > 0 and not matches_any(
            v.path, self.exclude_from_weight_decay_patterns) for v in var_list]
        self._adapts = [not matches_any(
            v.path, self.exclude_from_layer_adaptation_patterns)
            for v in var_list]

    def update_step(self, gradient, variable, learning_rate):
        index = _compat.variable_index(self, variable)
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        t = ops.cast(self.iterations + 1, dtype)
        m = self._momentums[index]
        v = self._velocities[index]
        self.assign_add(m, (gradient - m) * (1 - self.beta_1))
        self.assign_add(v, (ops.square(gradient) - v) * (1 - self.beta_2))
        m_hat = m / (1 - ops.power(ops.cast(self.beta_1, dtype), t))
        v_hat = v / (1 - ops.power(ops.cast(self.beta_2, dtype), t))
        update = m_hat / (ops.sqrt(v_hat) + self.epsilon)
        if self._decays[index]:
            update = update + self.weight_decay_rate * variable
        if self._adapts[index]:
            w_norm = ops.sqrt(ops.sum(ops.square(variable)))
            u_norm = ops.sqrt(ops.sum(ops.square(update)))
            ratio = ops.where(ops.logical_and(w_norm > 0, u_norm > 0),
                              w_norm / ops.maximum(u_norm, 1e-30),
                              ops.ones_like(w_norm))
            update = update * ratio
        self.assign_sub(variable, lr * update)

    def get_config(self):
        config = super().get_config()
        config.update(
            beta_1=self.beta_1, beta_2=self.beta_2, epsilon=self.epsilon,
            weight_decay_rate=self.weight_decay_rate,
            exclude_from_weight_decay=list(
                self.exclude_from_weight_decay_patterns),
            exclude_from_layer_adaptation=list(
                self.exclude_from_layer_adaptation_patterns))
        config.pop("weight_decay", None)
        return config
