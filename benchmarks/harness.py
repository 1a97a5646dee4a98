"""Start a job, read what it said: the benchmarks' one harness.

    job = Job("w1", command, out_dir, env={...}).start()
    job.wait(timeout)                 # exit code, or "timeout" (killed)
    job.intervals()                   # {step: (loss, examples/s, step ms)}
    job.placement()                   # the banner's placement line
    job.signal_worker(1, SIGTERM)     # a worker of a launch.local job
    weights(run_dir), compare(a, b)   # the latest checkpoint's model weights

A job is a subprocess whose output goes to `<out_dir>/<name>.log`; what it
printed is read back from there (the interval lines of the Trainer's log,
the start banner's lines, the launcher's).
"""

import os
import re
import subprocess
import time
from typing import Optional

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERVAL = re.compile(r"step (\d+): loss ([\d.naninf]+), ([\d.]+) examples/s, "
                      r"step ([\d.]+) ms")
PLACEMENT = re.compile(r"placement: (.*)$", re.M)


class Job:
    """One job (a command line) and its log."""

    def __init__(self, name: str, command, out_dir: str, env=None):
        self.name = name
        self.command = [str(c) for c in command]
        self.log = os.path.join(out_dir, f"{name}.log")
        self.env = dict(os.environ, **(env or {}))
        self.env["PYTHONPATH"] = REPO + os.pathsep + self.env.get(
            "PYTHONPATH", "")
        self.proc = None
        self.started = None
        self.seconds = None
        self.code = None

    def start(self) -> "Job":
        self._file = open(self.log, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.command, cwd=REPO, env=self.env,
                                     stdout=self._file,
                                     stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait(self, timeout: float):
        """The exit code, or "timeout" (the job's process group killed)."""
        try:
            self.code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.code = "timeout"
        self.seconds = time.monotonic() - self.started
        self._file.close()
        return self.code

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def intervals(self) -> dict:
        """{step: (loss, examples/s, step ms)} of the interval lines."""
        return {int(m[0]): (float(m[1]), float(m[2]), float(m[3]))
                for m in INTERVAL.findall(self.text())}

    def placement(self) -> Optional[str]:
        """The start banner's placement line (the chief's), or None."""
        found = PLACEMENT.findall(self.text())
        return found[0].strip() if found else None

    def worker_pids(self) -> dict:
        """{worker index: pid} of this job's workers (launch.local's
        TFSCALE_WORKER_INDEX, mpirun's OMPI_COMM_WORLD_RANK)."""
        found = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0")
                               if b"=" in v)
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read()
            except (OSError, ValueError):
                continue
            if b"launch.local" in command or b"launch.gpus" in command:
                continue
            index = env.get(b"TFSCALE_WORKER_INDEX",
                            env.get(b"OMPI_COMM_WORLD_RANK"))
            if (index is not None and b"python" in command and self.proc
                    and _descends_from(int(pid), self.proc.pid)):
                found.setdefault(int(index), int(pid))
        return found

    def signal_worker(self, index: int, sig) -> bool:
        pid = self.worker_pids().get(index)
        if pid is None:
            return False
        os.kill(pid, sig)
        return True


def _descends_from(pid: int, root: int, depth: int = 4) -> bool:
    """Whether `root` is `pid`'s parent, grandparent, ... (`depth` up)."""
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == root:
            return True
    return False


def weights(run_dir: str) -> dict:
    """The model's weights in `run_dir`'s latest checkpoint."""
    import tensorflow as tf
    path = tf.train.latest_checkpoint(os.path.join(run_dir, "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    kinds = reader.get_variable_to_dtype_map()
    return {k: reader.get_tensor(k) for k in kinds
            if k.startswith("model/") and kinds[k] != tf.string}


def compare(a: dict, b: dict) -> dict:
    """The largest difference relative to each tensor's largest value, and
    whether every tensor is bit-identical."""
    worst = max(float(np.max(np.abs(a[k] - b[k])) /
                      (float(np.max(np.abs(a[k]))) + 1e-12)) for k in a)
    same = all(np.array_equal(a[k], b[k]) for k in a)
    return {"max_relative_difference": worst, "bit_identical": same}
