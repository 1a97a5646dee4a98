"""Learning-rate schedules with linear warmup, as Keras LearningRateSchedules.

Both are serializable (`get_config`), so a saved optimizer restores them.
"""

import math

import keras
from keras import ops


def _check(peak_learning_rate, warmup_steps, total_steps):
    if peak_learning_rate <= 0:
        raise ValueError(f"peak_learning_rate must be > 0, got {peak_learning_rate}")
    if warmup_steps < 0 or total_steps <= 0 or warmup_steps > total_steps:
        raise ValueError(
            f"need 0 <= warmup_steps <= total_steps and total_steps > 0, got "
            f"warmup_steps={warmup_steps}, total_steps={total_steps}")


def _warmup(step, peak, warmup_steps):
    # Google's optimization.py and Model Garden's WarmUp: the update taken at
    # step t (0-based: optimizer.iterations before it) uses peak * t / W, so
    # the very first update has rate 0 and the peak is reached at t = W.
    return peak * step / max(1.0, float(warmup_steps))


@keras.saving.register_keras_serializable(package="tfscale")
class WarmupPolynomialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """BERT's schedule: linear warmup, then polynomial decay to `end`.

    As in Google's and NVIDIA's `run_pretraining.py`, the decay is measured
    from step 0 over `total_steps` and warmup overrides its first steps, so a
    command line that carries over gives the same rates:

        step < warmup_steps: peak * step / warmup_steps
        otherwise: (peak - end) * (1 - min(step, total) / total)**power + end

    `step` is the optimizer's iteration count when the update is applied
    (0 for the first update), as `global_step` is in Google's code.
    """

    def __init__(self, peak_learning_rate, warmup_steps, total_steps,
                 end_learning_rate=0.0, power=1.0):
        _check(peak_learning_rate, warmup_steps, total_steps)
        self.peak_learning_rate = float(peak_learning_rate)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.end_learning_rate = float(end_learning_rate)
        self.power = float(power)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        frac = ops.minimum(step, float(self.total_steps)) / self.total_steps
        decayed = ((self.peak_learning_rate - self.end_learning_rate) *
                   ops.power(1.0 - frac, self.power) + self.end_learning_rate)
        warm = _warmup(step, self.peak_learning_rate, self.warmup_steps)
        return ops.where(step < self.warmup_steps, warm, decayed)

    def get_config(self):
        return dict(peak_learning_rate=self.peak_learning_rate,
                    warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                    end_learning_rate=self.end_learning_rate, power=self.power)


@keras.saving.register_keras_serializable(package="tfscale")
class WarmupCosineDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup, then half a cosine from peak to `end` by `total_steps`."""

    def __init__(self, peak_learning_rate, warmup_steps, total_steps,
                 end_learning_rate=0.0):
        _check(peak_learning_rate, warmup_steps, total_steps)
        self.peak_learning_rate = float(peak_learning_rate)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.end_learning_rate = float(end_learning_rate)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        span = max(1.0, float(self.total_steps - self.warmup_steps))
        progress = ops.clip((step - self.warmup_steps) / span, 0.0, 1.0)
        cosine = 0.5 * (1.0 + ops.cos(math.pi * progress))
        decayed = (self.end_learning_rate +
                   (self.peak_learning_rate - self.end_learning_rate) * cosine)
        warm = _warmup(step, self.peak_learning_rate, self.warmup_steps)
        return ops.where(step < self.warmup_steps, warm, decayed)

    def get_config(self):
        return dict(peak_learning_rate=self.peak_learning_rate,
                    warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                    end_learning_rate=self.end_learning_rate)
