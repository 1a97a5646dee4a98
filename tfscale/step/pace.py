"""How many steps the next call of the compiled step runs: bounded in steps
by the plan (`plan.py`) and in wall time here, so that a signal is acted on
within seconds at any `steps_per_execution`.

A call of n steps runs on the device with no host read between its steps,
which is what makes long calls fast; the price is that the host learns of
nothing (a SIGTERM, `model.stop_training`) until the call ends. With 1,000
steps per call (Google's `iterations_per_loop` default) and BERT-base's 67
ms step on an H200 that was up to 67 s between a scheduler's SIGTERM and the
checkpoint, past Kubernetes' 30 s grace. So a call also ends after about
`TrainConfig.max_call_seconds`: its step count is sized from the measured
step time, decided on the host before the call, never read back from the
device inside it.

The workers' calls must cover the same steps (each step's all-reduce
pairs with the same step's on every peer), so the size is agreed, at no
extra collective: the chief's proposal (its measured pace: whole steps
that fit in the bound) rides in each step's all-reduce beside the stop and
preempt flags (`row.py`; the other workers send 0), and every worker reads
the same reduced number when its call ends and sizes the call after the
next from it. The proposal is a small whole number, so its sum is exact in
float32 on every backend. Until a proposal has come back, calls run one
step (the first call also traces and compiles); after that a proposal is
at most twice the measured call's steps, so calls grow to the bound over a
few calls: a short call can measure a step too fast (its input was
prefetched while the host was away), a longer one less so.

The worst case from a signal to its checkpoint, with t the step time and S
the save: the call in flight (about max(bound, t) once the pace is measured;
sized two calls earlier, so a step that slows down suddenly overruns it
once, and up to twice the bound while calls grow), one step that carries
the flag to every worker (none with one worker), S.
No TensorFlow in this file.
"""

import math
from typing import Optional

# The most steps one proposal names: the reduced sum (proposal x the
# chief's local replicas) stays an exact float32 integer.
MOST_STEPS = 1 << 20


class CallPace:
    """The wall-time bound on a call's steps, agreed across workers.

    Args:
        max_seconds: The bound on a call's wall time; None or 0: no bound
            (a call runs what the plan allows).
        local_replicas: The replicas of each worker (the chief's proposal is
            summed over its own).
        is_chief: Whether this worker proposes.
    """

    def __init__(self, max_seconds: Optional[float], *, local_replicas: int,
                 is_chief: bool):
        self._max_seconds = max_seconds or 0.0
        self._local_replicas = max(1, local_replicas)
        self._is_chief = is_chief
        self._seconds_per_step = None  # this worker's latest measurement
        self._measured_steps = 0  # the steps of the call it measured
        self._agreed = 0  # steps; 0 until a proposal came back

    @property
    def bounded(self) -> bool:
        return self._max_seconds > 0

    @property
    def agreed_steps(self) -> int:
        """The steps per call the workers agreed on last (0: none yet)."""
        return self._agreed

    def proposal(self) -> float:
        """What this worker sends in the next call's rows: the whole steps
        its latest measured step time fits in the bound (at least 1, at
        most twice the measured call's); 0 from a worker that is not the
        chief, before any measurement, or without a bound."""
        if not (self.bounded and self._is_chief and self._seconds_per_step):
            return 0.0
        steps = math.floor(self._max_seconds / self._seconds_per_step)
        steps = min(steps, 2 * self._measured_steps, MOST_STEPS)
        return float(max(1, steps))

    def observe(self, steps: int, seconds: float) -> None:
        """A call of `steps` steps took `seconds` on this worker's clock
        (calls run whole, not part by part)."""
        if steps > 0 and seconds > 0:
            self._seconds_per_step = seconds / steps
            self._measured_steps = steps

    def agree(self, reduced: float) -> None:
        """The reduced proposal a call's rows carried (the same number on
        every worker): the steps the calls after the next may run."""
        self._agreed = int(round(reduced)) // self._local_replicas

    def steps(self, planned: int) -> int:
        """The next call's steps: `planned` (`StepPlan.steps_in_call`),
        bounded by the agreed pace (1 until one is agreed)."""
        if not self.bounded:
            return planned
        return max(1, min(planned, self._agreed or 1))
