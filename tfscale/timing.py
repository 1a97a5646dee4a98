"""Wall-clock split of training steps: input wait, compute, sync, update.

Measuring the split costs time (each part is its own dispatch followed by a
host wait), so the Trainer times only a few steps per log interval ("timed
steps") and runs the rest as one fused dispatch. The phases are means over
timed steps and add up to `timed_step_time`; `step_time` and examples/s cover
every step of the interval.
"""

import time

import keras

PHASES = ("input_wait", "compute", "sync", "update")


class StepTimer:
    """Accumulates step times over a log interval.

    Args:
        examples_per_step: Global examples per optimizer step.
        clock: A monotonic clock in seconds.
    """

    def __init__(self, examples_per_step: int, clock=time.perf_counter):
        self._examples_per_step = examples_per_step
        self._clock = clock
        self.reset()

    def reset(self):
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._steps = self._timed_steps = 0
        self._elapsed = self._timed_elapsed = 0.0

    def start(self):
        self._current = dict.fromkeys(PHASES, 0.0)
        self._step_start = self._last = self._clock()

    def mark(self, phase: str):
        """Ends `phase` of the current step."""
        now = self._clock()
        self._current[phase] += now - self._last
        self._last = now

    def stop(self, timed: bool, steps: int = 1):
        """Ends the step (or `steps` steps run in one call); its phases count
        only if it was `timed` (one step, run part by part)."""
        elapsed = self._clock() - self._step_start
        self._elapsed += elapsed
        self._steps += steps
        if timed:
            self._timed_elapsed += elapsed
            self._timed_steps += 1
            for phase, seconds in self._current.items():
                self._totals[phase] += seconds

    def summary(self) -> dict:
        """Seconds per step: phases and timed_step_time over timed steps,
        step_time over all steps; examples_per_second over all steps."""
        timed = max(self._timed_steps, 1)
        result = {phase: total / timed for phase, total in self._totals.items()}
        result["timed_step_time"] = self._timed_elapsed / timed
        result["step_time"] = self._elapsed / max(self._steps, 1)
        result["examples_per_second"] = (
            self._examples_per_step * self._steps / self._elapsed
            if self._elapsed > 0 else 0.0)
        return result


class IntervalLog(keras.callbacks.Callback):
    """Keeps the per-interval logs (loss, examples/s, time split) the
    Trainer reports every `log_steps`, as rows of floats."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        if logs and "interval_loss" in logs:
            self.rows.append({k: float(v) for k, v in logs.items()})

    def mean_examples_per_second(self) -> float:
        """Mean over the intervals (0 if none)."""
        rates = [r["examples_per_second"] for r in self.rows]
        return sum(rates) / len(rates) if rates else 0.0
