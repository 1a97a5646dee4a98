"""DLLogger's JSON-lines log, as NVIDIA's BERT scripts write it, from the
Trainer's log intervals (what NVIDIA's log parsers read).

Each line is `DLLL {json}`: first one METADATA line per metric (unit,
format, goal), then per log interval a LOG line with the step and the
interval's throughput and loss, and at the end of training a LOG line with
an empty step holding the run's throughput and final loss (NVIDIA's
summary line). The format is that of NVIDIA's `dllogger` package
(`JSONStreamBackend`), written here without it (it is not on PyPI).

A resumed run continues the file from its checkpoint's step: the lines of
later steps (logged by the run that was interrupted after its last
checkpoint) and a finished run's summary line are cut away, the METADATA
lines are not written again and `elapsedtime` goes on from the last line
kept, so the file reads as one run's, each step once.
"""

import datetime
import json
import os
from typing import Optional

import keras

# metric -> DLLogger metadata, as NVIDIA's dllogger_class declares them.
METADATA = {
    "avg_loss_step": {"format": ":.4f", "GOAL": "MINIMIZE", "STAGE": "TRAIN"},
    "total_loss": {"format": ":.4f", "GOAL": "MINIMIZE", "STAGE": "TRAIN"},
    "mlm_loss": {"format": ":.4f", "GOAL": "MINIMIZE", "STAGE": "TRAIN"},
    "nsp_loss": {"format": ":.4f", "GOAL": "MINIMIZE", "STAGE": "TRAIN"},
    "throughput_train": {"unit": "seq/s", "format": ":.3f",
                         "GOAL": "MAXIMIZE", "STAGE": "TRAIN"},
}
# Intervals left out of the summary's throughput (compilation, warm-up),
# as NVIDIA's TF2 loop leaves out its first two loops, when there are more.
WARMUP_INTERVALS = 2


class DLLogger(keras.callbacks.Callback):
    """Writes `path` on the worker that holds it (the chief): fresh when
    the run starts at step 0, appended to when it resumes.

    Args:
        path: The JSON-lines file (NVIDIA's --dllog_path).
        step: `fn() -> int`, the run's optimizer step (the Trainer's).
    """

    def __init__(self, path: str, step):
        super().__init__()
        self._path, self._step = path, step
        self._file = None
        self._start = None
        self._rates, self._loss = [], None
        self._metrics = {}

    def on_train_begin(self, logs=None):
        directory = os.path.dirname(os.path.abspath(self._path))
        os.makedirs(directory, exist_ok=True)
        step = self._step()
        kept, elapsed = _kept_lines(self._path, step) if step > 0 else ([], 0)
        self._start = datetime.datetime.now() - datetime.timedelta(
            seconds=elapsed)
        partial = f"{self._path}.partial"
        with open(partial, "w") as f:
            f.writelines(kept)
        os.replace(partial, self._path)  # whole, or the old file untouched
        self._file = open(self._path, "a")
        if not any('"METADATA"' in line for line in kept):
            for metric, metadata in METADATA.items():
                self._write(type="METADATA", metric=metric,
                            metadata=metadata)

    def on_train_batch_end(self, batch, logs=None):
        self._metrics = dict(logs or {})  # BERT's losses, for the interval

    def on_interval_end(self, step, numbers):
        data = {"throughput_train": float(numbers["examples_per_second"]),
                "avg_loss_step": float(numbers["interval_loss"]),
                "learning_rate": float(numbers["learning_rate"])}
        for metric in ("mlm_loss", "nsp_loss"):  # BERT's metrics' names
            if metric in self._metrics:
                data[metric] = float(self._metrics[metric])
        if "loss_scale" in numbers:
            data["loss_scaler"] = int(numbers["loss_scale"])
        self._rates.append(data["throughput_train"])
        self._loss = data["avg_loss_step"]
        self._write(type="LOG", step=int(step), data=data)

    def on_train_end(self, logs=None):
        if self._file is None:
            return
        rates = self._rates
        if len(rates) > WARMUP_INTERVALS:
            rates = rates[WARMUP_INTERVALS:]
        data = {}
        if rates:
            data["throughput_train"] = sum(rates) / len(rates)
        if self._loss is not None:
            data["total_loss"] = self._loss
        self._write(type="LOG", step=[], data=data)
        self._file.close()
        self._file = None

    def _write(self, **record) -> None:
        now = datetime.datetime.now()
        line = {"timestamp": str(now.timestamp()), "datetime": str(now),
                "elapsedtime": str((now - self._start).total_seconds()),
                **record}
        self._file.write(f"DLLL {json.dumps(line)}\n")
        self._file.flush()


def _kept_lines(path: str, step: int):
    """(the lines of `path` a run resumed at `step` keeps, the last kept
    line's `elapsedtime` in seconds): METADATA, and LOG lines of steps up
    to `step`; not a finished run's summary line (`step: []`)."""
    kept, elapsed = [], 0.0
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return kept, elapsed
    for line in lines:
        if not line.startswith("DLLL "):
            continue
        try:
            record = json.loads(line[len("DLLL "):])
        except ValueError:
            continue  # a line cut by a kill: dropped
        at = record.get("step")
        if record.get("type") == "METADATA" or (
                isinstance(at, int) and at <= step):
            kept.append(line if line.endswith("\n") else line + "\n")
            elapsed = float(record.get("elapsedtime", elapsed))
    return kept, elapsed


def read(path: str) -> list:
    """The records of a DLLogger file (for tests and tools)."""
    records = []
    with open(path) as f:
        for line in f:
            if line.startswith("DLLL "):
                records.append(json.loads(line[len("DLLL "):]))
    return records


def make(path: Optional[str], trainer) -> list:
    """[a `DLLogger` for `trainer`'s chief] when `path` is set, else []."""
    if not path or not trainer.is_chief:
        return []
    return [DLLogger(path, lambda: int(trainer.step.numpy()))]
