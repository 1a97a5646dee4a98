"""Start-up watchdog, run as a separate process by tfscale.cluster.strategies.

    python watchdog.py PID TIMEOUT SIGNAL WHO [PEER ...]

Waits for its standard input to close (the worker finished start-up, or
died). While it waits it says, every `REPORT_SECONDS`, which peers do not
accept TCP connections yet (a stale TF_CONFIG is not 120 s of silence). If
TIMEOUT seconds pass first, it names those peers and sends PID the signal
SIGNAL: the worker installed the C library's `_exit` as that signal's
handler (`exit_on_signal`), so it exits with the signal's number as its
code (`contract.STARTUP_TIMEOUT_EXIT_CODE`), not 137, which schedulers
read as an out-of-memory kill. A worker still there `KILL_AFTER_SECONDS`
later is SIGKILLed. A process, not a thread: while TensorFlow waits for
peers it holds the GIL, so no Python thread or signal handler in the
worker runs, and the worker ignores SIGTERM. Standard library only (it
must start in milliseconds and never import TensorFlow).
"""

import os
import select
import signal
import socket
import sys
import time

# The first "still waiting" line after this many seconds, then one every
# 3x as many.
REPORT_SECONDS = 10.0
KILL_AFTER_SECONDS = 3.0


def reachable(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def exit_on_signal(signum: int) -> bool:
    """Makes signal `signum` end this process at once with exit code
    `signum`, whatever holds the GIL (the handler is the C library's
    `_exit`, called with the signal's number). False where that cannot be
    set (no C library to load)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        handler = ctypes.cast(libc["_exit"], ctypes.c_void_p)
        return libc.signal(signum, handler) != ctypes.c_void_p(-1).value
    except (OSError, AttributeError):
        return False


def _unanswered(peers) -> str:
    dead = [p for p in peers if not reachable(p)]
    if not peers:  # MPI ranks: the launcher knows the addresses, not us
        return "the other ranks did not all start: --start-timeout"
    if dead:
        return f"unreachable peer(s): {', '.join(dead)}"
    return "all peers accept connections but did not join"


def _alive(pid: int) -> bool:
    """Whether the worker (this process's parent) is still there: once
    it is gone this process has another parent."""
    return os.getppid() == pid


def _wait(timeout: float, who: str, peers) -> bool:
    """True when standard input closed within `timeout` seconds; says
    which peers do not answer while it waits."""
    start = time.monotonic()
    report = REPORT_SECONDS
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            return False
        until_report = report - (time.monotonic() - start)
        ready, _, _ = select.select([sys.stdin], [], [],
                                    max(0.0, min(left, until_report)))
        if ready:
            return True
        waited = time.monotonic() - start
        if waited >= report and waited < timeout:
            sys.stderr.write(f"tfscale: {who} still waiting for the cluster "
                             f"after {waited:.0f} s ({_unanswered(peers)}); "
                             f"giving up at {timeout:g} s\n")
            sys.stderr.flush()
            report *= 3


def main(argv):
    pid, timeout, signum, who = (int(argv[0]), float(argv[1]), int(argv[2]),
                                 argv[3])
    peers = argv[4:]
    if _wait(timeout, who, peers):
        return 0  # closed: start-up done (or the worker is gone)
    sys.stderr.write(f"tfscale: {who} could not start the cluster "
                     f"within {timeout:g}s ({_unanswered(peers)}); exit "
                     f"{signum if signum != signal.SIGKILL else 137}\n")
    sys.stderr.flush()
    try:
        os.kill(pid, signum)
        deadline = time.monotonic() + KILL_AFTER_SECONDS
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
