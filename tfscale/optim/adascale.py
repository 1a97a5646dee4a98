"""AdaScale (Johnson et al. 2020, "AdaScale SGD"): the learning rate that a
batch S times the reference batch can bear, from the gradient noise scale.

A step at S times the batch is worth r steps at the reference batch, with
the gain

    r = (var + sqr) / (var / S + sqr),    1 <= r <= S,

var being the gradient variance at the reference batch (tr(Sigma) / B_ref)
and sqr the squared norm of the true gradient (|G|^2); both come from the
Trainer's gradient noise scale (`tfscale/noise/scale.py`), as fairscale's
AdaScale takes them from its workers' gradients. The gain is 1 until the
noise scale's window has filled (its log line says "warming up"), so the
first window of steps walks the schedule one reference step each, then the
gain follows the estimate. (fairscale starts from gain 1 too, but moves it
from the first step on a bias-corrected EMA of smoothing 1 - S/1000: a
window of 1000/S steps that is still mostly its first steps early on; S
there is workers x accumulation steps.) While the batch is small against
the noise scale (B << B_simple: var dominates), r is about S and the run
takes about 1/S of the reference run's steps; when B >> B_simple, r
saturates and extra examples buy little.

The rate at a step is r times the reference schedule at the run's *progress*
tau (the sum of the gains so far), not at the step: the schedule (warmup,
decay) is laid out in reference-batch steps and AdaScale walks it r steps
at a time. As in the paper, the run ends when tau reaches the reference
run's length, `reference_steps` (`finished()`; the Trainer stops there, on
every worker at the same step: the gains come from all-reduced estimates),
so a decaying schedule ends where it ends at the reference batch, in about
1/r of its steps; the summary gives the steps taken, the mean gain and the
examples seen. A step that fp16's loss scaling skipped applied no update and
does not advance tau. For SGD with or without momentum, as in the paper;
with Adam or LAMB the gain is not derived (their updates are not linear in
the gradient) and the optimizer factory refuses the combination.

Usage (tfscale's optimizer factory builds it from OptimConfig with
`scaling_rule="adascale"`):

    schedule = AdaScale(base_schedule, reference_batch_size=256,
                        global_batch_size=2048, reference_steps=90_000)
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    trainer = Trainer(model=..., optimizer=optimizer, ...)  # drives it
"""

import keras
import tensorflow as tf

from tfscale import _compat
from tfscale.errors import ConfigError


@keras.saving.register_keras_serializable(package="tfscale")
class AdaScale(keras.optimizers.schedules.LearningRateSchedule):
    """The reference schedule, scaled by the gain and walked by progress.

    Args:
        schedule: The rate at the reference batch: a `LearningRateSchedule`
            of the (reference) step, or a number.
        reference_batch_size: The batch `schedule` was tuned at.
        global_batch_size: This run's global batch.
        reference_steps: The reference run's length in its steps (the
            schedule's end); None: no end of its own (the run's step count
            ends it, and a decaying schedule may reach its end rate early).

    The Trainer finds it on the optimizer (`follows_noise_scale`), calls
    `advance` after every step and keeps `variables` in its checkpoints.
    """

    follows_noise_scale = True

    def __init__(self, schedule, reference_batch_size: int,
                 global_batch_size: int, reference_steps=None):
        if reference_batch_size <= 0 or global_batch_size <= 0:
            raise ValueError("AdaScale needs reference_batch_size > 0 and "
                             "global_batch_size > 0")
        if reference_steps is not None and reference_steps <= 0:
            raise ValueError(f"AdaScale needs reference_steps > 0, got "
                             f"{reference_steps}")
        self.reference_steps = reference_steps
        if global_batch_size < reference_batch_size:
            raise ValueError(
                f"AdaScale scales up from the reference batch: global batch "
                f"{global_batch_size} < reference {reference_batch_size}")
        self.schedule = schedule
        self.reference_batch_size = reference_batch_size
        self.global_batch_size = global_batch_size
        self.scale = global_batch_size / reference_batch_size
        with tf.device("/cpu:0"):
            self._gain = tf.Variable(1.0, dtype=tf.float32, trainable=False,
                                     name="adascale_gain")
            self._progress = tf.Variable(0.0, dtype=tf.float32,
                                         trainable=False,
                                         name="adascale_progress")

    @property
    def variables(self) -> dict:
        return {"gain": self._gain, "progress": self._progress}

    def __call__(self, step):
        del step  # the reference schedule runs on progress, not steps
        base = self.schedule
        if callable(base):
            base = base(self._progress)
        return tf.cast(self._gain, tf.float32) * tf.cast(base, tf.float32)

    def gain(self, gradient_squared: float, trace: float) -> float:
        """r for these (smoothed) estimates, in [1, S]."""
        variance = max(trace, 0.0) / self.reference_batch_size
        square = max(gradient_squared, 0.0)
        if variance + square <= 0:
            return 1.0
        value = (variance + square) / (variance / self.scale + square)
        return min(max(value, 1.0), self.scale)

    def advance(self, estimate, skipped: bool = False) -> None:
        """After a step: its gain joins the progress (not when the step was
        skipped: it applied nothing), and the next step's gain follows the
        latest estimate (`noise_scale.Estimate`) once its window has filled;
        1 before (the noise scale is warming up: an average of its first
        few steps is no estimate to scale the rate by)."""
        if not skipped:
            self._progress.assign_add(self._gain)
        self._gain.assign(self.gain(estimate.gradient_squared, estimate.trace)
                          if estimate.warmed_up else 1.0)

    def current_gain(self) -> float:
        return float(self._gain.numpy())

    def progress(self) -> float:
        """Reference-batch steps walked so far."""
        return float(self._progress.numpy())

    def finished(self) -> bool:
        """The progress has reached `reference_steps`."""
        return (self.reference_steps is not None
                and self.progress() >= self.reference_steps)

    def end_line(self, steps: int) -> str:
        """The log line of a run that ends here, after `steps` steps."""
        return (f"AdaScale: progress {self.progress():.1f} reached the "
                f"reference run's {self.reference_steps} steps at step "
                f"{steps}; the run ends here")

    def summary(self, steps: int) -> dict:
        """What summary.json holds after `steps` steps of this run."""
        progress = self.progress()
        return {"steps": steps, "progress": progress,
                "reference_steps": self.reference_steps,
                "mean_gain": progress / steps if steps else None,
                "gain": self.current_gain(),
                "examples": steps * self.global_batch_size,
                "finished": self.finished()}

    def get_config(self):
        schedule = self.schedule
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            schedule = keras.saving.serialize_keras_object(schedule)
        return {"schedule": schedule,
                "reference_batch_size": self.reference_batch_size,
                "global_batch_size": self.global_batch_size,
                "reference_steps": self.reference_steps}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config["schedule"], dict):
            config["schedule"] = keras.saving.deserialize_keras_object(
                config["schedule"])
        return cls(**config)


def find_adascale(optimizer, noise_scale, noise_mode: str,
                  micro_batches_per_step: int):
    """The optimizer's AdaScale schedule, or None. It needs the plain noise
    scale (`noise_scale` None: not measured).

    Raises:
        ConfigError: AdaScale without the plain noise scale.
    """
    adascale = _compat.learning_rate_schedule(optimizer)
    if not getattr(adascale, "follows_noise_scale", False):
        return None
    if noise_scale is None:
        raise ConfigError(
            "scaling_rule", "AdaScale needs the gradient noise scale, "
            "measured with at least 2 micro-batches per step (replicas x"
            f" accumulation steps: {micro_batches_per_step}) and noise_scale"
            " mode 'plain'")
    if noise_mode != "plain":
        raise ConfigError(
            "scaling_rule", "AdaScale needs noise_scale mode 'plain' (its "
            "gain is defined for SGD's gradients)")
    return adascale
