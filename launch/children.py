"""How the launchers start their child processes (no TensorFlow here)."""

import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when its launcher dies.

    Children run in their own session (so a signal to the child reaches its
    own children too), which also means nothing would end them if the
    launcher itself were killed: they would hold ports, cores and GPUs.
    Linux's parent-death signal closes that gap; elsewhere nothing is set.
    """
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(1)


# `preexec_fn` for subprocess.Popen: the parent-death signal on Linux.
PREEXEC = die_with_parent if sys.platform == "linux" else None


def describe_exit(code: int) -> str:
    """"exit code 3" or "killed by SIGKILL" for a process return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def shell_code(code: int) -> int:
    """A process return code as a shell exit status (signal N -> 128+N)."""
    return 128 - code if code < 0 else code
