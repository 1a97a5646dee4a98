"""What every entry point does at its edge, before TensorFlow loads."""

import logging
import os
import sys
from typing import Callable


class _NoTensorFlowInfo(logging.Filter):
    """Drops INFO (and DEBUG) records logged from TensorFlow's own files."""

    def filter(self, record):
        return (record.levelno >= logging.WARNING or
                f"{os.sep}tensorflow{os.sep}" not in record.pathname)


def quiet_tensorflow(verbosity: int):
    """TensorFlow's INFO lines off (one per collective, per checkpoint shard,
    per server start); its warnings and errors, and tfscale's own lines,
    stay. `--verbosity=1` or a TF_CPP_MIN_LOG_LEVEL of one's own brings them
    back. (The few lines TensorFlow prints while loading, before its logging
    is set up, cannot be turned off from Python.)"""
    if verbosity >= 1:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # before TF's import
    for name in ("tensorflow", "absl"):
        logging.getLogger(name).addFilter(_NoTensorFlowInfo())


def run_job(program: str, job: Callable, config) -> None:
    """Runs `job(config)` on this worker: a `JobError` becomes one line on
    stderr and exit 1; preemption prints a line and exits 143 after the
    checkpoint (launchers and schedulers restart the job)."""
    from tfscale.jobs import JobError
    from tfscale.preemption import Preempted
    try:
        job(config)
    except JobError as e:
        sys.exit(f"{program}: error: {e}")
    except Preempted as e:
        print(f"{program}: {e}", file=sys.stderr, flush=True)
        raise
