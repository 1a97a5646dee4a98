"""The contract between the launchers and the workers: the exit code of a
preempted worker, the environment variable that names the data service, the
start-up lines to drop.

Both sides import these names from here. The module imports nothing, so
`launch/`, which never loads TensorFlow, reads it without loading the engine
(importing `tfscale` and `tfscale.cluster` loads nothing either).
"""

# A worker that saved a checkpoint after SIGTERM exits with this code
# (TensorFlow's restartable exit code, and what a shell reports for a
# process ended by SIGTERM). Launchers restart such a job.
PREEMPTED_EXIT_CODE = 143

# A worker that stopped on a setting it cannot run with (a flag, a
# configuration, its input files: a one-line error naming the culprit)
# exits with this code (a shell's and argparse's code for misuse). Another
# attempt would fail alike: launchers do not restart such a job.
CONFIG_ERROR_EXIT_CODE = 2

# The tf.data service dispatcher (HOST:PORT) the entry points read their
# training records from; `launch.local --data_service_workers K` sets it.
DATA_SERVICE_ADDRESS_ENV = "TFSCALE_DATA_SERVICE"

# Lines TensorFlow prints on every start on a host without a GPU (and
# cannot be told not to): the entry points and the data service's log pump
# drop them.
CPU_HOST_NOISE = ("cuInit", "cudart_stub.cc", "cpu_feature_guard.cc",
                  "To enable the following instructions",
                  "All log messages before absl::InitializeLog",
                  "Unable to register cu", "computation_placer.cc")
