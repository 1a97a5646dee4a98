"""Wall-clock split of training steps: input wait, compute, sync, update.

The Trainer marks the end of each phase after it has waited for the phase's
result, so on any device the parts add up to the step time.
"""

import time

PHASES = ("input_wait", "compute", "sync", "update")


class StepTimer:
    """Accumulates per-phase time over a log interval.

    Args:
        examples_per_step: Global examples per optimizer step.
    """

    def __init__(self, examples_per_step: int, clock=time.perf_counter):
        self._examples_per_step = examples_per_step
        self._clock = clock
        self.reset()

    def reset(self):
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._steps = 0
        self._elapsed = 0.0

    def start(self):
        self._step_start = self._last = self._clock()

    def mark(self, phase: str):
        now = self._clock()
        self._totals[phase] += now - self._last
        self._last = now

    def stop(self):
        self._elapsed += self._clock() - self._step_start
        self._steps += 1

    def summary(self) -> dict:
        """Mean seconds per step for each phase, step_time, examples/s."""
        steps = max(self._steps, 1)
        result = {phase: total / steps for phase, total in self._totals.items()}
        result["step_time"] = self._elapsed / steps
        result["examples_per_second"] = (
            self._examples_per_step * self._steps / self._elapsed
            if self._elapsed > 0 else 0.0)
        return result
