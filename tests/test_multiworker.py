"""Real multi-process runs: workers on 127.0.0.1 started through launch.local.

Each worker writes what it observed (weights .npz, callback events .json) to a
temp dir; the tests assert on those files. Invariants: 2 workers with global
batch B end with the same weights as 1 worker with batch B; workers agree
bit for bit; a run killed mid-way and resumed ends where an uninterrupted one
ends; files are written by the chief only.
"""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from launch import ports
from tfscale.cluster import contract
from tests.conftest import REPO, run_command, run_workers

pytestmark = pytest.mark.slow
WORKER = ["tests.workers.train_worker"]


def load_weights(out, index=0):
    data = np.load(os.path.join(out, f"weights_{index}.npz"))
    return [data[k] for k in sorted(data.files, key=lambda k: int(k[4:]))]


def load_events(out, index):
    with open(os.path.join(out, f"events_{index}.json")) as f:
        return json.load(f)


def assert_same_weights(a, b, rtol=1e-5, atol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def train(tmp_path_factory, name, num_workers, *args, launcher_args=()):
    out = tmp_path_factory.mktemp(name)
    _, output = run_workers(num_workers, WORKER + ["--out", str(out), *args],
                            launcher_args=launcher_args)
    return out, output


@pytest.fixture(scope="module")
def sgd_one(tmp_path_factory):
    return train(tmp_path_factory, "sgd1", 1)[0]


@pytest.fixture(scope="module")
def sgd_two(tmp_path_factory):
    files = tmp_path_factory.mktemp("files")
    out, _ = train(tmp_path_factory, "sgd2", 2,
                   "--model_checkpoint", str(files / "model.weights.h5"),
                   "--csv", str(files / "log.csv"))
    return out, files


def test_two_workers_match_one_worker_sgd(sgd_one, sgd_two):
    assert_same_weights(load_weights(sgd_one), load_weights(sgd_two[0]))


def test_workers_hold_identical_weights(sgd_two):
    for a, b in zip(load_weights(sgd_two[0], 0), load_weights(sgd_two[0], 1)):
        np.testing.assert_array_equal(a, b)


def test_callbacks_see_hooks_and_logs_on_every_worker(sgd_two):
    for index in (0, 1):
        events = load_events(sgd_two[0], index)["events"]
        kinds = [e[0] for e in events]
        assert kinds[0] == "train_begin" and kinds[-1] == "train_end"
        batches = [e for e in events if e[0] == "batch_end"]
        assert [e[1] for e in batches] == list(range(6))
        # What model.fit's logs hold (the interval's numbers go to
        # summary.json and TensorBoard).
        assert all(set(e[2]) == {"loss", "mae"} for e in batches)
        assert [e[1] for e in events if e[0] == "epoch_end"] == [0]
    # Reduced logs: both workers report the same loss.
    loss = [[e[2]["loss"] for e in load_events(sgd_two[0], i)["events"]
             if e[0] == "batch_end"] for i in (0, 1)]
    assert loss[0] == loss[1]


def test_files_are_written_once_by_the_chief(sgd_two):
    out, files = sgd_two
    assert sorted(os.listdir(files)) == ["log.csv", "model.weights.h5"]
    with open(files / "log.csv") as f:
        lines = f.read().strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("epoch")
    assert load_events(out, 0)["is_chief"] and not load_events(out, 1)["is_chief"]


def test_two_workers_match_one_worker_lamb(tmp_path_factory):
    one, _ = train(tmp_path_factory, "lamb1", 1, "--optimizer", "lamb")
    two, _ = train(tmp_path_factory, "lamb2", 2, "--optimizer", "lamb")
    assert_same_weights(load_weights(one), load_weights(two))


def test_accumulation_two_workers_matches_one_big_batch(sgd_one, tmp_path_factory):
    two, _ = train(tmp_path_factory, "accum2", 2, "--accum", "2")
    assert_same_weights(load_weights(sgd_one), load_weights(two))


def test_xla_two_workers_matches_no_xla(sgd_one, tmp_path_factory):
    two, _ = train(tmp_path_factory, "xla2", 2, "--xla")
    assert_same_weights(load_weights(sgd_one), load_weights(two), rtol=1e-4,
                        atol=1e-5)


def test_xla_and_several_steps_per_call_two_workers_match_one_worker(
        sgd_one, tmp_path_factory):
    # The GPU configuration: the compiled per-replica step and up to 4
    # steps per call (steps 1-4, then 5-6: the input read inside the call).
    two, output = train(tmp_path_factory, "calls2", 2, "--xla",
                        "--steps_per_execution", "4")
    assert_same_weights(load_weights(sgd_one), load_weights(two), rtol=1e-4,
                        atol=1e-5)


def test_a_stop_inside_a_call_ends_it_on_every_worker_at_the_same_step(
        tmp_path_factory):
    # Worker 1 sets stop_training after the first call (steps 1-4); the
    # second call (steps 5-6) carries the flag in step 5's all-reduce and
    # leaves its loop there, on both workers. (Calls of exactly 4 steps:
    # no wall-time bound.)
    out, _ = train(tmp_path_factory, "stopcall", 2, "--stop_at", "1",
                   "--steps_per_execution", "4", "--max_call_seconds", "0")
    assert load_events(out, 0)["step"] == 5
    assert load_events(out, 1)["step"] == 5


def test_killed_worker_is_restarted_and_run_ends_as_uninterrupted(
        sgd_one, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    out, output = train(tmp_path_factory, "crash", 2, "--checkpoint_dir",
                        str(ckpt), "--save_steps", "2", "--crash_at", "3",
                        launcher_args=("--max_restarts", "1"))
    assert "worker 1 failed (killed by SIGKILL)" in output
    assert "restart 1/1" in output
    assert os.path.exists(os.path.join(out, "crashed"))
    assert load_events(out, 0)["step"] == 6
    assert_same_weights(load_weights(sgd_one), load_weights(out))


def test_one_worker_stopping_stops_all_one_step_later(tmp_path_factory):
    # Worker 1 sets stop_training after step 2; the flag rides in step 3's
    # all-reduce, and both workers stop after step 3.
    out, _ = train(tmp_path_factory, "stop", 2, "--stop_at", "2")
    assert load_events(out, 0)["step"] == 3
    assert load_events(out, 1)["step"] == 3


def test_resume_on_another_worker_count_two_one_two(tmp_path_factory):
    import tensorflow as tf
    ckpt = str(tmp_path_factory.mktemp("ckpt21"))
    common = ["--checkpoint_dir", ckpt, "--save_steps", "3", "--dump_initial"]
    runs = []
    for num_workers, epochs in ((2, 1), (1, 2), (2, 3)):
        out, output = train(tmp_path_factory, f"w{num_workers}e{epochs}",
                            num_workers, "--epochs", str(epochs), *common)
        runs.append((out, output))
        assert load_events(out, 0)["step"] == 6 * epochs
        if epochs > 1:
            start = 6 * (epochs - 1)
            assert f"at step {start}; input starts over" in output
            # Every weight restored exactly from the previous run's checkpoint.
            reader = tf.train.load_checkpoint(os.path.join(ckpt, f"ckpt-{start}"))
            previous = load_weights(runs[-2][0], 0)
            initial = [np.load(os.path.join(out, "initial_0.npz"))[f"arr_{i}"]
                       for i in range(len(previous))]
            for a, b in zip(previous, initial):
                np.testing.assert_array_equal(a, b)
            assert reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") == start
    # The schedule continued: the optimizer counted all 18 updates.
    reader = tf.train.load_checkpoint(os.path.join(ckpt, "ckpt-18"))
    iterations = [reader.get_tensor(k) for k, _ in tf.train.list_variables(
        os.path.join(ckpt, "ckpt-18"))
        if k.startswith("optimizer/") and "iterations" in k]
    assert iterations == [18]


def test_keras_fit_under_multiworker_with_compat_matches_one_worker(
        tmp_path_factory):
    one, _ = train(tmp_path_factory, "fit1", 1, "--keras_fit")
    two, _ = train(tmp_path_factory, "fit2", 2, "--keras_fit")
    assert_same_weights(load_weights(one), load_weights(two))


def test_bad_tf_config_exits_with_one_line_error(tmp_path):
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1"]},
                                    "task": {"type": "worker", "index": 3}})}
    code, output = run_command(
        [sys.executable, "-m", *WORKER, "--out", str(tmp_path)], env=env,
        timeout=120)
    assert code != 0
    last = output.strip().splitlines()[-1]
    assert last.startswith("tfscale: error: TF_CONFIG task index 3 is out of")


@pytest.fixture
def two_ports():
    """Two free ports, held from other launchers for the test."""
    with ports.lease(2) as held:
        yield held.ports


def test_unreachable_peer_fails_within_the_connect_timeout(tmp_path,
                                                          two_ports):
    env = {"TF_CONFIG": json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in two_ports]},
        "task": {"type": "worker", "index": 0}})}
    start = time.monotonic()
    code, output = run_command(
        [sys.executable, "-m", *WORKER, "--out", str(tmp_path),
         "--connect_timeout", "5"], env=env, timeout=120)
    # Its own code, not 137 (an out-of-memory kill to a scheduler).
    assert code == contract.STARTUP_TIMEOUT_EXIT_CODE, output[-3000:]
    assert time.monotonic() - start < 60
    assert (f"unreachable peer(s): 127.0.0.1:{two_ports[1]}); exit "
            f"{contract.STARTUP_TIMEOUT_EXIT_CODE}") in output
    from tests.test_launch import processes_mentioning
    assert processes_mentioning(str(tmp_path)) == []  # no worker left
    # Nor its watchdog (the only process with the peer's address on its
    # command line; other tests' watchdogs may be running).
    assert processes_mentioning(f"127.0.0.1:{two_ports[1]}") == []


def test_a_peer_killed_with_no_launcher_ends_the_others_naming_it(tmp_path,
                                                                 two_ports):
    # Workers started by hand (as srun or a Kubernetes pod starts them):
    # nobody stops the survivor; its collective fails, and its last line
    # names the peer it lost, well within the collective timeout.
    procs = []
    for index in range(2):
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
                   TF_CONFIG=json.dumps({
                       "cluster": {"worker": [f"127.0.0.1:{p}"
                                              for p in two_ports]},
                       "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", *WORKER, "--out", str(tmp_path),
             "--steps", "200", "--crash_at", "3",
             "--collective_timeout", "60"], env=env, cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert procs[1].returncode == -9  # killed itself at step 3
    assert procs[0].returncode == 1, outputs[0][-3000:]
    last = outputs[0].strip().splitlines()[-1]
    assert last.startswith("tfscale: worker 0 failed: ") and (
        "(lost peer: worker 1); ending the job" in last), last


def test_three_workers_leave_together_when_the_chief_is_last_to_finish():
    """The chief arrives last at the end (as after an export) and the other
    workers report leaving 2 s late: every worker exits 0, and the chief,
    which hosts the coordination service, leaves only after every report.
    (A chief that left right after the barrier would leave before them.)"""
    _, output = run_workers(3, ["tests.workers.leave_together",
                                "--chief_seconds", "1",
                                "--report_delay", "2"], timeout=120)

    def times(event):
        return {int(i): float(t) for i, t in re.findall(
            rf"^\[worker \d\] {event} (\d) at ([\d.]+)$", output,
            re.MULTILINE)}
    left, reported = times("left"), times("reporting")
    assert sorted(left) == [0, 1, 2] and sorted(reported) == [1, 2], output
    assert left[0] > max(reported.values()), output


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mwms", "mpi"])
def test_a_worker_stuck_on_its_host_is_named_within_the_hang_floor(
        tmp_path, backend):
    # Worker 1's callback sleeps after step 4 (stuck in Python): its
    # coordination-service heartbeats go on, and worker 0 waits inside its
    # next call's all-reduce. Before: 300 s (the collective timeout), then
    # the waiting worker 0 named. Now its Trainer's heartbeat stops and the
    # launcher names worker 1 after the floor (mutation tried: the culprit
    # taken as the first silent worker, not the one furthest behind ->
    # worker 0 named).
    start = time.monotonic()
    code, output = run_workers(
        2, [*WORKER, "--out", str(tmp_path), "--steps", "30", "--hang_at",
            "4", "--collective_timeout", "300", "--backend", backend],
        launcher_args=["--hang_floor_seconds", "5",
                       "--failure_grace_seconds", "1", "--backend", backend],
        expect_ok=False, timeout=240)
    assert code == contract.HUNG_EXIT_CODE, output[-3000:]
    assert time.monotonic() - start < 120
    assert re.search(r"\[launcher\] worker 1 hung: no next step call for "
                     r"\d+ s, past the floor of 5 s .*; last seen between "
                     r"step calls after step 4;", output), output[-3000:]
    assert output.rstrip().splitlines()[-1].startswith(
        "[launcher] exit 124: worker 1 hung"), output[-2000:]


@pytest.mark.slow
def test_workers_that_resume_at_different_steps_refuse_in_one_line(tmp_path):
    # The checkpoint folder not shared between hosts: the chief resumed at
    # its last step, worker 1 at step 0. Before: both waited in their first
    # collective for 300 s, then "Collective has timed out".
    ckpt = str(tmp_path / "ckpt")
    args = [*WORKER, "--out", str(tmp_path), "--steps", "6",
            "--checkpoint_dir", ckpt, "--save_steps", "3",
            "--unshared_checkpoints"]
    run_workers(2, args)
    code, output = run_workers(2, args, launcher_args=["--max_restarts", "2"],
                               expect_ok=False)
    assert code == 2, output[-3000:]
    assert ("the workers would resume at different steps: worker 0 at step 6 "
            f"from {ckpt}/ckpt-6, worker 1 at step 0 from nothing in "
            f"{ckpt}-1; every worker must see the chief's checkpoint "
            "folder") in output, output[-3000:]
    assert "restart 1/2" not in output
