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

# What a preempted worker prints (after its "tfscale: " prefix) once the
# checkpoint of the agreed step is complete on disk, followed by its path:
# a launcher that has to SIGKILL a worker slow to exit after that can tell
# a whole checkpoint from a missing one by looking at those files.
CHECKPOINT_COMPLETE = "preemption checkpoint complete:"

# A worker that stopped on a setting it cannot run with (a flag, a
# configuration, its input files: a one-line error naming the culprit)
# exits with this code (a shell's and argparse's code for misuse). Another
# attempt would fail alike: launchers do not restart such a job.
CONFIG_ERROR_EXIT_CODE = 2

# A worker whose cluster did not start within its connect timeout (a peer
# that never came up, a stale TF_CONFIG) exits with this code, after a line
# naming the peers that do not answer. Not 137: schedulers read 137 as an
# out-of-memory kill. TensorFlow holds the GIL while it waits for peers, so
# the worker's watchdog process ends it with this real-time signal, whose
# handler is the C library's `_exit` (the code is the signal's number:
# `tfscale/cluster/watchdog.py`). Launchers restart it (a peer on another
# host may only have been slow).
STARTUP_TIMEOUT_EXIT_CODE = 40

# What a launcher exits with when a worker hung (alive, but no heartbeat
# within its phase's timeout, or stopped: SIGSTOP) and no restart was left
# (GNU timeout's code for "timed out").
HUNG_EXIT_CODE = 124

# The folder a launcher gives its workers for their heartbeats: each writes
# `worker-<index>` there (`tfscale/cluster/heartbeat.py`) with the phase it
# is in, its step and how long its last step or phase took, and the
# launcher names a worker silent past its phase's timeout
# (`launch/hangs.py`).
HEARTBEAT_DIR_ENV = "TFSCALE_HEARTBEAT_DIR"


def heartbeat_path(folder: str, index: int) -> str:
    """Worker `index`'s heartbeat file in `folder`."""
    return f"{folder.rstrip('/')}/worker-{index}"


# The tf.data service dispatcher (HOST:PORT) the entry points read their
# training records from; `launch.local --data_service_workers K` sets it.
DATA_SERVICE_ADDRESS_ENV = "TFSCALE_DATA_SERVICE"

# Set to "1" for workers that share the host's GPUs (`launch.local
# --share_gpus`): their all-reduce takes the gRPC ring, since NCCL refuses
# two ranks on one GPU (`tfscale/cluster/all_reduce_impl.py`).
SHARED_GPUS_ENV = "TFSCALE_SHARED_GPUS"

# Set to "1" for workers whose launcher gave each its own GPUs through
# `CUDA_VISIBLE_DEVICES` (`launch.local`'s binding, `python -m launch.gpus`):
# such a worker keeps every GPU it sees (`tfscale/cluster/gpu_binding.py`).
GPUS_BOUND_ENV = "TFSCALE_GPUS_BOUND"

# Where launchers and MPI libraries put a process's index on its host (the
# "local rank"), and how many processes share the host, first set first.
LOCAL_RANK_VARIABLES = ("TFSCALE_LOCAL_INDEX", "OMPI_COMM_WORLD_LOCAL_RANK",
                        "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID")
LOCAL_SIZE_VARIABLES = ("TFSCALE_LOCAL_WORKERS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                        "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE",
                        "SLURM_NTASKS_PER_NODE")


def local_rank(env) -> int:
    """This process's index on its host, from the first of
    `LOCAL_RANK_VARIABLES` that is set (0 when none is)."""
    for name in LOCAL_RANK_VARIABLES:
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    return 0


def local_workers(env):
    """How many processes share this host, when a launcher says so (None
    when none does)."""
    for name in LOCAL_SIZE_VARIABLES:
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    return None


def nvidia_smi_listing(nvidia_smi: str = "nvidia-smi"):
    """`nvidia-smi -L` run and parsed (`parse_nvidia_smi_listing`), or None
    where it cannot be run or fails (no driver, no such program, 30 s
    without an answer). The one place either the launcher or a worker asks
    the driver which GPUs a host has."""
    import subprocess
    try:
        listing = subprocess.run([nvidia_smi, "-L"], capture_output=True,
                                 text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listing.returncode != 0:
        return None
    return parse_nvidia_smi_listing(listing.stdout)


def parse_nvidia_smi_listing(text: str):
    """[(CUDA index as a string, UUID or None)] of `nvidia-smi -L`'s lines
    ("GPU 0: NVIDIA H200 (UUID: GPU-5f0e...)"); MIG lines are skipped."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("GPU "):
            continue
        index = line.split(":", 1)[0].split()[1]
        uuid = None
        if "(UUID: " in line:
            uuid = line.rsplit("(UUID: ", 1)[1].split(")", 1)[0].strip()
        found.append((index, uuid))
    return found


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
    "heartbeat_timeout_seconds": (1.0, DAY_SECONDS, None),
    "grace_seconds": (0.0, DAY_SECONDS, None),
    "failure_grace_seconds": (0.0, DAY_SECONDS, None),
    "restart_backoff_seconds": (0.0, DAY_SECONDS, None),
    "max_backoff_seconds": (0.0, DAY_SECONDS, None),
    "hang_floor_seconds": (0.1, DAY_SECONDS, None),
    "hang_ceiling_seconds": (0.1, 7 * DAY_SECONDS, None),
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
