"""Preemption: SIGTERM (or SIGUSR1) -> an agreed step -> a checkpoint -> exit 143.

SLURM and Kubernetes send SIGTERM some seconds before they kill a job. Under
MultiWorkerMirroredStrategy TensorFlow's coordination service catches it and,
unless something consumes the notice, training goes on until the SIGKILL
(docs/facts.md, fact 19); a single-worker process simply dies.

The Trainer consumes it without an extra collective: `SignalWatch` replaces
the handler while `fit` (or `evaluate`, or a whole job) runs and only
records the signal. A call of the compiled step runs several steps with no
host read between them, so the signal is seen when the call in flight
ends, and calls are bounded in wall time (`TrainConfig.max_call_seconds`,
`step/pace.py`) so that this is seconds away at any steps per call. Each
step's all-reduce carries every worker's flags next to the loss (see
`step/train_step.py`), and so does each evaluation batch's: every worker
learns of the signal at the same step (or batch), all save a checkpoint
there and raise `Preempted`, a `SystemExit` with `PREEMPTED_EXIT_CODE`
once the checkpoint is on disk: an uncaught one ends the process with that
code and the launcher restarts the job, which resumes from that
checkpoint. With nowhere to save (no checkpoint directory) the code is
`PREEMPTED_UNSAVED_EXIT_CODE`, which launchers do not restart. With t the
step time and S the save, the signal is saved within about max(bound, t) +
t + S (one worker: without the t), docs/checkpoints.md.

Until a fit's first call ends (the restore, tracing, XLA's compilation:
minutes for BERT on a GPU) no step has changed what is on disk since the
checkpoint the fit started from (or the seed's start), and the main thread
is inside TensorFlow, where no Python handler runs. A helper thread woken
through `signal.set_wakeup_fd` then ends the process at once
(`SignalWatch.exit_at_once`): nothing is lost, nothing needs saving. A
second Ctrl-C ends it at once in any phase.

TensorFlow's `PreemptionCheckpointHandler` does the same with its own
checkpoint manager and an extra coordination-service round trip per step;
this keeps tfscale's single checkpoint (with the input state) and costs
nothing per step.
"""

from typing import Optional

from tfscale.cluster.contract import (  # noqa: F401 (re-exported)
    PREEMPTED_EXIT_CODE, PREEMPTED_UNSAVED_EXIT_CODE)
from tfscale.cluster.signal_watch import (  # noqa: F401 (re-exported)
    INTERRUPTED_EXIT_CODE, PREEMPTION_SIGNALS, SignalWatch)

class Preempted(SystemExit):
    """Raised after a preemption: the checkpoint of the agreed step is on
    disk (exit code 143), or there was nowhere to save it (no checkpoint
    directory: exit code `PREEMPTED_UNSAVED_EXIT_CODE`, not restarted).

    Attributes:
        step: The step the run stopped at.
        checkpoint: The checkpoint saved (the chief's path; None on the
            other workers, and when nothing was saved).
        saved: Whether the run's state at `step` is on disk.
    """

    def __init__(self, step: int, checkpoint: str = None, saved: bool = True):
        super().__init__(PREEMPTED_EXIT_CODE if saved
                         else PREEMPTED_UNSAVED_EXIT_CODE)
        self.step = step
        self.checkpoint = checkpoint
        self.saved = saved

    def __str__(self):
        if not self.saved:
            return (f"preempted at step {self.step}: no checkpoint "
                    "directory: nothing saved")
        return (f"preempted: checkpoint at step {self.step} saved"
                f"{' to ' + self.checkpoint if self.checkpoint else ''}")


def checkpoint_on_disk(path: Optional[str]) -> bool:
    """Whether the checkpoint `path` (a prefix) is complete on disk: its
    index, which TensorFlow writes after its data, is there."""
    import tensorflow as tf
    return bool(path) and tf.io.gfile.exists(path + ".index")
