"""Workers as the ranks of one `mpirun` (Open MPI's or MPICH's).

`mpirun_command` builds the command line (every output line tagged with its
rank, no core binding, oversubscription allowed, as with the gRPC backend);
`MpiGroup` runs it with `workers.ProcessGroup`'s interface, reading which
rank died, exited or aborted from mpirun's own report.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import List, Mapping, Optional, Sequence

from launch import children, workers

def find_mpirun(explicit: Optional[str] = None) -> str:
    """The `mpirun` to use: `explicit`, the one installed beside this Python
    (`pip install '.[mpi]'` in tfscale's checkout), or the first on PATH.

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
                         "'.[mpi]' in tfscale's checkout (Open MPI from "
                         "PyPI), load your site's MPI module, or pass "
                         "--mpirun PATH")
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
    env.update(workers.thread_env(threads_per_worker))
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


_TAGGED = re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>: ?(.*)$")


_PEER_HOST = re.compile(r"^\s*Peer host:\s*(\S+)")


_LOST_CONNECTION = re.compile(r"peer process has unexpectedly disconnected|"
                              r"An error occurred in Socket closed")


_RANK_SIGNAL = re.compile(
    r"process rank (\d+) with PID \d+ on node \S+ exited on\s+signal (\d+)")


_RANK_EXIT = re.compile(r"Process name: \[[^\]]*,(\d+)\]\s+Exit code:\s+(\d+)")


_RANK_ABORT = re.compile(
    r"process rank (\d+) with PID \d+ on node \S+ calling\s+\"abort\"")


class MpiGroup:
    """The ranks of one `mpirun` (`workers.ProcessGroup`'s interface)."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], out):
        self._out = out
        self._lock = threading.Lock()
        self._mpirun_text = []
        self.last_lines = {}  # rank -> its error line (workers.remember)
        self.checkpoints = []  # preemption checkpoints said complete
        self.held_back = []  # (rank, line) printed after `mute`
        self.hung = {}  # rank -> why it is held to have hung
        self._muted = False
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
                workers.remember(self.last_lines, int(tagged.group(1)),
                          tagged.group(2))
                rank, text = int(tagged.group(1)), tagged.group(2)
                workers.note_checkpoint(self.checkpoints, text)
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
                if self._muted:
                    self.held_back.append((None, line))
                    continue
                self._out.write(line + "\n")
                self._out.flush()

    def mute(self) -> None:
        """As `workers.ProcessGroup.mute`."""
        with self._lock:
            self._muted = True

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

    def stop(self, grace_seconds: float, sig=signal.SIGTERM,
             hurry=None) -> list:
        """As `workers.ProcessGroup.stop`; the ranks are one process group
        (mpirun's): [None] when it was still running at the grace's end."""
        if sig is not None:
            self.signal_all(sig)
        workers.wait_out_grace(grace_seconds, self.all_done, hurry)
        killed = []
        if not self.all_done():
            killed = [None]
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._thread.join(timeout=5)
        return killed
