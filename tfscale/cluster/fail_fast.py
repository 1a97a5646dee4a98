"""One failed worker ends the job at once, on either backend.

Data-parallel workers depend on each other at every step. When one of them
dies of a Python exception, the others cannot go on; what matters is that
they learn it at once rather than after a timeout:

  - MPI: a rank that leaves through Python's normal exit calls
    `MPI_Finalize`, which waits for the others; they wait in their next
    `Allreduce` for it. Nothing ends the job until the collective timeout
    (300 s by default; docs/facts.md, fact 24). `MPI_Abort` instead makes the
    launcher (mpirun, srun) end every rank.
  - MultiWorkerMirroredStrategy: a failed worker that goes through Python's
    normal exit runs TensorFlow's teardown, which can block for tens of
    seconds (fact 21) while its peers wait in a collective for it. Leaving
    with `os._exit` closes its sockets at once: the peers' collectives fail
    and the launcher (`launch.local`, SLURM, Kubernetes) sees the exit.

`install` puts that behaviour into `sys.excepthook` (the traceback is
printed first, then one line naming the worker and the error), so a user's
own script gets it from the Trainer or `hvd.init()` without a `try`. The
entry points do the same through `tfscale.cli.leave`. What was written is already
on disk by then: `Trainer.fit` closes the callbacks' writers when it
unwinds (see `callback_files.close_writers`).
"""

import logging
import os
import re
import sys

from tfscale.cluster.contract import (CONFIG_ERROR_EXIT_CODE,
                                      PREEMPTED_EXIT_CODE)
from tfscale.errors import ConfigError, chain_excepthook

# Marks the hook this module installed, so installing twice is a no-op.
_MARK = "_tfscale_fail_fast"


# Lines of TensorFlow's error texts that say where, not what; and the
# "(0) INVALID_ARGUMENT: " prefix of each root error of a compiled call.
_WHERE = re.compile(r"^(Graph execution error:|Detected at node|File \"|"
                    r"Additional GRPC error|The error could be from|\[\[|"
                    r"<stack traces unavailable>|\d+ root error\(s\) found|"
                    r"\d+ successful operations|\d+ derived errors)")
_ROOT = re.compile(r"^\(\d+\) [A-Z_]+:\s*")
_MAX_CHARS = 300


def cause(message: str) -> str:
    """The first line of an error message that says what went wrong
    (TensorFlow's errors open with where it was detected, the Python stack
    of the op and, from a compiled call, root-error counts), without
    TensorFlow's op tags."""
    lines = [_ROOT.sub("", line.strip()) for line in str(message).splitlines()]
    said = [line for line in lines if line and not _WHERE.match(line)]
    text = said[0] if said else ""
    text = re.sub(r"\s*\[Op:[^\]]*\]", "",
                  re.sub(r"\{\{[^}]*\}\}\s*", "", text)).strip()
    if len(text) > _MAX_CHARS:
        text = text[:_MAX_CHARS - 3] + "..."
    return text


def error_line(kind, value) -> str:
    """`Kind: message` on one line (`cause`)."""
    message = cause(str(value))
    return f"{kind.__name__}: {message}" if message else kind.__name__


_PEER = re.compile(r"/job:worker/replica:\d+/task:(\d+)")


def failed_peers(value, own: str) -> list:
    """The workers a collective's error names (`/job:worker/.../task:N`,
    the peer whose connection broke or that stopped sending heartbeats),
    as "worker N", this process (`own`) left out."""
    peers = []
    for index in _PEER.findall(str(value)):
        name = f"worker {index}"
        if name != own and name not in peers:
            peers.append(name)
    return peers


def install(who: str, abort=None) -> None:
    """Makes an uncaught exception end this worker (and so the job) at once.

    Does nothing in an interactive session (a REPL calls the hook for every
    error typed at the prompt) or when already installed.

    Args:
        who: How the last line names this process ("worker 1", "rank 1").
        abort: `fn(code)` that ends the job (MPI: `comm.Abort`); None:
            this process leaves with `os._exit`.
    """
    def make_hook(previous):
        def hook(kind, value, traceback):
            previous(kind, value, traceback)
            peers = failed_peers(value, who)
            lost = f" (lost peer: {', '.join(peers)})" if peers else ""
            sys.stderr.write(f"tfscale: {who} failed: "
                             f"{error_line(kind, value)}{lost}; ending the "
                             "job\n")
            # A setting a restart would meet again: the code launchers do
            # not restart.
            end(CONFIG_ERROR_EXIT_CODE if issubclass(kind, ConfigError)
                else 1, abort)
        return hook
    chain_excepthook(_MARK, make_hook)


def end(code: int, abort=None) -> None:
    """Flushes Python's streams and logging, then ends this process with
    `code` (through `abort(code)` when given). Never returns."""
    flush()
    if abort is not None:
        abort(code)
    os._exit(code)


def flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()


def mpi_world():
    """`MPI.COMM_WORLD` if this process initialized MPI with other ranks
    (and has not finalized it), else None. Never starts MPI."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD if mpi.COMM_WORLD.size > 1 else None


def leave(code: int) -> None:
    """The last call of a worker process: exits with `code` once Python's
    streams and logging are flushed, without tearing TensorFlow down.

    Under MPI with other ranks, a clean end (0) or a preemption (143, which
    every rank reaches together) finalizes MPI, which mpirun expects of
    every rank; any other code aborts the job, since the other ranks would
    otherwise wait for this one in their next collective.
    """
    comm = mpi_world()
    if comm is not None:
        if code in (0, PREEMPTED_EXIT_CODE):
            flush()
            sys.modules["mpi4py.MPI"].Finalize()
        else:
            end(code, comm.Abort)
    end(code)
