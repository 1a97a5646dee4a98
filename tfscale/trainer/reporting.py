"""What one log interval of training reports, where it goes, and its line.

The Trainer adds each call of the compiled step (`IntervalReport.add`) and,
every `log_steps` and at an epoch's end, closes the interval
(`IntervalReport.close`): throughput and the time split (from the
`StepTimer`), the mean loss, the learning rate, fp16's loss scale and
skipped steps, the gradient noise scale and AdaScale's gain.

The numbers are not put in the callbacks' logs: those hold what Keras's
`fit` puts there (the loss and the metrics), so a `CSVLogger` or a
`History` reads as it would after `model.fit`. They go to the Trainer's
`intervals` (summary.json's; on the chief of several workers with
`workers`, each worker's split: `peers.py`), to every Keras `TensorBoard`
callback of the fit as scalars (`batch_<name>` and
`batch_worker<i>/<phase>` at the interval's last step, unless it writes
per epoch only), and to callbacks that ask for them with an
`on_interval_end(step, numbers)` method (the jobs' `IntervalHistory`, the
DLLogger). The line goes to the chief's console at verbose 2.
"""

from typing import Tuple

import keras
import tensorflow as tf

from tfscale.keras import callbacks as _compat_callbacks
from tfscale.trainer.peers import StallWatch
from tfscale.trainer.timing import StepTimer


class IntervalReport:
    """Sums over a log interval; reset when it closes.

    Args:
        timer: The Trainer's `StepTimer` (the step records into it).
        optimizer: Its learning rate is reported.
        loss_scale: fp16's `DynamicLossScale`, or None.
        noise_scale: The `NoiseScale`, or None when not measured.
        adascale: The AdaScale schedule, or None.
    """

    def __init__(self, timer: StepTimer, *, optimizer=None, loss_scale=None,
                 noise_scale=None, adascale=None, peers=None):
        self.timer = timer
        self._peers = peers  # a `peers.PeerIntervals`, or None
        self._stall = StallWatch()
        self.notices = []  # the last close's straggler and stall lines
        self._optimizer = optimizer
        self._loss_scale = loss_scale
        self._noise_scale = noise_scale
        self._adascale = adascale
        self.reset()

        self.rows = []  # every closed interval's numbers (`intervals`)
        self._fits_first = True

    def reset(self) -> None:
        self.timer.reset()
        self._loss, self._steps, self._skipped = 0.0, 0, 0

    def start_fit(self) -> None:
        """A `fit` begins: its first interval holds tracing and
        compilation (marked `first`)."""
        self.reset()
        self._fits_first = True

    def add(self, result) -> None:
        """A call's steps (a `step.StepsResult`)."""
        self._loss += sum(result.losses)
        self._steps += result.steps
        self._skipped += result.skipped

    def close(self, step: int, callbacks=()) -> str:
        """Ends the interval at `step`: its numbers kept (`rows`) and handed
        to `callbacks` (see the module docstring); returns its line."""
        summary, line = self._numbers(step)
        summary.update(step=step, first=self._fits_first)
        if self._optimizer is not None:
            summary["learning_rate"] = float(keras.ops.convert_to_numpy(
                self._optimizer.learning_rate))
        self._fits_first = False
        self.notices = self._notices(summary, step)
        self.rows.append(summary)
        report(callbacks, step, summary)
        return line

    def _notices(self, summary: dict, step: int) -> list:
        """Every worker's numbers into `summary["workers"]` (on the chief:
        `peers.py`) and the lines they call for: a straggler, a stall."""
        notices = []
        workers = self._peers.gather(summary) if self._peers else None
        if workers is not None:
            summary["workers"] = workers
            notices += self._peers.stragglers(workers, step,
                                              summary["first"])
        stall = self._stall.check(summary, step)
        return notices + ([stall] if stall else [])

    def _numbers(self, step: int) -> Tuple[dict, str]:
        """(the interval's numbers, its log line), and a new interval."""
        summary = self.timer.summary()
        summary["interval_loss"] = self._loss / max(self._steps, 1)
        summary["steps"] = self._steps
        extra = self._loss_scale_part(summary) + self._noise_part(summary)
        self.reset()
        line = (f"step {step}: loss {summary['interval_loss']:.4f}, "
                f"{summary['examples_per_second']:.1f} examples/s, "
                f"step {1000 * summary['step_time']:.1f} ms")
        if summary["timed_steps"]:
            line += (f"; timed steps {1000 * summary['timed_step_time']:.1f} "
                     f"ms (input {1000 * summary['input_wait']:.1f}, "
                     f"compute {1000 * summary['compute']:.1f}, "
                     f"sync {1000 * summary['sync']:.1f}, "
                     f"update {1000 * summary['update']:.1f})")
        return summary, line + extra

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



def report(callbacks, step: int, numbers: dict) -> None:
    """An interval's numbers to the callbacks that take them: Keras's
    `TensorBoard` (scalars in its train writer) and any with an
    `on_interval_end(step, numbers)` method."""
    scalars = {k: float(v) for k, v in numbers.items()
               if k not in ("step", "first", "workers")}
    for index, theirs in numbers.get("workers", {}).items():
        scalars.update({f"worker{index}/{k}": float(v)
                        for k, v in theirs.items()})
    for callback in callbacks:
        if hasattr(callback, "on_interval_end"):
            callback.on_interval_end(step, dict(numbers))
        if (isinstance(callback, keras.callbacks.TensorBoard)
                and callback.update_freq != "epoch"):
            writer = _compat_callbacks.tensorboard_train_writer(callback)
            # Every interval, whatever the callback's update_freq records.
            with writer.as_default(step=step), tf.summary.record_if(True):
                for name, value in scalars.items():
                    tf.summary.scalar(f"batch_{name}", value)
