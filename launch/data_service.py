"""A tf.data service on this host, kept alive for a run.

`Service` (used by `launch.local --data_service_workers K`) starts a
dispatcher and K workers as processes of their own
(`python -m input_pipelines.service dispatcher|worker`, see there) and
replaces any that dies; the SLURM template `launch/slurm_data_service.sbatch`
runs the same commands on nodes of their own. Plain process management, as
is the rest of `launch`: no TensorFlow here.
"""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional

from launch import children
from tfscale.cluster.contract import CPU_HOST_NOISE, DATA_SERVICE_ADDRESS_ENV

ADDRESS_ENV = DATA_SERVICE_ADDRESS_ENV


class Service:
    """A dispatcher and `num_workers` workers on this host, restarted when
    they die, until `stop()`.

    Args:
        num_workers: Service workers.
        port: The dispatcher's port.
        out: Where their (prefixed) output goes.
        work_dir: The dispatcher's journal (None: a temporary directory,
            removed by `stop`).
        env: The processes' environment.
    """

    def __init__(self, num_workers: int, port: int, out,
                 work_dir: Optional[str] = None, env=None):
        if num_workers < 1:
            raise ValueError(f"--data_service_workers must be >= 1, got "
                             f"{num_workers}")
        self.address = f"localhost:{port}"
        self._own_dir = work_dir is None
        self.work_dir = work_dir or tempfile.mkdtemp(
            prefix="tfscale-data-service-")
        self._out = out
        self._env = dict(os.environ if env is None else env)
        self._env["PYTHONUNBUFFERED"] = "1"
        self._env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self._lock = threading.Lock()
        self._stopping = False
        module = [sys.executable, "-m", "input_pipelines.service"]
        self._commands = [module + ["dispatcher", "--port", str(port),
                                    "--work_dir", self.work_dir]]
        self._commands += [module + ["worker", "--dispatcher", self.address]
                           ] * num_workers
        self._names = ["data dispatcher"] + [
            f"data worker {i}" for i in range(num_workers)]
        self.procs: List[subprocess.Popen] = [
            self._start(i) for i in range(len(self._commands))]
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _start(self, index: int) -> subprocess.Popen:
        proc = subprocess.Popen(
            self._commands[index], env=self._env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=children.PREEXEC)
        threading.Thread(target=self._pump, args=(self._names[index], proc),
                         daemon=True).start()
        return proc

    def _pump(self, name: str, proc):
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if not any(noise in line for noise in CPU_HOST_NOISE):
                self._say(f"[{name}] {line}")

    def _say(self, line: str):
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()

    def _watch(self):
        """Replaces any process that died (the trainers keep reading from
        the others meanwhile)."""
        while not self._stopping:
            for index, proc in enumerate(self.procs):
                code = proc.poll()
                if code is None or self._stopping:
                    continue
                self._say(f"[launcher] {self._names[index]} died "
                          f"({children.describe_exit(code)}); starting a new one")
                self.procs[index] = self._start(index)
            time.sleep(0.2)

    def stop(self, grace_seconds: float = 5.0) -> None:
        """Ends every service process (and removes a temporary journal)."""
        self._stopping = True
        self._watcher.join(timeout=5)
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_seconds
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        if self._own_dir:
            import shutil
            shutil.rmtree(self.work_dir, ignore_errors=True)
