"""Start N workers on this host, like `horovodrun -np N` for tf.distribute.

    python -m launch.local --num_workers 2 [--port 20000] [--max_restarts 1] \
        -- python run_pretraining.py --input_file=... --output_dir=...

Each worker gets a TF_CONFIG naming every worker on 127.0.0.1 (free ports are
found, not assumed) and its share of the cores as TensorFlow thread counts,
since one process per device is the rule and N processes with all-core
thread pools would oversubscribe the host. Output lines are prefixed with the
worker index. When a worker fails, the others are stopped at once (not after
a collective timeout) and, if restarts remain, all are started again: the
Trainer resumes from the latest checkpoint. Ctrl-C stops every worker.

This module never imports TensorFlow: it only builds commands and
environments (`worker_specs` is a pure function) and runs processes.
"""

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Mapping, Optional, Sequence

POLL_SECONDS = 0.1


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One worker process: its command and its full environment."""

    index: int
    command: List[str]
    env: Mapping[str, str]


def find_free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """`count` distinct ports that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker_specs(command: Sequence[str], num_workers: int, ports: Sequence[int],
                 base_env: Mapping[str, str], host: str = "127.0.0.1",
                 threads_per_worker: Optional[int] = None) -> List[WorkerSpec]:
    """The command and environment of each of `num_workers` workers.

    Args:
        command: The training command, the same for every worker.
        num_workers: How many workers.
        ports: One port per worker.
        base_env: The launcher's environment (copied, not changed).
        host: Address the workers listen on.
        threads_per_worker: TensorFlow intra-op threads per worker (None: no
            limit set).

    Returns:
        A `WorkerSpec` per worker.
    """
    if num_workers < 1:
        raise ValueError(f"--num_workers must be >= 1, got {num_workers}")
    if len(ports) != num_workers or len(set(ports)) != num_workers:
        raise ValueError(f"need {num_workers} distinct ports, got {list(ports)}")
    if not command:
        raise ValueError("no command to run: put it after '--'")
    addresses = [f"{host}:{port}" for port in ports]
    specs = []
    for index in range(num_workers):
        env = dict(base_env)
        env.pop("TF_CONFIG", None)
        if num_workers > 1:
            env["TF_CONFIG"] = json.dumps({
                "cluster": {"worker": addresses},
                "task": {"type": "worker", "index": index}})
        if threads_per_worker:
            env["TF_NUM_INTRAOP_THREADS"] = str(threads_per_worker)
            env["TF_NUM_INTEROP_THREADS"] = str(min(2, threads_per_worker))
            env["OMP_NUM_THREADS"] = str(threads_per_worker)
        env["TFSCALE_WORKER_INDEX"] = str(index)
        # TensorFlow's C++ INFO lines (one per collective, per server start)
        # off; warnings and errors stay. A value of one's own wins.
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        env["PYTHONUNBUFFERED"] = "1"
        specs.append(WorkerSpec(index, list(command), env))
    return specs


def default_threads(num_workers: int) -> int:
    """Each worker's share of this host's cores."""
    return max(1, (os.cpu_count() or 1) // num_workers)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def shell_code(code: int) -> int:
    """A process return code as a shell exit status (signal N -> 128+N)."""
    return 128 - code if code < 0 else code


# What `tfscale.preemption.PREEMPTED_EXIT_CODE` is (not imported: this
# module never imports TensorFlow): a worker that saved a checkpoint after
# SIGTERM exits with it.
PREEMPTED_EXIT_CODE = 143
_PR_SET_PDEATHSIG = 1


def _die_with_launcher():
    """preexec_fn: the worker gets SIGKILL when the launcher dies.

    Workers run in their own session (so a signal to the worker reaches its
    children too), which also means nothing would end them if the launcher
    itself were killed: they would hold ports, cores and GPUs. Linux's
    parent-death signal closes that gap; elsewhere nothing is set.
    """
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(1)


class _Group:
    """The running worker processes of one attempt."""

    def __init__(self, specs: Sequence[WorkerSpec], out):
        self._out = out
        self._lock = threading.Lock()
        self.procs = []
        self._threads = []
        for spec in specs:
            proc = subprocess.Popen(
                spec.command, env=dict(spec.env), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=(_die_with_launcher if sys.platform == "linux"
                            else None))
            self.procs.append(proc)
            thread = threading.Thread(target=self._pump,
                                      args=(spec.index, proc), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, index, proc):
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                self._out.write(f"[worker {index}] {line}\n")
                self._out.flush()

    def first_failure(self):
        """(index, code) of the first failed worker, or None."""
        for index, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None and code != 0:
                return index, code
        return None

    def all_done(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def signal_all(self, sig):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, grace_seconds: float, sig=signal.SIGTERM):
        """Signals every live worker, then kills what is left after grace.

        With `sig=None` the workers are not signalled first (they are
        finishing by themselves, e.g. saving a preemption checkpoint).
        """
        if sig is not None:
            self.signal_all(sig)
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and not self.all_done():
            time.sleep(POLL_SECONDS)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)


def run(command: Sequence[str], num_workers: int, *, port: Optional[int] = None,
        max_restarts: int = 0, host: str = "127.0.0.1",
        threads_per_worker: Optional[int] = None, grace_seconds: float = 30.0,
        base_env: Optional[Mapping[str, str]] = None, out=None) -> int:
    """Runs `command` as `num_workers` workers until all succeed.

    A worker that fails (crash, kill -9, or exit 143 after saving a
    preemption checkpoint) stops the attempt; while restarts remain, all
    workers start again and resume from the latest checkpoint. SIGTERM to
    the launcher is passed on to the workers (they save a checkpoint and
    exit), SIGINT too.

    Returns:
        0 if every worker exited 0; else the shell status of the first
        worker that failed in the last attempt; 128 + N after signal N
        reached the launcher (130 for Ctrl-C, 143 for SIGTERM).

    Raises:
        ValueError: `max_restarts` < 0 or another bad argument.
    """
    if max_restarts < 0:
        raise ValueError(f"--max_restarts must be >= 0, got {max_restarts}")
    out = out or sys.stdout
    base_env = dict(os.environ if base_env is None else base_env)
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal)
                for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        for attempt in range(max_restarts + 1):
            ports = (list(range(port, port + num_workers)) if port
                     else find_free_ports(num_workers, host))
            specs = worker_specs(command, num_workers, ports, base_env, host,
                                 threads_per_worker)
            group = _Group(specs, out)
            failure = None
            while not interrupted:
                failure = group.first_failure()
                if failure or group.all_done():
                    break
                time.sleep(POLL_SECONDS)
            if interrupted:
                sig = interrupted[0]
                _say(out, f"{signal.Signals(sig).name}: passing it to all "
                          f"workers")
                group.stop(grace_seconds, sig=sig)
                return 128 + int(sig)
            if failure is None:
                group.stop(grace_seconds)
                return 0
            index, code = failure
            if code == PREEMPTED_EXIT_CODE:
                # The others are saving the same checkpoint: let them finish.
                _say(out, f"worker {index} was preempted (exit {code}, "
                          f"checkpoint saved); waiting for the others")
                group.stop(grace_seconds, sig=None)
            else:
                # The others cannot finish a step (or a checkpoint) without
                # it: there is nothing to wait for.
                _say(out, f"worker {index} failed ({describe_exit(code)}); "
                          f"stopping the other workers")
                group.stop(0.0, sig=signal.SIGKILL)
            if attempt < max_restarts:
                _say(out, f"restart {attempt + 1}/{max_restarts}: starting "
                          f"{num_workers} workers again (cause: worker {index} "
                          f"{describe_exit(code)})")
        return shell_code(code)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say(out, message: str):
    out.write(f"[launcher] {message}\n")
    out.flush()


def parse_args(argv: Sequence[str]):
    parser = argparse.ArgumentParser(
        prog="tfscale-launch", description=__doc__.split("\n\n")[0],
        usage="%(prog)s --num_workers N [options] -- command ...")
    parser.add_argument("--num_workers", type=int, required=True)
    parser.add_argument("--port", type=int, default=None,
                        help="first of N consecutive ports (default: free ports)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--max_restarts", type=int, default=0)
    parser.add_argument("--threads_per_worker", type=int, default=None,
                        help="TF intra-op threads per worker "
                             "(default: cores / num_workers)")
    parser.add_argument("--grace_seconds", type=float, default=30.0,
                        help="seconds workers get to exit (and save a "
                             "checkpoint) after a signal before SIGKILL")
    argv = list(argv)
    if "--" not in argv:
        parser.error("put the training command after '--'")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    args.command = argv[split + 1:]
    if not args.command:
        parser.error("no command after '--'")
    if args.num_workers < 1:
        parser.error("--num_workers must be >= 1")
    if args.max_restarts < 0:
        parser.error("--max_restarts must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    threads = args.threads_per_worker or default_threads(args.num_workers)
    return run(args.command, args.num_workers, port=args.port,
               max_restarts=args.max_restarts, host=args.host,
               threads_per_worker=threads, grace_seconds=args.grace_seconds)


if __name__ == "__main__":
    sys.exit(main())
