"""The launcher's exit code and closing line after a signal, from what the
workers did: their exit codes and the checkpoint they reported complete.

A cluster reads the launcher's exit code (a SLURM script requeues on 143),
so it must tell the truth about the workers:

    every worker 143, a checkpoint reported whole   143  preempted: ckpt-N
    every worker 143, none reported                 143  preempted before
                                                         training on (the
                                                         latest checkpoint
                                                         stands)
    a worker 3 (no checkpoint directory)            3    nothing saved
    a worker with another failure                   its code, named
    every worker 0 (finished within the grace)      0    finished

Never imports TensorFlow.
"""

import os
from typing import Optional, Sequence, Tuple

from tfscale.cluster.contract import (PREEMPTED_EXIT_CODE,
                                      PREEMPTED_UNSAVED_EXIT_CODE)


def after_signal(codes: Sequence[int], saved: Optional[str],
                 signal_code: int) -> Tuple[int, str]:
    """(the launcher's exit code, its closing line) once every worker
    exited by itself after the launcher passed a signal on.

    Args:
        codes: Each worker's exit code, by index (negative: killed by that
            signal, as Python reports it).
        saved: The preemption checkpoint a worker reported complete and
            whose files are whole (`workers.reported_checkpoint`), or None.
        signal_code: 128 + the signal the launcher received.
    """
    unsaved = [i for i, c in enumerate(codes)
               if c == PREEMPTED_UNSAVED_EXIT_CODE]
    if unsaved:
        return PREEMPTED_UNSAVED_EXIT_CODE, (
            f"nothing saved: worker {unsaved[0]} had no checkpoint "
            "directory; a rerun starts over: give the Trainer a "
            "checkpoint_dir (the jobs' --output_dir), model.fit a "
            "keras.callbacks.BackupAndRestore")
    failed = [(i, c) for i, c in enumerate(codes)
              if c not in (0, PREEMPTED_EXIT_CODE)]
    if failed:
        index, code = failed[0]
        return (code if code > 0 else 128 - code), (
            f"worker {index} failed while stopping (exit "
            f"{code if code > 0 else 128 - code}); what it saved is not "
            "known to be whole: see its lines above")
    if all(c == 0 for c in codes):
        return 0, "every worker finished before it had to stop"
    if saved:
        return PREEMPTED_EXIT_CODE, (
            f"preempted: {os.path.basename(saved)} complete on disk "
            f"({saved}); rerun the same command to resume")
    return PREEMPTED_EXIT_CODE, (
        "preempted before training on since the latest checkpoint (none "
        "new written); rerun the same command to resume from it")
