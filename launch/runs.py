"""Start a job, read what it said: one command line, its log, its workers.

    job = Job("w1", command, out_dir, env={...}).start()
    job.wait(timeout)                 # exit code, or "timeout" (killed)
    job.intervals()                   # {step: (loss, examples/s, step ms)}
    job.placement()                   # the first placement line
    job.signal_worker(1, SIGTERM)     # a worker of a launch.local job

A job is a subprocess in its own session whose output goes to
`<out_dir>/<name>.log`; what it printed is read back from there (the
Trainer's interval lines, the start banner's, the launcher's). The GPU node
check (`launch/gpu_check/`) and the benchmarks (`benchmarks/harness.py`)
run their jobs through it. Never imports TensorFlow.
"""

import os
import re
import subprocess
import time
from typing import Optional

INTERVAL = re.compile(r"step (\d+): loss ([\d.naninf]+), ([\d.]+) examples/s, "
                      r"step ([\d.]+) ms")
PLACEMENT = re.compile(r"placement: (.*)$", re.M)


class Job:
    """One job (a command line) and its log.

    Args:
        name: The log's name (`<out_dir>/<name>.log`).
        command: The command line.
        out_dir: Where the log goes.
        env: Variables set over this process's environment.
        cwd: The job's folder (default: this process's).
    """

    def __init__(self, name: str, command, out_dir: str, env=None,
                 cwd: Optional[str] = None):
        self.name = name
        self.command = [str(c) for c in command]
        self.log = os.path.join(out_dir, f"{name}.log")
        self.env = dict(os.environ, **(env or {}))
        self.cwd = cwd
        self.proc = None
        self.started = None
        self.seconds = None
        self.code = None
        self._file = None

    def start(self) -> "Job":
        self._file = open(self.log, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.command, cwd=self.cwd, env=self.env,
                                     stdout=self._file,
                                     stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait(self, timeout: float):
        """The exit code, or "timeout" (the job's process group killed)."""
        try:
            self.code = self.proc.wait(timeout=max(timeout, 0.1))
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

    def placements(self) -> list:
        """Every placement line, in the order printed."""
        return [p.strip() for p in PLACEMENT.findall(self.text())]

    def placement(self) -> Optional[str]:
        """The first placement line (the chief's banner), or None."""
        found = self.placements()
        return found[0] if found else None

    def wait_for(self, text: str, timeout: float) -> Optional[float]:
        """Seconds until `text` is in the log (None: not within
        `timeout`, or the job ended without it)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if text in self.text():
                return time.monotonic() - start
            if not self.running():
                return (time.monotonic() - start) if text in self.text() \
                    else None
            time.sleep(0.05)
        return None

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
                    and descends_from(int(pid), self.proc.pid)):
                found.setdefault(int(index), int(pid))
        return found

    def signal_worker(self, index: int, sig) -> bool:
        pid = self.worker_pids().get(index)
        if pid is None:
            return False
        os.kill(pid, sig)
        return True


def descends_from(pid: int, root: int, depth: int = 4) -> bool:
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
