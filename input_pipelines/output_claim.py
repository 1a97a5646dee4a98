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
    """A claim this process holds."""

    def __init__(self, fd: int, holder: dict):
        self._fd = fd
        self.holder = holder

    def note_plan(self, digest: str) -> None:
        """Adds the plan's digest to what the claim says."""
        self.holder["plan"] = digest[:16]
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
    os.makedirs(folder, exist_ok=True)
    path = lock_path(folder, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read(fd)
                raise ClaimError(
                    f"{os.path.join(folder, name)}*: another writer is "
                    f"writing this output now: "
                    f"{describe(holder) if holder else 'a writer'} (its "
                    f"claim: {path}); wait for it to end or stop it, or "
                    "write elsewhere") from None
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
                         "started": time.time(), "tool": tool})
        _write(fd, held.holder)
        try:
            yield held
        finally:
            os.ftruncate(fd, 0)  # released: nothing to take over
    finally:
        os.close(fd)  # drops the lock
