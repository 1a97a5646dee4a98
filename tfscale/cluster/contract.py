"""The contract between the launchers and the workers: the exit codes of a
preempted worker (saved or not), the line that says its checkpoint is
complete, the ranges of the durations both take (`seconds_problem`), the
environment variable that names the data service, the start-up lines to
drop.

Both sides import these names from here. The module imports nothing, so
`launch/`, which never loads TensorFlow, reads it without loading the engine
(importing `tfscale` and `tfscale.cluster` loads nothing either).
"""

# A worker that saved a checkpoint after SIGTERM exits with this code
# (TensorFlow's restartable exit code, and what a shell reports for a
# process ended by SIGTERM). Launchers restart such a job.
PREEMPTED_EXIT_CODE = 143

# A worker preempted with nowhere to save (no checkpoint directory) exits
# with this code: nothing is saved, so a restart would start over; launchers
# do not restart such a job.
PREEMPTED_UNSAVED_EXIT_CODE = 3

# What a preempted worker prints once the checkpoint of the agreed step is
# complete on disk, followed by its path: a launcher that has to SIGKILL a
# worker slow to exit after that can tell a whole checkpoint from a
# missing one by looking at those files.
CHECKPOINT_COMPLETE = "tfscale: preemption checkpoint complete:"

# A worker that stopped on a setting it cannot run with (a flag, a
# configuration, its input files: a one-line error naming the culprit)
# exits with this code (a shell's and argparse's code for misuse). Another
# attempt would fail alike: launchers do not restart such a job.
CONFIG_ERROR_EXIT_CODE = 2

# The tf.data service dispatcher (HOST:PORT) the entry points read their
# training records from; `launch.local --data_service_workers K` sets it.
DATA_SERVICE_ADDRESS_ENV = "TFSCALE_DATA_SERVICE"

# Set to "1" for workers that share the host's GPUs (`launch.local
# --share_gpus`): their all-reduce takes the gRPC ring, since NCCL refuses
# two ranks on one GPU (`tfscale/cluster/all_reduce_impl.py`).
SHARED_GPUS_ENV = "TFSCALE_SHARED_GPUS"

# Lines TensorFlow prints on every start on a host without a GPU (and
# cannot be told not to): the entry points and the data service's log pump
# drop them.
CPU_HOST_NOISE = ("cuInit", "cudart_stub.cc", "cpu_feature_guard.cc",
                  "To enable the following instructions",
                  "All log messages before absl::InitializeLog",
                  "Unable to register cu", "computation_placer.cc")


# The range of every duration a setting takes, in seconds: (least, most,
# what 0 means or None when 0 is refused). A bound that is not a number,
# endless, negative, or so small or large it cannot be meant is refused
# where it is read, in one line, before anything starts (`inf` once passed
# every check and failed after the first call, restarted each time).
DAY_SECONDS = 86400.0
SECONDS = {
    "max_call_seconds": (0.01, DAY_SECONDS, "no bound"),
    "collective_timeout_seconds": (1.0, 7 * DAY_SECONDS, None),
    "connect_timeout_seconds": (1.0, DAY_SECONDS, None),
    "grace_seconds": (0.0, DAY_SECONDS, None),
    "failure_grace_seconds": (0.0, DAY_SECONDS, None),
    "start_timeout": (1.0, DAY_SECONDS, None),
}


def seconds_problem(setting: str, value, name: str = None):
    """What is wrong with `value` as `setting` (a key of `SECONDS`), in one
    line naming it as `name` (default: the setting) with its unit; None
    when it is in range (or None: not set)."""
    if value is None:
        return None
    least, most, zero = SECONDS[setting]
    name = name or setting
    try:
        number = float(value)
    except (TypeError, ValueError):
        return f"{name} must be a number of seconds, got {value!r}"
    if zero is not None and number == 0:
        return None
    # (NaN equals nothing; inf is outside every range.)
    if least <= number <= most:
        return None
    allowed = f"between {least:g} and {most:g} seconds"
    if zero is not None:
        allowed = f"0 ({zero}) or {allowed}"
    return f"{name} must be {allowed}, got {value!r}"
