"""Start-up watchdog, run as a separate process by tfscale.cluster.environment.

    python watchdog.py PID TIMEOUT WORKER_INDEX [PEER ...]

Waits for its standard input to close (the worker finished start-up, or
died). If TIMEOUT seconds pass first, it names the peers that do not accept
TCP connections and kills PID. A process, not a thread: while TensorFlow
waits for peers it holds the GIL, so no Python thread or signal handler in
the worker runs, and the worker ignores SIGTERM. Standard library only (it
must start in milliseconds and never import TensorFlow).
"""

import os
import select
import signal
import socket
import sys


def reachable(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def main(argv):
    pid, timeout, index = int(argv[0]), float(argv[1]), argv[2]
    peers = argv[3:]
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if ready:
        return 0  # closed: start-up done (or the worker is gone)
    dead = [p for p in peers if not reachable(p)]
    if not peers:  # MPI ranks: the launcher knows the addresses, not us
        detail = "the other ranks did not all start: --start-timeout"
    elif dead:
        detail = f"unreachable peer(s): {', '.join(dead)}"
    else:
        detail = "all peers accept connections but did not join"
    sys.stderr.write(f"tfscale: {index} could not start the cluster "
                     f"within {timeout:g}s ({detail})\n")
    sys.stderr.flush()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
