"""The worker processes of one attempt, and what they said.

`ProcessGroup` runs one process per worker with its output prefixed by the
worker index; it reports the worker that failed first (in time, not by
index; the peer a worker says its collective lost before the worker that
lost it), signals all of them and stops them with a grace period. Each
worker's last error line is kept (`remember`) so that the launcher can say
why an attempt ended (`last_words`), and so is the preemption checkpoint a
worker says is complete (`reported_checkpoint`), so that a worker killed
after the grace can be told from a lost checkpoint by the checkpoint's
files (`checkpoint_complete`). `mpi_ranks.MpiGroup` offers the same
interface for the ranks of one `mpirun`.
"""

import dataclasses
import glob
import os
import re
import signal
import subprocess
import threading
import time
from typing import List, Mapping, Optional, Sequence

from launch import children, hangs
from tfscale.cluster.contract import CHECKPOINT_COMPLETE, HUNG_EXIT_CODE


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One worker process: its command and its full environment."""

    index: int
    command: List[str]
    env: Mapping[str, str]

POLL_SECONDS = 0.1
# How long a worker that lost a peer waits for that peer's exit to be
# seen before the launcher names the worker itself (`_culprit`).
PEER_SECONDS = 2.0
# tfscale's exit line for a collective that lost its peer
# (`tfscale.cluster.fail_fast.install`): "(lost peer: worker 1)".
LOST_PEER = re.compile(r"\(lost peer: worker (\d+)")


def thread_env(threads_per_worker: Optional[int]) -> dict:
    """TensorFlow's (and OpenMP's) thread counts for one worker."""
    if not threads_per_worker:
        return {}
    return {"TF_NUM_INTRAOP_THREADS": str(threads_per_worker),
            "TF_NUM_INTEROP_THREADS": str(min(2, threads_per_worker)),
            "OMP_NUM_THREADS": str(threads_per_worker)}


def default_threads(num_workers: int) -> int:
    """Each worker's share of this host's cores."""
    return max(1, (os.cpu_count() or 1) // num_workers)


class ProcessGroup:
    """The running worker processes of one attempt."""

    def __init__(self, specs: Sequence[WorkerSpec], out):
        self._out = out
        self._lock = threading.Lock()
        self.last_lines = {}  # worker index -> its error line (remember)
        self.checkpoints = []  # preemption checkpoints said complete
        self.held_back = []  # (worker, line) printed after `mute`
        self.hung = {}  # worker index -> why it is held to have hung
        self.link = None  # (worker, peer, why) when the network is the cause
        self._muted = False
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
            remember(self.last_lines, index, line)
            note_checkpoint(self.checkpoints, line)
            with self._lock:
                if self._muted:
                    self.held_back.append((index, line))
                    continue
                self._out.write(f"[worker {index}] {line}\n")
                self._out.flush()

    def mute(self) -> None:
        """From now on the workers' lines are kept in `held_back`, not
        printed: after a worker failed, its peers' tracebacks about the
        peer they lost would bury the launcher's line that named it."""
        with self._lock:
            self._muted = True

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
                return self._culprit(index, code)
        return None

    def _culprit(self, index: int, code: int):
        """(index, code) of the worker whose failure ended the attempt.

        A worker whose collective lost a peer leaves at once (`os._exit`
        after its line "... (lost peer: worker N); ending the job"), within
        milliseconds of that peer's death; on a loaded host its exit can be
        seen first. When the peer it names has failed too (within
        `PEER_SECONDS`), the peer is the cause.
        """
        _, line = self.last_lines.get(index, (False, ""))
        named = LOST_PEER.search(line)
        peer = int(named.group(1)) if named else -1
        if not 0 <= peer < len(self.procs) or peer == index:
            return self._stopped_peer(index, line) or (index, code)
        try:
            peer_code = self.procs[peer].wait(timeout=PEER_SECONDS)
        except subprocess.TimeoutExpired:
            stopped = self._stopped_peer(index, line)
            if stopped is None:
                self.link = (index, peer, f"worker {peer} was still running "
                             f"when worker {index} lost it")
            return stopped or (index, code)
        if peer_code == 0:
            return index, code
        self._threads[peer].join(timeout=2)
        _, theirs = self.last_lines.get(peer, (False, ""))
        named = LOST_PEER.search(theirs)
        if named and int(named.group(1)) == index:
            # Each lost the other: neither died first.
            self.link = (index, peer, f"worker {index} and worker {peer} "
                         "each lost the other")
            return index, code
        return peer, peer_code

    def _stopped_peer(self, index: int, line: str):
        """(peer, HUNG_EXIT_CODE) for a live worker the kernel holds
        stopped (SIGSTOP): its peers lost it and failed first, but it is
        the cause (`hung` says why); None when none is."""
        pids = [p.pid if p.poll() is None else None for p in self.procs]
        held = [i for i in hangs.stopped_workers(pids) if i != index]
        if not held:
            return None
        self.hung[held[0]] = (
            "stopped by the kernel (SIGSTOP or a debugger: state T), so "
            f"its peers lost it; worker {index} said: {line.strip()[:200]}")
        return held[0], HUNG_EXIT_CODE

    def all_done(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def signal_all(self, sig):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, grace_seconds: float, sig=signal.SIGTERM,
             hurry=None) -> list:
        """Signals every live worker, then kills what is left after grace.

        With `sig=None` the workers are not signalled first (they are
        finishing by themselves, e.g. saving a preemption checkpoint).
        `hurry()` True (a second Ctrl-C) ends the grace at once.

        Returns:
            The indexes of the workers still running when the grace ran
            out (SIGKILLed).
        """
        if sig is not None:
            self.signal_all(sig)
        wait_out_grace(grace_seconds, self.all_done, hurry)
        killed = [i for i, proc in enumerate(self.procs)
                  if proc.poll() is None]
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)
        return killed


# A line that states an error: Python's last traceback line
# ("ValueError: ..."), an entry point's "prog: error: ...", tfscale's
# "tfscale: worker 1 failed: ...".
ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b(: |$)|"
                         r"^\S+: error: |^tfscale: .* failed: ")


def wait_out_grace(grace_seconds: float, done, hurry=None) -> None:
    """Returns when `done()`, when `grace_seconds` have passed, or when
    `hurry()` says so."""
    deadline = time.monotonic() + grace_seconds
    while (time.monotonic() < deadline and not done()
           and not (hurry is not None and hurry())):
        time.sleep(POLL_SECONDS)


def note_checkpoint(checkpoints: list, line: str) -> None:
    """Keeps the path of a preemption checkpoint a worker's line says is
    complete (`contract.CHECKPOINT_COMPLETE PATH (step N, ...)`)."""
    where = line.find(CHECKPOINT_COMPLETE)
    if where >= 0:
        rest = line[where + len(CHECKPOINT_COMPLETE):].split()
        if rest:
            checkpoints.append(rest[0])


def checkpoint_complete(prefix: str) -> bool:
    """Whether the TensorFlow checkpoint `prefix` is whole on disk: its
    index (written last) and every data shard it names
    (`PREFIX.data-0000i-of-0000N`); for a folder, the Keras
    BackupAndRestore backup in it (`model.fit`'s): its weights and the
    metadata that names their epoch."""
    if os.path.isdir(prefix):
        return all(os.path.isfile(os.path.join(prefix, name)) for name in
                   ("latest.weights.h5", "training_metadata.json"))
    if not os.path.exists(prefix + ".index"):
        return False
    shards = glob.glob(glob.escape(prefix) + ".data-*-of-*")
    if not shards:
        return False
    expected = int(shards[0].rsplit("-of-", 1)[1])
    return len(shards) == expected


def reported_checkpoint(group) -> Optional[str]:
    """The last preemption checkpoint a worker of `group` said complete,
    if its files are whole on disk; else None."""
    for prefix in reversed(getattr(group, "checkpoints", [])):
        if checkpoint_complete(prefix):
            return prefix
    return None


def remember(last_lines: dict, index: int, line: str) -> None:
    """Keeps worker `index`'s latest error line, or, until it has printed
    one, its latest non-blank line."""
    text = line.replace("\x00", "").strip()
    if not text or set(text) <= {"-"}:
        return
    if ERROR_LINE.search(text):
        last_lines[index] = (True, text)
    elif not last_lines.get(index, (False, ""))[0]:
        last_lines[index] = (False, text)


def last_words(group, index: Optional[int], code: int) -> str:
    """": <the worker's last line>" for a worker that exited with an error
    code (the error, with Python's traceback or tfscale's exit line), else
    "" (a worker killed by a signal said nothing about it)."""
    if index is None or code <= 0:
        return ""
    link = getattr(group, "link", None)
    if link is not None and link[0] == index:
        return f": {link_words(link)}"
    lost = getattr(group, "lost_peer", {})
    if index in lost:
        if lost[index]:
            return (f": it lost its MPI peer on {lost[index]} (a rank there "
                    "died or was killed first)")
        return (": it lost an MPI connection (another rank died or was "
                "killed first; mpirun names the first rank to abort)")
    _, line = group.last_lines.get(index, (False, ""))
    return f": {line}" if line else ""


def link_words(link) -> str:
    """What a lost connection says: (worker, peer, what was seen) from
    `ProcessGroup.link`."""
    worker, peer, seen = link
    return (f"{seen}: the network between worker {worker} and worker "
            f"{peer} failed, not a worker (a partition, packet loss, a "
            "firewall, or a host too loaded to answer TensorFlow's "
            "heartbeats within --heartbeat_timeout)")
