"""What one log interval of training reports, and its log line.

The Trainer adds each call of the compiled step (`IntervalReport.add`) and,
every `log_steps` and at an epoch's end, closes the interval
(`IntervalReport.close`): throughput and the time split (from the
`StepTimer`), the mean loss, fp16's loss scale and skipped steps, the
gradient noise scale and AdaScale's gain. The numbers go to the batch
callbacks' logs; the line to the chief's log at verbose 2.
"""

from typing import Tuple

from tfscale.timing import StepTimer


class IntervalReport:
    """Sums over a log interval; reset when it closes.

    Args:
        timer: The Trainer's `StepTimer` (the step records into it).
        loss_scale: fp16's `DynamicLossScale`, or None.
        noise_scale: The `NoiseScale`, or None when not measured.
        adascale: The AdaScale schedule, or None.
    """

    def __init__(self, timer: StepTimer, *, loss_scale=None,
                 noise_scale=None, adascale=None):
        self.timer = timer
        self._loss_scale = loss_scale
        self._noise_scale = noise_scale
        self._adascale = adascale
        self.reset()

    def reset(self) -> None:
        self.timer.reset()
        self._loss, self._steps, self._skipped = 0.0, 0, 0

    def add(self, result) -> None:
        """A call's steps (a `step.StepsResult`)."""
        self._loss += sum(result.losses)
        self._steps += result.steps
        self._skipped += result.skipped

    def close(self, step: int) -> Tuple[dict, str]:
        """(the interval's numbers, its log line), and a new interval."""
        summary = self.timer.summary()
        summary["interval_loss"] = self._loss / max(self._steps, 1)
        extra = self._loss_scale_part(summary) + self._noise_part(summary)
        self.reset()
        line = (f"step {step}: loss {summary['interval_loss']:.4f}, "
                f"{summary['examples_per_second']:.1f} examples/s, "
                f"step {1000 * summary['step_time']:.1f} ms; timed steps "
                f"{1000 * summary['timed_step_time']:.1f} ms "
                f"(input {1000 * summary['input_wait']:.1f}, "
                f"compute {1000 * summary['compute']:.1f}, "
                f"sync {1000 * summary['sync']:.1f}, "
                f"update {1000 * summary['update']:.1f}){extra}")
        return summary, line

    def _loss_scale_part(self, summary: dict) -> str:
        if self._loss_scale is None:
            return ""
        summary["loss_scale"] = float(self._loss_scale.scale.numpy())
        summary["skipped_steps"] = float(self._skipped)
        return (f"; loss scale {summary['loss_scale']:g}, "
                f"{summary['skipped_steps']:g} step(s) skipped")

    def _noise_part(self, summary: dict) -> str:
        text = ""
        if self._noise_scale is not None:
            summary.update(self._noise_scale.logs())
            text = self._noise_scale.log_text()
        if self._adascale is not None:
            summary["adascale_gain"] = self._adascale.current_gain()
            text += f", AdaScale gain {summary['adascale_gain']:.3g}"
            if (self._noise_scale is not None
                    and not self._noise_scale.estimate().warmed_up):
                text += " (held at 1 while the noise scale warms up)"
        return text

