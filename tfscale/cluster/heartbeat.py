"""A worker's heartbeat: the phase it is in, for its launcher.

A worker alive but stuck (in Python, its input pipeline, a write to a slow
file system) keeps TensorFlow's coordination service content (its
heartbeats come from a C++ thread), and its peers wait in a collective for
the collective timeout (300 s) before failing, naming themselves. Here the
training loop itself says where it is: entering and leaving each call of
the step, at a checkpoint, an evaluation, the restore and the first call
(the compile). Each `beat` rewrites one line of a small file,

    PHASE STEP

(`STEP`: the steps done; the line padded to a fixed width and written
in place), which the launcher reads (`launch/hangs.py`):
the worker furthest behind, silent past its phase's timeout (computed from
the times this run has shown), is named and the job restarted. Without a launcher's folder (`contract.HEARTBEAT_DIR_ENV`)
nothing is written. Standard library only; a write that fails is dropped
(a heartbeat never stops training).
"""

import os
from typing import Optional

# The phases: "call" inside a call of the step, "step" between calls (the
# host's work: callbacks, logs), "epoch_end" the epoch's end callbacks.
PHASES = ("restore", "compile", "call", "step", "checkpoint", "evaluation",
          "epoch_end")


# A heartbeat line is padded to this many bytes and written over the last
# one in place: one `pwrite` on a file kept open (opening, writing and
# closing it took 83 us a beat on this project's CI host, 2026-12-06).
LINE_BYTES = 48


class Heartbeat:
    """Writes this worker's heartbeat to `path` (None: nothing)."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self._fd = None

    def beat(self, phase: str, step: int = 0) -> None:
        """Now in `phase` (one of PHASES), `step` steps done."""
        if self.path is None:
            return
        line = f"{phase} {int(step)}".ljust(LINE_BYTES - 1) + "\n"
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT,
                                   0o644)
            os.pwrite(self._fd, line.encode(), 0)
        except OSError:
            pass


def from_environment() -> Heartbeat:
    """This worker's heartbeat, where its launcher asked for one."""
    from tfscale.cluster.environment import heartbeat_file
    return Heartbeat(heartbeat_file())
