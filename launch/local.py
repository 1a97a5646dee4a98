"""Start N workers on this host, like `horovodrun -np N` for tf.distribute.

    python -m launch.local --num_workers 2 [--port 20000] [--max_restarts 1] \
        -- python run_pretraining.py --input_file=... --output_dir=...
    python -m launch.local --backend mpi --num_workers 2 \
        -- python run_pretraining.py --backend=mpi ...

With `--backend mpi` the workers are the ranks of one `mpirun` (Open MPI's
or MPICH's, found next to this Python or on PATH, or `--mpirun`), which
connects them; the same guarantees hold: prefixed output, signals passed on
to every rank (which then save a preemption checkpoint), a dead rank ends the
attempt with its rank named, restarts from the last checkpoint.

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
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Mapping, Optional, Sequence

from launch import children
from launch.constants import PREEMPTED_EXIT_CODE

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
        env.update(thread_env(threads_per_worker))
        env["TFSCALE_WORKER_INDEX"] = str(index)
        # TensorFlow's C++ INFO lines (one per collective, per server start)
        # off; warnings and errors stay. A value of one's own wins.
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        env["PYTHONUNBUFFERED"] = "1"
        specs.append(WorkerSpec(index, list(command), env))
    return specs


def thread_env(threads_per_worker: Optional[int]) -> dict:
    """TensorFlow's (and OpenMP's) thread counts for one worker."""
    if not threads_per_worker:
        return {}
    return {"TF_NUM_INTRAOP_THREADS": str(threads_per_worker),
            "TF_NUM_INTEROP_THREADS": str(min(2, threads_per_worker)),
            "OMP_NUM_THREADS": str(threads_per_worker)}


def find_mpirun(explicit: Optional[str] = None) -> str:
    """The `mpirun` to use: `explicit`, the one installed beside this Python
    (`pip install 'tfscale[mpi]'`), or the first on PATH.

    Raises:
        ValueError: None found.
    """
    if explicit:
        found = shutil.which(explicit)
        if not found:
            raise ValueError(f"--mpirun {explicit}: not found or not "
                             "executable")
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise ValueError("--backend mpi needs mpirun: pip install "
                         "'tfscale[mpi]' (Open MPI from PyPI), load your "
                         "site's MPI module, or pass --mpirun PATH")
    return found


def mpirun_command(command: Sequence[str], num_workers: int, mpirun: str, *,
                   as_root: bool = False,
                   extra_args: Sequence[str] = ()) -> List[str]:
    """The `mpirun` command line that starts `num_workers` ranks of
    `command` on this host (Open MPI's options)."""
    if num_workers < 1:
        raise ValueError(f"--num_workers must be >= 1, got {num_workers}")
    if not command:
        raise ValueError("no command to run: put it after '--'")
    extra_args = list(extra_args)
    head = [mpirun, "-np", str(num_workers),
            # Every line tagged with its rank ([job,rank]<stdout>: ...).
            "--output", "tag"]
    # Defaults the user's own options replace (mpirun rejects repeats):
    # thread counts are set per worker and more ranks than cores is
    # allowed, as with the gRPC backend.
    if not any(a.startswith("--bind-to") for a in extra_args):
        head += ["--bind-to", "none"]
    if not any(a.startswith(("--oversubscribe", "--map-by"))
               for a in extra_args):
        head.append("--oversubscribe")
    if as_root:
        head.append("--allow-run-as-root")
    return head + extra_args + list(command)


def mpi_env(base_env: Mapping[str, str],
            threads_per_worker: Optional[int]) -> dict:
    """The environment mpirun passes to every rank."""
    env = dict(base_env)
    env.pop("TF_CONFIG", None)
    env.update(thread_env(threads_per_worker))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: v for k, v in MPI_MEMORY_ENV.items() if k not in env})
    return env


# The MPI path writes every all-reduce into a new tensor. With TensorFlow's
# default CPU allocator each one page-faults fresh memory (64 MB: 40 ms
# more than MPI's own time); its caching allocator (BFC) keeps the memory,
# and glibc's hugetlb tunable backs large blocks with transparent huge
# pages, which Open MPI's single-copy transfers read faster
# (benchmarks/README.md, "tfscale.horovod"). A value of one's own wins.
MPI_MEMORY_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true",
                  "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def default_threads(num_workers: int) -> int:
    """Each worker's share of this host's cores."""
    return max(1, (os.cpu_count() or 1) // num_workers)


class _Group:
    """The running worker processes of one attempt."""

    def __init__(self, specs: Sequence[WorkerSpec], out):
        self._out = out
        self._lock = threading.Lock()
        self.last_lines = {}  # worker index -> its error line (_remember)
        self._exit_order = []  # worker indexes as their processes ended
        self.procs = []
        self._threads = []
        for spec in specs:
            proc = subprocess.Popen(
                spec.command, env=dict(spec.env), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=children.PREEXEC)
            self.procs.append(proc)
            thread = threading.Thread(target=self._pump,
                                      args=(spec.index, proc), daemon=True)
            thread.start()
            self._threads.append(thread)
            threading.Thread(target=self._wait, args=(spec.index, proc),
                             daemon=True).start()

    def _wait(self, index, proc):
        proc.wait()
        with self._lock:
            self._exit_order.append(index)

    def _pump(self, index, proc):
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            _remember(self.last_lines, index, line)
            with self._lock:
                self._out.write(f"[worker {index}] {line}\n")
                self._out.flush()

    def first_failure(self):
        """(index, code) of the worker that failed first, or None.

        First in time, not in index: when one worker dies its peers fail
        within milliseconds (their collectives lose it), often before the
        launcher looks again.
        """
        with self._lock:
            order = list(self._exit_order)
        for index in order:
            code = self.procs[index].returncode
            if code != 0:
                self._threads[index].join(timeout=2)  # its last words
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


_TAGGED = re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>: ?(.*)$")
_PEER_HOST = re.compile(r"^\s*Peer host:\s*(\S+)")
_LOST_CONNECTION = re.compile(r"peer process has unexpectedly disconnected|"
                              r"An error occurred in Socket closed")
_RANK_SIGNAL = re.compile(
    r"process rank (\d+) with PID \d+ on node \S+ exited on\s+signal (\d+)")
_RANK_EXIT = re.compile(r"Process name: \[[^\]]*,(\d+)\]\s+Exit code:\s+(\d+)")
_RANK_ABORT = re.compile(
    r"process rank (\d+) with PID \d+ on node \S+ calling\s+\"abort\"")


class _MpiGroup:
    """The ranks of one `mpirun` (the same interface as `_Group`)."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], out):
        self._out = out
        self._lock = threading.Lock()
        self._mpirun_text = []
        self.last_lines = {}  # rank -> its error line (_remember)
        # rank -> the host of an MPI peer it lost (Open MPI's "peer process
        # has unexpectedly disconnected ... Peer host: H"; None when Open MPI
        # said only "Socket closed"): that rank is a victim, though it may
        # abort before mpirun reports the rank that died.
        self.lost_peer = {}
        self.proc = subprocess.Popen(
            list(command), env=dict(env), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=children.PREEXEC)
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self):
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            tagged = _TAGGED.match(line)
            if tagged:
                _remember(self.last_lines, int(tagged.group(1)),
                          tagged.group(2))
                rank, text = int(tagged.group(1)), tagged.group(2)
                peer = _PEER_HOST.match(text)
                if peer:
                    self.lost_peer[rank] = peer.group(1)
                elif _LOST_CONNECTION.search(text):
                    self.lost_peer.setdefault(rank, None)
                line = f"[worker {tagged.group(1)}] {tagged.group(2)}"
            else:
                self._mpirun_text.append(line)
                if not line.strip() or set(line.strip()) <= {"-"}:
                    continue
                line = f"[mpirun] {line}"
            with self._lock:
                self._out.write(line + "\n")
                self._out.flush()

    def first_failure(self):
        """(rank, code) of the failed rank (code < 0: killed by a signal),
        (None, mpirun's status) if mpirun did not say, or None."""
        code = self.proc.poll()
        if code is None or code == 0:
            return None
        self._thread.join(timeout=5)  # mpirun's last words
        text = " ".join(self._mpirun_text)
        died = _RANK_SIGNAL.search(text)
        if died:
            return int(died.group(1)), -int(died.group(2))
        exited = _RANK_EXIT.search(text)
        if exited:
            return int(exited.group(1)), int(exited.group(2))
        aborted = _RANK_ABORT.search(text)
        if aborted:  # MPI_Abort: mpirun's status is the abort's code
            return int(aborted.group(1)), code
        return None, code

    def all_done(self) -> bool:
        return self.proc.poll() is not None

    def signal_all(self, sig):
        """SIGTERM and SIGINT reach every rank, on every host, as SIGUSR1
        through mpirun (which forwards SIGUSR1 to all ranks but would end
        them itself on SIGTERM, before they could save; the Trainer takes
        either as a preemption request). Other signals go to mpirun's
        process group."""
        if self.proc.poll() is not None:
            return
        try:
            if sig in (signal.SIGTERM, signal.SIGINT):
                os.kill(self.proc.pid, signal.SIGUSR1)
            else:
                os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_seconds: float, sig=signal.SIGTERM):
        if sig is not None:
            self.signal_all(sig)
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and not self.all_done():
            time.sleep(POLL_SECONDS)
        if not self.all_done():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._thread.join(timeout=5)


def run(command: Sequence[str], num_workers: int, *, port: Optional[int] = None,
        max_restarts: int = 0, host: str = "127.0.0.1",
        threads_per_worker: Optional[int] = None, grace_seconds: float = 30.0,
        base_env: Optional[Mapping[str, str]] = None, out=None,
        backend: str = "mwms", mpirun: Optional[str] = None,
        mpirun_args: Sequence[str] = (), data_service_workers: int = 0,
        data_service_dir: Optional[str] = None) -> int:
    """Runs `command` as `num_workers` workers until all succeed.

    `backend="mwms"` starts the processes with a TF_CONFIG each; "mpi" starts
    them as the ranks of one `mpirun` (`mpirun` and `mpirun_args` choose it
    and add options).

    `data_service_workers` > 0 also starts a tf.data service (a
    fault-tolerant dispatcher journaling to `data_service_dir`, and that
    many workers; `launch.data_service`, `input_pipelines.service`) for the whole run, replaces any of
    its processes that dies, and gives the workers its address
    (TFSCALE_DATA_SERVICE, which the entry points read).

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
    if backend not in ("mwms", "mpi"):
        raise ValueError(f"--backend must be mwms or mpi, got {backend!r}")
    out = out or sys.stdout
    base_env = dict(os.environ if base_env is None else base_env)
    if data_service_workers < 0:
        raise ValueError(f"--data_service_workers must be >= 0, got "
                         f"{data_service_workers}")
    if backend == "mpi":
        mpi_command = mpirun_command(
            command, num_workers, find_mpirun(mpirun),
            as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
            extra_args=mpirun_args)

        def start():
            return _MpiGroup(mpi_command,
                             mpi_env(base_env, threads_per_worker), out)
    else:
        def start():
            ports = (list(range(port, port + num_workers)) if port
                     else find_free_ports(num_workers, host))
            return _Group(worker_specs(command, num_workers, ports, base_env,
                                       host, threads_per_worker), out)
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal)
                for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    service = None
    try:
        if data_service_workers:
            service = _start_service(data_service_workers, data_service_dir,
                                     host, base_env, out)
        for attempt in range(max_restarts + 1):
            group = start()
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
            who = "an MPI rank" if index is None else f"worker {index}"
            if code == PREEMPTED_EXIT_CODE:
                # The others are saving the same checkpoint: let them finish.
                _say(out, f"{who} was preempted (exit {code}, "
                          f"checkpoint saved); waiting for the others")
                group.stop(grace_seconds, sig=None)
            else:
                # The others cannot finish a step (or a checkpoint) without
                # it: there is nothing to wait for.
                _say(out, f"{who} failed ({children.describe_exit(code)})"
                          f"{_last_words(group, index, code)}; stopping the "
                          "other workers")
                group.stop(0.0, sig=signal.SIGKILL)
            if attempt < max_restarts:
                _say(out, f"restart {attempt + 1}/{max_restarts}: starting "
                          f"{num_workers} workers again (cause: {who} "
                          f"{children.describe_exit(code)})")
        return children.shell_code(code)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if service is not None:
            service.stop()


# A line that states an error: Python's last traceback line
# ("ValueError: ..."), an entry point's "prog: error: ...", tfscale's
# "tfscale: worker 1 failed: ...".
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b(: |$)|"
                         r"^\S+: error: |^tfscale: .* failed: ")


def _remember(last_lines: dict, index: int, line: str) -> None:
    """Keeps worker `index`'s latest error line, or, until it has printed
    one, its latest non-blank line."""
    text = line.replace("\x00", "").strip()
    if not text or set(text) <= {"-"}:
        return
    if _ERROR_LINE.search(text):
        last_lines[index] = (True, text)
    elif not last_lines.get(index, (False, ""))[0]:
        last_lines[index] = (False, text)


def _last_words(group, index: Optional[int], code: int) -> str:
    """": <the worker's last line>" for a worker that exited with an error
    code (the error, with Python's traceback or tfscale's exit line), else
    "" (a worker killed by a signal said nothing about it)."""
    if index is None or code <= 0:
        return ""
    lost = getattr(group, "lost_peer", {})
    if index in lost:
        if lost[index]:
            return (f": it lost its MPI peer on {lost[index]} (a rank there "
                    "died or was killed first)")
        return (": it lost an MPI connection (another rank died or was "
                "killed first; mpirun names the first rank to abort)")
    _, line = group.last_lines.get(index, (False, ""))
    return f": {line}" if line else ""


def _start_service(num_workers, work_dir, host, base_env, out):
    """A tf.data service for the run; its address goes into `base_env`."""
    from launch.data_service import ADDRESS_ENV, Service
    service = Service(num_workers, find_free_ports(1, host)[0], out,
                      work_dir=work_dir, env=base_env)
    base_env[ADDRESS_ENV] = service.address
    _say(out, f"tf.data service: dispatcher {service.address} and "
              f"{num_workers} worker(s) for the training workers "
              f"(${ADDRESS_ENV})")
    return service


def _say(out, message: str):
    out.write(f"[launcher] {message}\n")
    out.flush()


def parse_args(argv: Sequence[str]):
    parser = argparse.ArgumentParser(
        prog="tfscale-launch", description=__doc__.split("\n\n")[0],
        usage="%(prog)s --num_workers N [options] -- command ...")
    parser.add_argument("--num_workers", type=int, required=True)
    parser.add_argument("--backend", choices=["mwms", "mpi"], default="mwms",
                        help="mwms: one process per worker with a TF_CONFIG "
                             "(MultiWorkerMirroredStrategy); mpi: the ranks "
                             "of one mpirun (run the command with "
                             "--backend=mpi)")
    parser.add_argument("--mpirun", default=None,
                        help="--backend mpi: the mpirun to use (default: "
                             "beside this Python, else on PATH)")
    parser.add_argument("--mpirun_args", default="",
                        help="--backend mpi: extra mpirun options, e.g. "
                             "\"--mca btl tcp,self\"")
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
    parser.add_argument("--data_service_workers", type=int, default=0,
                        help="also start a tf.data service with this many "
                             "workers on this host; the training workers "
                             "decode on it (entry points read "
                             "$TFSCALE_DATA_SERVICE)")
    parser.add_argument("--data_service_dir", default=None,
                        help="the service dispatcher's journal (default: "
                             "a temporary directory)")
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
    if args.data_service_workers < 0:
        parser.error("--data_service_workers must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    threads = args.threads_per_worker or default_threads(args.num_workers)
    try:
        return run(args.command, args.num_workers, port=args.port,
                   max_restarts=args.max_restarts, host=args.host,
                   threads_per_worker=threads,
                   grace_seconds=args.grace_seconds, backend=args.backend,
                   mpirun=args.mpirun,
                   mpirun_args=shlex.split(args.mpirun_args),
                   data_service_workers=args.data_service_workers,
                   data_service_dir=args.data_service_dir)
    except ValueError as e:
        print(f"tfscale-launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
