"""The flagship run resumes exactly: run_pretraining.py with BERT (dropout on),
shuffled records made by the writer, 2 workers through launch.local.

A worker is killed from outside (kill -9, then SIGTERM as a scheduler would
send), the launcher restarts the job, and the final checkpoint must equal
the uninterrupted run's bit for bit: every model variable, RNG state and
optimizer slot.
"""

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tests.test_launch import processes_mentioning
from tests.test_pretraining import pretrain_args

pytestmark = pytest.mark.slow
STEPS = 30
FLAGSHIP = ["--deterministic", "--seed=7", "--log_steps=5"]


def launch(num_workers, args, *, max_restarts=0):
    backend = ["--backend", "mpi"] if "--backend=mpi" in args else []
    command = [sys.executable, "-m", "launch.local", "--num_workers",
               str(num_workers), "--threads_per_worker", "1", *backend,
               "--max_restarts", str(max_restarts), "--",
               sys.executable, "run_pretraining.py", *args]
    return subprocess.Popen(command, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc, timeout=400):
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output[-20000:]
    return output


def worker_pid(marker, index):
    """PID of worker `index` of the run whose command line has `marker`."""
    for pid in processes_mentioning(marker):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        mine = {f"TFSCALE_WORKER_INDEX={index}".encode(),  # launch.local
                f"OMPI_COMM_WORLD_RANK={index}".encode()}   # mpirun
        if mine & set(env) and \
                b"launch.local" not in open(f"/proc/{pid}/cmdline", "rb").read():
            return pid
    return None


def final_state(out):
    import tensorflow as tf
    path = tf.train.latest_checkpoint(str(out / "checkpoints"))
    assert path.endswith(f"ckpt-{STEPS}"), path
    reader = tf.train.load_checkpoint(path)
    state = {}
    for key, dtype in reader.get_variable_to_dtype_map().items():
        if dtype != tf.string and "save_counter" not in key:
            state[key] = reader.get_tensor(key)
    return state


def assert_bit_identical(a, b):
    assert sorted(a) == sorted(b)
    assert any("rng" in k for k in a)  # the dropout seed states are there
    for key in a:
        if key.startswith("metrics/"):
            # Running sums of the epoch's metrics (logs, not training state):
            # per-worker SyncOnRead parts restored as one sum may round
            # differently in the last bit.
            np.testing.assert_allclose(a[key], b[key], rtol=1e-6, err_msg=key)
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# One variant, the suite's budget: accumulation and fp16 ride with the MPI
# backend. The same kill -9 / SIGTERM resumes over gRPC: the Trainer worker
# in test_multiworker.py (kill -9) and test_preemption.py (SIGTERM), BERT
# with dropout in test_checkpointing.py.
VARIANTS = {"mpi_fp16_accumulation": ["--backend=mpi",
                                      "--precision=mixed_float16",
                                      "--num_accumulation_steps=2"]}


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):  # noqa: F811
    """Each variant once, without interruption (started lazily)."""
    results = {}

    def get(variant):
        if variant not in results:
            out = tmp_path_factory.mktemp(f"full-{variant}")
            finish(launch(2, pretrain_args(corpus, out, STEPS, *FLAGSHIP,
                                           *VARIANTS[variant])))
            results[variant] = final_state(out)
        return results[variant]
    return get


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kill9_then_sigterm_and_restarts_end_bit_identical(
        corpus, uninterrupted, tmp_path, variant):  # noqa: F811
    """Worker 1 is killed (-9) once checkpoint 10 is written; the launcher
    restarts the job, which resumes at step 10. Five steps later worker 1
    gets SIGTERM, as a scheduler sends it: both workers save at an agreed
    step and exit 143, the job restarts again and resumes there. The last
    checkpoint equals the uninterrupted run's bit for bit."""
    out = tmp_path / "run"
    proc = launch(2, pretrain_args(corpus, out, STEPS, *FLAGSHIP,
                                   *VARIANTS[variant]), max_restarts=2)
    seen, killed, resumed = [], False, False
    for line in proc.stdout:
        seen.append(line)
        if not killed and "saved checkpoint" in line and "ckpt-10" in line:
            os.kill(worker_pid(str(out), 1), signal.SIGKILL)
            killed = True
        elif killed and "at step 10; input position restored" in line:
            resumed = True
        elif resumed and "tfscale: step 15:" in line:
            os.kill(worker_pid(str(out), 1), signal.SIGTERM)
            break
    output = "".join(seen) + finish(proc)
    assert "worker 1 failed (killed by SIGKILL)" in output, output[-5000:]
    # Both workers save at the agreed step and exit 143; either may be first.
    assert re.search(r"worker [01] was preempted \(exit 143", output), \
        output[-5000:]
    step = int(re.search(r"run_pretraining: preempted: checkpoint at step "
                         r"(\d+) saved", output).group(1))
    assert 15 <= step < STEPS, step
    assert f"at step {step}; input position restored" in output
    assert_bit_identical(uninterrupted(variant), final_state(out))
    # Every log interval is on disk: the attempt killed with -9 (steps 5,
    # 10), the one preempted (15), and the last.
    from tests.test_failures import assert_every_interval_written
    assert_every_interval_written(out / "tensorboard" / "train",
                                  list(range(5, STEPS + 1, 5)))
