"""Preemption: SIGTERM (or SIGUSR1) -> an agreed step -> a checkpoint -> exit 143.

SLURM and Kubernetes send SIGTERM some seconds before they kill a job. Under
MultiWorkerMirroredStrategy TensorFlow's coordination service catches it and,
unless something consumes the notice, training goes on until the SIGKILL
(docs/facts.md, fact 19); a single-worker process simply dies.

The Trainer consumes it without an extra collective: `SignalWatch` replaces
the handler while `fit` runs and only records the signal. A call of the
compiled step runs several steps with no host read between them, so the
signal is seen when the call in flight ends, and calls are bounded in wall
time (`TrainConfig.max_call_seconds`, `step/pace.py`) so that this is
seconds away at any steps per call. Each step's all-reduce carries every
worker's flags next to the loss (see `step/train_step.py`): the next call's
first step tells every worker, at the same step; all save a checkpoint
there and raise `Preempted`, a `SystemExit` with `PREEMPTED_EXIT_CODE`: an
uncaught one ends the process with that code and the launcher restarts the
job, which resumes from that checkpoint. With t the step time and S the
save, the signal is saved within about max(bound, t) + t + S (one worker:
without the t), docs/checkpoints.md.

TensorFlow's `PreemptionCheckpointHandler` does the same with its own
checkpoint manager and an extra coordination-service round trip per step;
this keeps tfscale's single checkpoint (with the input state) and costs
nothing per step.
"""

import signal
import threading

from tfscale.cluster.contract import PREEMPTED_EXIT_CODE  # noqa: F401 (re-exported)


class Preempted(SystemExit):
    """Raised by `Trainer.fit` after saving the checkpoint of a preemption."""

    def __init__(self, step: int, checkpoint: str = None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.checkpoint = checkpoint

    def __str__(self):
        return (f"preempted: checkpoint at step {self.step} saved"
                f"{' to ' + self.checkpoint if self.checkpoint else ''}")


# What asks a run to save and exit: SIGTERM (Kubernetes, SLURM at the end
# of a job, a user); SIGUSR1 (SLURM's `--signal=USR1@SECONDS` warning, and
# what tfscale's MPI launchers send: mpirun forwards SIGUSR1 to every rank on
# every host, but ends the ranks itself on SIGTERM, before they can save).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class SignalWatch:
    """Records a preemption signal while active (a context manager).

    Ctrl-C (SIGINT) is recorded too, as `interrupted`: the run saves and
    stops at the agreed step like a preemption, then raises
    `KeyboardInterrupt` instead of `Preempted`. Python's own handler would
    raise it wherever the main thread happens to be, also inside a
    callback TensorFlow runs from C++ (a checkpoint's), where it can be
    swallowed and the run goes on; a second Ctrl-C raises it at once.
    Where SIGINT is ignored (a shell's background job), it stays ignored.

    Only the main thread can install signal handlers; elsewhere it watches
    nothing and `requested` stays False.
    """

    def __init__(self, signals=PREEMPTION_SIGNALS):
        self._signals = signals
        self._previous = {}
        self.requested = False
        self.interrupted = False

    def _handler(self, signum, frame):
        del frame
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            watched = list(self._signals)
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                watched.append(signal.SIGINT)  # (a background job ignores it)
            for sig in watched:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else
                          signal.SIG_DFL)
        self._previous = {}
