"""A SIGTERM is honoured within a bounded time at Google's 1,000 steps per
call, on every layout a job meets: one worker, two workers over
MultiWorkerMirroredStrategy (gRPC), two MPI ranks, and the GPU layout (the
step one XLA program, tf.distribute's GPU branch, `tests/gpu_branch.py`).

Each run is real processes through `launch.local`: the Trainer worker
(`tests/workers/train_worker.py`) with batches at least 20 ms apart, calls
of up to 1,000 steps bounded at 0.3 s (`TrainConfig.max_call_seconds`).
SIGTERM goes to the last worker once the run is past its first calls; the
checkpoint must land within a few calls' steps of the signal (the calls
are ~15 steps), where without the bound the call in flight runs the
epoch's remaining steps and no preemption happens at all. The job is then
started again, resumes, and must end bit-identical to an uninterrupted run.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO
from tests.test_launch import processes_mentioning

pytestmark = pytest.mark.slow

STEPS = 90
BOUND = 0.3  # seconds per call
LATE = 0.02  # seconds between batches: a step of at least 20 ms

LAYOUTS = {
    "1 worker": (1, []),
    "2 workers": (2, []),
    "2 workers, MPI": (2, ["--backend", "mpi"]),
    "1 worker, GPU layout": (1, ["--gpu_branch", "--xla"]),
}
# Layouts whose uninterrupted runs end bit-identical (gRPC and MPI sum the
# same gradients alike: tests/test_mpi.py) share one.
SAME_RUN = {"2 workers, MPI": "2 workers"}


def command(layout, out, *extra):
    workers, worker_args = LAYOUTS[layout]
    mpi = ["--backend", "mpi"] if "mpi" in worker_args else []
    return [sys.executable, "-m", "launch.local", "--num_workers",
            str(workers), "--threads_per_worker", "1", *mpi, "--",
            sys.executable, "-m", "tests.workers.train_worker", "--out",
            str(out), "--steps", str(STEPS), "--steps_per_execution", "1000",
            "--log_steps", "1000", "--max_call_seconds", str(BOUND),
            "--slow_input", str(LATE), "--optimizer", "adamw",
            "--checkpoint_dir", str(out / "ckpt"), *worker_args, *extra]


def run(args, timeout=300):
    proc = subprocess.run(args, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def last_worker(marker, workers):
    """The pid of the highest-indexed worker of the run named by `marker`
    (launch.local's TFSCALE_WORKER_INDEX, mpirun's OMPI_COMM_WORLD_RANK)."""
    wanted = {f"TFSCALE_WORKER_INDEX={workers - 1}".encode(),
              f"OMPI_COMM_WORLD_RANK={workers - 1}".encode()}
    for pid in processes_mentioning(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"launch.local" in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if wanted & set(f.read().split(b"\0")):
                    return pid
        except OSError:
            continue
    return None


def saved_step(out):
    import tensorflow as tf
    path = tf.train.latest_checkpoint(str(out / "ckpt"))
    return int(tf.train.load_checkpoint(path).get_tensor(
        "step/.ATTRIBUTES/VARIABLE_VALUE"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each layout's run without a signal (started lazily): its weights."""
    runs = {}

    def get(layout):
        layout = SAME_RUN.get(layout, layout)
        if layout not in runs:
            whole = tmp_path_factory.mktemp("whole")
            code, output = run(command(layout, whole))
            assert code == 0, output[-5000:]
            assert saved_step(whole) == STEPS
            runs[layout] = np.load(whole / "weights_0.npz")
        return runs[layout]
    return get


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sigterm_mid_call_saves_within_a_few_steps_and_resumes_exactly(
        layout, uninterrupted, tmp_path):
    workers = LAYOUTS[layout][0]

    out = tmp_path / "preempted"
    out.mkdir()
    progress = out / "progress"
    proc = subprocess.Popen(
        command(layout, out, "--progress", str(progress)), cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    # Past the first calls (one step each, then growing): the step the
    # last call ended at, then SIGTERM during the next. (Polling a file
    # the run writes, not timing the run.)
    deadline = time.monotonic() + 200
    ends = []
    while not ends or ends[-1] < 25:
        assert time.monotonic() < deadline and proc.poll() is None, \
            proc.communicate()[0][-5000:]
        time.sleep(0.05)
        if progress.exists():
            ends = [int(v) for v in progress.read_text().split()]
    before = ends[-1]
    os.kill(last_worker(str(out), workers), signal.SIGTERM)
    signalled = time.monotonic()
    output, _ = proc.communicate(timeout=200)
    assert proc.returncode == 143, output[-5000:]
    step = saved_step(out)
    # The call in flight (~15 steps of 20 ms at 0.3 s; while calls grow up
    # to twice a measured one), one step to tell every worker, the save.
    assert before < step <= before + 35, (before, step, output[-3000:])
    assert "preempted (SIGTERM): saved step" in output or \
        "preempted (SIGUSR1): saved step" in output, output[-3000:]
    assert time.monotonic() - signalled < 60  # leaving, not training on
    # No worker reports a collective it lost: a clean preemption is quiet.
    assert "StartAbort" not in output and "have crashed" not in output, \
        output[-5000:]

    code, output = run(command(layout, out))
    assert code == 0, output[-5000:]
    assert "resumed from" in output and f"at step {step}" in output, \
        output[-3000:]
    assert saved_step(out) == STEPS
    a, b = uninterrupted(layout), np.load(out / "weights_0.npz")
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
