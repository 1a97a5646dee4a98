"""`SignalWatch`: records SIGTERM, SIGUSR1 and Ctrl-C while a run is
active, for the run to act on at a point every worker agrees on (the
Trainer's step, `model.fit`'s batch end: `tfscale/resume/preemption.py`,
`tfscale/keras/fit_preemption.py`); a helper thread can end the process at
once in a phase where waiting would change nothing on disk.
"""

import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

INTERRUPTED_EXIT_CODE = 128 + int(signal.SIGINT)


# What asks a run to save and exit: SIGTERM (Kubernetes, SLURM at the end
# of a job, a user); SIGUSR1 (SLURM's `--signal=USR1@SECONDS` warning, and
# what tfscale's MPI launchers send: mpirun forwards SIGUSR1 to every rank on
# every host, but ends the ranks itself on SIGTERM, before they can save).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class _State:
    """What the signals asked, shared by nested watches."""

    def __init__(self):
        self.requested = False
        self.interrupted = False
        self.signal = None        # the first one's name
        self.at_once = None       # (fn(signal name) -> (line, code)) or None
        self.sigints = 0          # seen by the helper thread


class SignalWatch:
    """Records a preemption signal while active (a context manager).

    Ctrl-C (SIGINT) is recorded too, as `interrupted`: the run saves and
    stops at the agreed step like a preemption, then raises
    `KeyboardInterrupt` instead of `Preempted`. Python's own handler would
    raise it wherever the main thread happens to be, also inside a
    callback TensorFlow runs from C++ (a checkpoint's), where it can be
    swallowed and the run goes on; a second Ctrl-C ends the process at once
    (exit 130). Where SIGINT is ignored (a shell's background job), it
    stays ignored.

    A watch entered while another is active (a job's around its fit's)
    shares it: what either records, both see.

    Only the main thread can install signal handlers; elsewhere it watches
    nothing and `requested` stays False.
    """

    def __init__(self, signals=PREEMPTION_SIGNALS):
        self._signals = signals
        self._previous = {}
        self._state = _State()
        self._wakeup = None  # (read fd, write fd, previous wakeup fd)

    @property
    def requested(self) -> bool:
        """A preemption signal or Ctrl-C arrived."""
        return self._state.requested

    @property
    def interrupted(self) -> bool:
        """It was Ctrl-C."""
        return self._state.interrupted

    @property
    def signal_name(self) -> str:
        return self._state.signal or "SIGTERM"

    def _handler(self, signum, frame):
        del frame
        state = self._state
        if signum == signal.SIGINT:
            if state.interrupted:
                if self._wakeup is not None:
                    time.sleep(2)  # the helper thread ends the process
                raise KeyboardInterrupt
            state.interrupted = True
        state.signal = state.signal or signal.Signals(signum).name
        state.requested = True

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        outer = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        if isinstance(outer, SignalWatch):
            self._state = outer._state  # nested: one state, one handler
            return self
        watched = list(self._signals)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            watched.append(signal.SIGINT)  # (a background job ignores it)
        for sig in watched:
            self._previous[sig] = signal.signal(sig, self._handler)
        self._start_helper(watched)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else
                          signal.SIG_DFL)
        self._previous = {}
        if self._wakeup is not None:
            read_fd, write_fd, previous = self._wakeup
            self._wakeup = None
            signal.set_wakeup_fd(previous)
            os.close(write_fd)  # the helper reads the end and leaves

    def exit_at_once(self, say: Optional[Callable[[str], tuple]]) -> None:
        """From now on (until called with None), a preemption signal or
        Ctrl-C ends the process at once from the helper thread, even while
        the main thread is inside TensorFlow: `say(signal name)` gives (the
        line to print, the exit code). For a phase in which waiting would
        change nothing on disk (a fit's start, until its first call ends).
        A signal that came before ends it now."""
        self._state.at_once = say
        if say is not None and self._state.requested:
            _exit_now(*say(self.signal_name))

    # ---- the helper thread ------------------------------------------------

    def _start_helper(self, watched) -> None:
        """A thread woken by the C-level handler (`signal.set_wakeup_fd`)
        for each signal, while Python's handlers wait for the main thread.
        Not where another wakeup fd is in use (an event loop's)."""
        if hasattr(sys, "ps1") or sys.flags.interactive or (
                "IPython" in sys.modules):
            return  # a REPL's or notebook's Ctrl-C interrupts, never exits
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd,
                                            warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
            return
        if previous != -1:  # someone else's: leave it theirs
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup = (read_fd, write_fd, previous)
        numbers = {int(s) for s in watched}
        threading.Thread(target=self._helper, args=(read_fd, numbers),
                         name="tfscale-signal-watch", daemon=True).start()

    def _helper(self, read_fd: int, numbers: set) -> None:
        state = self._state
        try:
            while True:
                data = os.read(read_fd, 64)
                if not data:
                    return
                for number in data:
                    if number not in numbers:
                        continue
                    name = signal.Signals(number).name
                    if number == signal.SIGINT:
                        state.sigints += 1
                        if state.sigints >= 2:
                            _exit_now("tfscale: a second Ctrl-C: stopped at "
                                      "once", INTERRUPTED_EXIT_CODE)
                    say = state.at_once
                    if say is not None:
                        line, code = say(name)
                        _exit_now(line, code)
        finally:
            os.close(read_fd)


def _exit_now(line: str, code: int) -> None:
    """Prints `line` and ends the process with `code`, from any thread,
    without Python's exit (which would wait for the main thread)."""
    from tfscale.cluster import fail_fast
    sys.stderr.write(line + "\n")
    fail_fast.flush()
    os._exit(code)
