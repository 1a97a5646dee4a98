"""One writer at a time per output: a claim on `DIR/.NAME.writer.lock`.

Two writers of one output at once (a requeued SLURM job beside a manual
rerun) would mix two plans' shards under one manifest. A writer therefore
claims its output (the folder and the shards' stem: two outputs in one
folder, `train` and `validation`, may be written at once) before it reads
or changes anything there, and holds the claim until it ends:

    with output_claim.claim(folder, "train", "create_pretraining_data") as held:
        held.note_plan(plan.digest)
        ...

The claim is an exclusive `flock` on the lock file, which the kernel drops
when the holding process ends however it ends (kill -9, OOM), so a claim
never outlives its process; on NFS the server drops the lock of a host that
died when its lease ends (90 s by default). The file names the holder
(host, pid, start time, tool, plan): a second writer refuses at once with
one line naming it. A holder that ended without releasing (killed) left its
name behind: the next writer takes the claim over and says whose it was.
A file system without locks (some FUSE mounts) gets a warning, no claim.

Folders of several users: a folder this user cannot write is one line
naming it. In a shared folder (writable by its group or by all), the claim
file is made writable by all as well, and another user's claim file from
before is locked read-only (a lock needs no write permission): one user's
past run never locks the others out.
"""

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Callable, Iterator, Optional


class ClaimError(ValueError):
    """Another writer holds the output; the message names it."""


def lock_path(folder: str, name: str) -> str:
    return os.path.join(folder, f".{name}.writer.lock")


class Held:
    """A claim this process holds (`writable`: its file names the holder;
    False: another user's file, locked read-only)."""

    def __init__(self, fd: int, holder: dict, writable: bool = True):
        self._fd = fd
        self.holder = holder
        self.writable = writable

    def note_plan(self, digest: str) -> None:
        """Adds the plan's digest to what the claim says."""
        self.holder["plan"] = digest[:16]
        if self.writable:
            _write(self._fd, self.holder)


def _write(fd: int, holder: dict) -> None:
    data = json.dumps(holder).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _read(fd: int) -> Optional[dict]:
    data = os.pread(fd, 1 << 16, 0)
    if not data.strip():
        return None
    try:
        return json.loads(data)
    except ValueError:
        return {"unreadable": data[:80].decode(errors="replace")}


def describe(holder: dict) -> str:
    """The holder in words."""
    if "unreadable" in holder:
        return f"an unknown writer ({holder['unreadable']!r})"
    started = time.strftime("%Y-%m-%d %H:%M:%S",
                            time.localtime(holder.get("started", 0)))
    plan = f", plan {holder['plan']}" if holder.get("plan") else ""
    return (f"{holder.get('tool', 'a writer')} pid {holder.get('pid')} on "
            f"{holder.get('host')} since {started}{plan}")


def _ended(holder: dict) -> bool:
    """Whether the process a claim file names is known to have ended (on
    this host; another host's cannot be asked)."""
    if holder.get("host") != socket.gethostname() or not holder.get("pid"):
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):
        return False
    return False


def shared(folder: str) -> bool:
    """Whether users other than its owner may write in `folder`."""
    return bool(os.stat(folder).st_mode & 0o022)


def _open_claim(folder: str, path: str):
    """(the claim file's descriptor, whether it is writable).

    Raises:
        ClaimError: The folder cannot be made or written by this user.
    """
    cloexec = getattr(os, "O_CLOEXEC", 0)
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | cloexec, 0o644)
    except PermissionError as e:
        if os.path.isdir(folder) and os.access(folder, os.W_OK) and (
                os.path.exists(path)):
            # Another user's claim file in a shared folder.
            return os.open(path, os.O_RDONLY | cloexec), False
        raise ClaimError(
            f"{folder}: this user cannot write there ({e.strerror}): write "
            "the output to a folder you can write") from None
    except OSError as e:
        raise ClaimError(f"{folder}: cannot make or use this folder "
                         f"({e.strerror})") from None
    if shared(folder) and os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, 0o666)  # the next user of the folder may claim it
    return fd, True


@contextlib.contextmanager
def claim(folder: str, name: str, tool: str,
          say: Callable[[str], None] = lambda line: print(
              line, file=sys.stderr)) -> Iterator[Optional[Held]]:
    """Holds the claim on output `name` in `folder` while the block runs.

    Args:
        folder: The output folder (made if missing).
        name: The outputs' stem (`train` of train-00000-of-00004).
        tool: The writer, for the holder's line.
        say: Where the lines about taking over or a missing lock go.

    Raises:
        ClaimError: Another live process holds it (naming it).
    """
    path = lock_path(folder, name)
    fd, writable = _open_claim(folder, path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read(fd)
                who = describe(holder) if holder else "a writer"
                if holder and _ended(holder):
                    # The holder took the claim read-only (another user's
                    # claim file): the file still names whoever wrote it.
                    who = ("a writer that cannot sign the claim file (it "
                           f"names {describe(holder)}, which has ended)")
                raise ClaimError(
                    f"{os.path.join(folder, name)}*: another writer is "
                    f"writing this output now: {who} (its claim: {path}); "
                    "wait for it to end or stop it, or write elsewhere"
                ) from None
            say(f"{tool}: warning: {path}: this file system has no locks "
                f"({e.strerror}): nothing stops a second writer of "
                f"{os.path.join(folder, name)}* from mixing its shards in")
            yield None
            return
        before = _read(fd)
        if before:
            say(f"{tool}: took over the claim on {os.path.join(folder, name)}"
                f"* from {describe(before)}: that writer is gone (killed "
                "before it released it)")
        held = Held(fd, {"host": socket.gethostname(), "pid": os.getpid(),
                         "started": time.time(), "tool": tool}, writable)
        if writable:
            _write(fd, held.holder)
        try:
            yield held
        finally:
            if writable:
                os.ftruncate(fd, 0)  # released: nothing to take over
    finally:
        os.close(fd)  # drops the lock
