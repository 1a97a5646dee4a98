"""The row a training step returns for each optimizer step, named once.

One float32 vector per step, so that a call of several steps returns its
numbers in one tensor, read by the host once:

    [loss, stop, preempt, pace, noise..., skipped]

- loss: the global batch's loss, summed over replicas in the all-reduce;
- stop, preempt: the workers' flags (`model.stop_training`, SIGTERM),
  summed in the same all-reduce: > 0 when any worker raised one;
- pace: the chief's proposal of steps per call (`pace.py`), summed in the
  same all-reduce (the others send 0): the same number on every worker;
- noise, when the gradient noise scale is measured over G variable groups
  (`noise/scale.py`): G sums of the micro-batches' squared gradient norms
  and the micro-batch count (both summed in the all-reduce), then G squared
  norms of the reduced gradient and the preconditioner's ready flag
  (computed after it); absent otherwise;
- skipped: 1 when fp16's step was skipped for non-finite gradients.

The step (`step/train_step.py`) builds the row in that order as the step goes: the
replica's part ([loss, small sums, count]) joins the flags for the
all-reduce (`RowLayout.reduced_width` floats), the reduced gradient's norms
follow it, the skip decision ends it. The host reads it here (`result`);
the noise scale reads `NoiseNumbers`. No TensorFlow in this file.
"""

import dataclasses
from typing import Optional, Sequence, Tuple

from tfscale.noise.numbers import NoiseNumbers


@dataclasses.dataclass(frozen=True)
class StepsResult:
    """What one call of the step (one or more optimizer steps) reports.

    Attributes:
        losses: Each step's global-batch loss (reduced over all replicas).
        stop, preempt: Whether any worker raised the flag (the last step).
        pace: The reduced pace proposal the call carried (`pace.py`).
        metrics: {name: value} of the metrics after the last step.
        skipped: fp16: steps whose update was skipped (non-finite gradients).
        noise: Per step, its `NoiseNumbers`; empty when not measured.
    """

    losses: tuple
    stop: bool
    preempt: bool
    metrics: dict
    skipped: int = 0
    noise: Tuple[NoiseNumbers, ...] = ()
    pace: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.losses)


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where each number sits in a step's row (see the module docstring).

    Attributes:
        noise_groups: G, the noise scale's groups; 0 when not measured.
    """

    noise_groups: int = 0

    LOSS = 0
    STOP = 1
    PREEMPT = 2
    PACE = 3
    SIGNALS = 3  # the stop and preempt flags, the pace proposal
    _NOISE = 4  # where the noise numbers start

    @property
    def noise_width(self) -> int:
        """G small sums, the count, G big norms, the ready flag."""
        return 2 * self.noise_groups + 2 if self.noise_groups else 0

    @property
    def replica_width(self) -> int:
        """The replica's part: the loss, G small sums and the count."""
        return 1 + (self.noise_groups + 1 if self.noise_groups else 0)

    @property
    def reduced_width(self) -> int:
        """The all-reduced part: the replica's part, the two flags and
        the pace."""
        return self.replica_width + self.SIGNALS

    @property
    def size(self) -> int:
        return self._NOISE + self.noise_width + 1

    @property
    def skipped(self) -> int:
        return self.size - 1

    def noise(self, row: Sequence[float]) -> Optional[NoiseNumbers]:
        """The row's `NoiseNumbers`, or None when not measured."""
        g = self.noise_groups
        if not g:
            return None
        start = self._NOISE
        return NoiseNumbers(
            small_sums=tuple(float(v) for v in row[start:start + g]),
            count=float(row[start + g]),
            big=tuple(float(v) for v in row[start + g + 1:start + 2 * g + 1]),
            ready=float(row[start + 2 * g + 1]))

    def result(self, rows: Sequence[Sequence[float]],
               metrics: dict) -> StepsResult:
        """The `StepsResult` of a call's rows (one per step run)."""
        last = rows[-1]
        noise = (tuple(self.noise(row) for row in rows)
                 if self.noise_groups else ())
        return StepsResult(
            losses=tuple(float(row[self.LOSS]) for row in rows),
            stop=bool(last[self.STOP] > 0),
            preempt=bool(last[self.PREEMPT] > 0), metrics=metrics,
            skipped=int(sum(row[self.skipped] for row in rows)),
            noise=noise, pace=float(last[self.PACE]))
