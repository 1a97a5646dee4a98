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
        """Seconds per step: phases and timed_step_time over timed steps
        (`timed_steps` of them; all 0.0 without one), step_time over all
        steps; examples_per_second over all steps."""
        timed = max(self._timed_steps, 1)
        result = {phase: total / timed for phase, total in self._totals.items()}
        result["timed_step_time"] = self._timed_elapsed / timed
        result["timed_steps"] = self._timed_steps
        result["step_time"] = self._elapsed / max(self._steps, 1)
        result["examples_per_second"] = (
            self._examples_per_step * self._steps / self._elapsed
            if self._elapsed > 0 else 0.0)
        return result


class IntervalHistory(keras.callbacks.Callback):
    """Keeps the Trainer's log intervals of a fit (loss, examples/s, the
    time split: `reporting.py`) as rows of numbers, for summary.json."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_interval_end(self, step, numbers):
        self.rows.append({k: (v if k in ("first", "workers") else float(v))
                          for k, v in numbers.items()})

    def examples_per_second(self) -> dict:
        """{"examples_per_second": over the steady intervals, the first of
        each fit (tracing, compilation) left out when others follow;
        "first_interval_examples_per_second": that first one's}, or {}
        without intervals. Examples over seconds, not a mean of rates."""
        if not self.rows:
            return {}
        steady = [r for r in self.rows if not r["first"]] or self.rows
        seconds = sum(r["steps"] * r["step_time"] for r in steady)
        examples = sum(r["steps"] * r["examples_per_second"] * r["step_time"]
                       for r in steady)
        return {"examples_per_second": examples / seconds if seconds else 0.0,
                "first_interval_examples_per_second":
                    self.rows[0]["examples_per_second"]}
