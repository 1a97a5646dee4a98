"""Free ports on this host, held for as long as a job needs them.

A port found free (bound to port 0, then closed) is free only until someone
else takes it. A launcher hands its workers their ports seconds before their
servers bind them (after TensorFlow's import), so two launchers started on
one host at the same time could hand out the same port: one job's worker
then fails at start with "address already in use".

`lease` closes that window between launchers. Each port it returns is locked
(`fcntl.flock` on a file named after the port, in one folder under the
temporary directory) until the lease is closed or its process ends; the
kernel drops the lock of a launcher killed with -9. A port whose lock
another live lease holds is skipped. Where that folder cannot be written (a
read-only temporary directory), a lease is the plain search. The lock files
stay (empty, one per port number ever leased): removing one while another
launcher holds it would let a third take the port.

Never imports TensorFlow.
"""

import contextlib
import os
import socket
import tempfile
from typing import List, Optional

try:
    import fcntl
except ImportError:  # not POSIX: no locks, the plain search
    fcntl = None

# Ports to try per port asked for before giving up (a port can be skipped
# because another lease holds it).
TRIES_PER_PORT = 64


def find_free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """`count` distinct ports that were free a moment ago (nothing held)."""
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


def taken(ports_: List[int], host: str = "127.0.0.1") -> List[int]:
    """Those of `ports_` another program listens on now (a port in
    TIME_WAIT, left by a worker that just exited, is not taken)."""
    busy = []
    for port in ports_:
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            busy.append(port)
        finally:
            probe.close()
    return busy


def lock_folder() -> str:
    """Where the leases' lock files are: one folder for the host's users."""
    return os.path.join(tempfile.gettempdir(), "tfscale-ports")


class Lease:
    """`ports`, held by this process until `close()` (a context manager)."""

    def __init__(self, ports: List[int], locks: List[int]):
        self.ports = list(ports)
        self._locks = list(locks)

    def close(self) -> None:
        for fd in self._locks:
            os.close(fd)  # drops the flock
        self._locks = []

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def lease(count: int, host: str = "127.0.0.1",
          folder: Optional[str] = None) -> Lease:
    """`count` distinct free ports, none of them held by another lease.

    Args:
        count: How many ports.
        host: The address they must be free on.
        folder: The lock files' folder (default `lock_folder()`).

    Raises:
        RuntimeError: `count` ports could not be found (every port found
            free was held by another lease, `TRIES_PER_PORT` times each).
    """
    folder = _usable(folder or lock_folder())
    ports, locks = [], []
    try:
        for _ in range(count * TRIES_PER_PORT):
            if len(ports) == count:
                break
            port = find_free_ports(1, host)[0]
            if port in ports:
                continue
            fd = _lock(folder, port)
            if fd is False:
                continue  # another live lease holds it
            ports.append(port)
            if fd is not None:
                locks.append(fd)
        if len(ports) < count:
            raise RuntimeError(
                f"found {len(ports)} of {count} free ports on {host}: the "
                f"others were held by other launchers (locks in {folder})")
    except BaseException:
        for fd in locks:
            os.close(fd)
        raise
    return Lease(ports, locks)


def _usable(folder: str) -> Optional[str]:
    """`folder`, made if missing (open to every user, as /tmp is); None
    where it cannot be."""
    if fcntl is None:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        with contextlib.suppress(OSError):  # another user's folder
            os.chmod(folder, 0o1777)
        return folder if os.access(folder, os.W_OK | os.X_OK) else None
    except OSError:
        return None


def _lock(folder: Optional[str], port: int):
    """An open descriptor holding `port`'s lock; False: another process
    holds it; None: no lock could be taken (no folder, or a file another
    user made and this one cannot open), the port is used unheld."""
    if folder is None:
        return None
    try:
        fd = os.open(os.path.join(folder, f"{port}.lock"),
                     os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    return fd
