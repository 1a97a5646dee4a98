"""The tf.data service's processes: run one, or keep a set of them alive.

    python -m launch.data_service dispatcher --port 5050 --work_dir DIR
    python -m launch.data_service worker --dispatcher HOST:5050

A dispatcher keeps the service's state and deals out the work; a worker
registers with it, runs the pipelines it is given and serves their batches
to the trainers (`input_pipelines/service.py`). The dispatcher runs in
TensorFlow's fault-tolerant mode: it journals its state to `--work_dir`, so
a restarted dispatcher (same port, same directory) picks the jobs up again,
and a worker that dies is dropped after `--worker_timeout` seconds while the
trainers go on reading from the others.

`Service` (used by `launch.local --data_service_workers K`) starts a
dispatcher and K workers on this host and replaces any that dies; the SLURM
template `launch/slurm_data_service.sbatch` runs the same commands on nodes
of their own.

Only the `dispatcher` and `worker` commands import TensorFlow; `Service` is
plain process management, as is the rest of `launch`.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional

# `input_pipelines.service.ADDRESS_ENV` (not imported: no TensorFlow here).
ADDRESS_ENV = "TFSCALE_DATA_SERVICE"
# A dead worker is dropped (and its tasks given up) after this long.
WORKER_TIMEOUT_SECONDS = 10.0
HEARTBEAT_SECONDS = 1.0


def _tensorflow():
    """TensorFlow, loaded without the GPU-probe noise of a CPU host."""
    from cli import quiet_tensorflow
    quiet_tensorflow(0)
    import tensorflow as tf
    return tf


def dispatcher_main(port: int, work_dir: str,
                    worker_timeout: float = WORKER_TIMEOUT_SECONDS) -> None:
    tf = _tensorflow()
    service = tf.data.experimental.service
    server = service.DispatchServer(service.DispatcherConfig(
        port=port, work_dir=work_dir, fault_tolerant_mode=True,
        worker_timeout_ms=int(worker_timeout * 1000)))
    print(f"tf.data service dispatcher at {socket.gethostname()}:{port} "
          f"(state in {work_dir})", flush=True)
    server.join()


def worker_main(dispatcher: str, port: int = 0,
                host: Optional[str] = None) -> None:
    tf = _tensorflow()
    service = tf.data.experimental.service
    host = host or _worker_host(dispatcher)
    server = service.WorkerServer(service.WorkerConfig(
        dispatcher_address=dispatcher.split("://", 1)[-1], port=port,
        worker_address=f"{host}:%port%",
        heartbeat_interval_ms=int(HEARTBEAT_SECONDS * 1000)))
    print(f"tf.data service worker of {dispatcher} (pid {os.getpid()})",
          flush=True)
    server.join()


def _worker_host(dispatcher: str) -> str:
    """The name trainers reach this worker by: "localhost" beside a local
    dispatcher, else this host's name."""
    host = dispatcher.split("://", 1)[-1].rpartition(":")[0]
    if host in ("localhost", "127.0.0.1", "::1", "[::1]"):
        return "localhost"
    return socket.gethostname()


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
        module = [sys.executable, "-m", "launch.data_service"]
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
        from launch.local import _die_with_launcher
        proc = subprocess.Popen(
            self._commands[index], env=self._env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=(_die_with_launcher if sys.platform == "linux"
                        else None))
        threading.Thread(target=self._pump, args=(self._names[index], proc),
                         daemon=True).start()
        return proc

    def _pump(self, name: str, proc):
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
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
                from launch.local import describe_exit
                self._say(f"[launcher] {self._names[index]} died "
                          f"({describe_exit(code)}); starting a new one")
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


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m launch.data_service",
        description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dispatcher = commands.add_parser("dispatcher", help="run a dispatcher")
    dispatcher.add_argument("--port", type=int, required=True)
    dispatcher.add_argument("--work_dir", required=True,
                            help="its journal (fault-tolerant mode): a "
                                 "restart with the same one resumes")
    dispatcher.add_argument("--worker_timeout", type=float,
                            default=WORKER_TIMEOUT_SECONDS,
                            help="seconds before a silent worker is dropped")
    worker = commands.add_parser("worker", help="run a worker")
    worker.add_argument("--dispatcher", required=True, help="HOST:PORT")
    worker.add_argument("--port", type=int, default=0,
                        help="its port (default: a free one)")
    worker.add_argument("--host", default=None,
                        help="the name trainers reach it by (default: "
                             "localhost beside a local dispatcher, else "
                             "this host's name)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "dispatcher":
        dispatcher_main(args.port, args.work_dir, args.worker_timeout)
    else:
        worker_main(args.dispatcher, args.port, args.host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
