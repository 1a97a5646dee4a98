"""Start a job, read what it said: the benchmarks' one harness.

    job = Job("w1", command, out_dir, env={...}).start()
    job.wait(timeout)                 # exit code, or "timeout" (killed)
    job.intervals()                   # {step: (loss, examples/s, step ms)}
    job.placement()                   # the banner's placement line
    job.signal_worker(1, SIGTERM)     # a worker of a launch.local job
    weights(run_dir), compare(a, b)   # the latest checkpoint's model weights

A job is a subprocess whose output goes to `<out_dir>/<name>.log`; what it
printed is read back from there (the interval lines of the Trainer's log,
the start banner's lines, the launcher's).
"""

import os

from launch import runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Job(runs.Job):
    """`launch.runs.Job` run in the checkout, which it puts on PYTHONPATH
    (the benchmarks are not installed)."""

    def __init__(self, name: str, command, out_dir: str, env=None):
        env = dict(env or {})
        env["PYTHONPATH"] = REPO + os.pathsep + env.get(
            "PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        super().__init__(name, command, out_dir, env, cwd=REPO)


def weights(run_dir: str) -> dict:
    """The model's weights in `run_dir`'s latest checkpoint."""
    from tfscale.resume import compare as compare_lib
    return compare_lib.weights(run_dir)


def compare(a: dict, b: dict) -> dict:
    """The largest difference relative to each tensor's largest value, and
    whether every tensor is bit-identical."""
    from tfscale.resume import compare as compare_lib
    found = compare_lib.compare(a, b)
    found.pop("tensors")
    return found
