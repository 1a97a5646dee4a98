"""A preemption that says "saved" has saved, in every phase of a run, and
exit codes that tell the truth (`tfscale/resume/preemption.py`).

Phases: training (tests/test_preemption.py times it at 1,000 steps a
call), validation and evaluation (between batches, agreed by all workers),
a fit's first call (the main thread inside TensorFlow: the worker ends at
once, nothing trained to save), the end of a fit and a job's exports. Exit
codes: 143 only with a checkpoint on disk; 3 when there was nowhere to
save; 2 for a setting a restart would meet again; the launcher judges a
worker killed after its grace by the checkpoint's files, not the clock.
"""

import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from launch import workers as launch_workers
from tests.conftest import REPO, run_command
from tests.test_launch import processes_mentioning
from tfscale import jobs
from tfscale.cluster import contract
from tfscale.cluster.signal_watch import SignalWatch
from tfscale.resume.preemption import Preempted
from tfscale.trainer.loop import TrainConfig, Trainer


def make_trainer(checkpoint_dir=None, **fields):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.01)
    return Trainer(model=model, optimizer=optimizer,
                   loss_fn=keras.losses.MeanSquaredError(), strategy=strategy,
                   config=TrainConfig(global_batch_size=8, verbose=0,
                                      checkpoint_dir=checkpoint_dir,
                                      steps_per_execution=1, **fields))


def data(n=64):
    x = np.random.default_rng(0).normal(size=(n, 4)).astype("float32")
    return x, x[:, :1] * 2.0


class SigtermAt(keras.callbacks.Callback):
    """Sends this process SIGTERM after batch `at` (past the first call)."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_with_no_checkpoint_directory_a_preemption_says_nothing_was_saved(
        capsys):
    trainer = make_trainer(checkpoint_dir=None)
    x, y = data()
    with pytest.raises(Preempted) as raised:
        trainer.fit(x, y, batch_size=8, epochs=3, callbacks=[SigtermAt(2)])
    assert raised.value.code == contract.PREEMPTED_UNSAVED_EXIT_CODE == 3
    assert not raised.value.saved and raised.value.checkpoint is None
    assert str(raised.value) == ("preempted at step 3: no checkpoint "
                                 "directory: nothing saved")
    said = capsys.readouterr().out
    assert ("preempted (SIGTERM) at step 3: no checkpoint directory: "
            "nothing saved") in said
    assert "saved step" not in said and contract.CHECKPOINT_COMPLETE not in said


def test_a_preemption_exits_143_once_its_checkpoint_is_complete(
        tmp_path, capsys):
    trainer = make_trainer(checkpoint_dir=str(tmp_path / "ckpt"))
    x, y = data()
    with pytest.raises(Preempted) as raised:
        trainer.fit(x, y, batch_size=8, epochs=3, callbacks=[SigtermAt(2)])
    assert raised.value.code == 143 and raised.value.saved
    path = raised.value.checkpoint
    assert path.endswith("ckpt-3") and launch_workers.checkpoint_complete(path)
    said = capsys.readouterr().out
    # One prefix (before: "tfscale: tfscale: preemption checkpoint ...").
    assert f"\ntfscale: {contract.CHECKPOINT_COMPLETE} {path} (step 3, " \
        "SIGTERM)" in "\n" + said
    assert "tfscale: tfscale:" not in said


def signalling(trainer, served: list, at: int):
    """An evaluation dataset_fn of 40 batches that sends this process
    SIGTERM as it serves batch `at` (`served` counts them)."""
    x, y = data()

    def count(value):
        served.append(1)
        if len(served) == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return value

    def dataset_fn(context):
        batches = tf.data.Dataset.from_tensor_slices((x, y)).repeat(5)
        batches = batches.batch(trainer.per_replica_batch_size)
        return batches.map(lambda a, b: (tf.ensure_shape(tf.numpy_function(
            count, [a], tf.float32, stateful=True), a.shape), b))
    return dataset_fn


def test_a_sigterm_during_validation_stops_after_the_batch_and_saves(
        tmp_path):
    """Validation of 40 batches, the signal during its 3rd: the evaluation
    ends after it (not 37 batches later), the epoch's step is saved."""
    trainer = make_trainer(checkpoint_dir=str(tmp_path / "ckpt"))
    x, y = data()
    served = []
    with pytest.raises(Preempted) as raised:
        trainer.fit(x, y, batch_size=8, epochs=2,
                    validation_data=signalling(trainer, served, 3))
    assert raised.value.step == 8  # epoch 1's 8 steps, then its validation
    # The batch in flight and the prefetched ones, not the 40.
    assert 3 <= len(served) < 15, len(served)
    assert launch_workers.checkpoint_complete(raised.value.checkpoint)


def test_a_sigterm_during_evaluate_is_taken_between_batches(tmp_path):
    trainer = make_trainer(checkpoint_dir=str(tmp_path / "ckpt"))
    x, y = data()
    trainer.fit(x, y, batch_size=8, epochs=1)
    served = []
    with pytest.raises(Preempted) as raised:
        trainer.evaluate(signalling(trainer, served, 2))
    # Nothing trained since the fit's final save: that checkpoint is the run.
    assert raised.value.step == 8 and raised.value.saved
    assert raised.value.checkpoint.endswith("ckpt-8")
    assert len(served) < 15


class SigtermAtTheEnd(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_after_training_leaves_the_exports_to_the_restart(tmp_path):
    """At a fit's end (its final save done): the job stops before its
    evaluation and files (no summary.json), exit 143; the restart trains
    nothing more and writes them."""
    from tests.test_jobs import Toy, toy_config

    class Signalled(Toy):
        def callbacks(self, trainer):
            return [SigtermAtTheEnd()]

    config = toy_config(tmp_path)
    with pytest.raises(Preempted) as raised:
        jobs.run(Signalled(config))
    assert raised.value.code == 143 and raised.value.step == 4
    summary = os.path.join(config.output_dir, "summary.json")
    assert not os.path.exists(summary)
    again = Toy(config)
    results = jobs.run(again)
    assert results["steps"] == 4 and again.counter.batches == 0
    assert json.load(open(summary))["steps"] == 4


def test_nested_watches_share_what_they_record():
    with SignalWatch() as outer:
        with SignalWatch() as inner:
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.monotonic() + 10
            while not inner.requested and time.monotonic() < deadline:
                time.sleep(0.01)  # the handler runs between bytecodes
        assert inner.requested and outer.requested
        assert outer.signal_name == "SIGUSR1"


def run_worker(tmp_path, *args, launcher=()):
    command = [sys.executable, "-m", "tests.workers.phases_worker", "--out",
               str(tmp_path), *args]
    if launcher:
        command = [sys.executable, "-m", "launch.local", "--num_workers", "1",
                   *launcher, "--", *command]
    return subprocess.Popen(command, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_for(path, proc, seconds=120):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, \
            proc.communicate()[0][-4000:]
        time.sleep(0.05)  # polling for a file the worker writes


@pytest.mark.slow
def test_a_signal_during_the_first_call_ends_the_worker_at_once(tmp_path):
    """The main thread waits inside the first call (for a batch that takes
    60 s: a long compilation's stand-in); SIGTERM ends the worker at once
    with 143, saying nothing was trained, the batch never delivered."""
    proc = run_worker(tmp_path, "--mode", "first_call", "--checkpoint_dir",
                      str(tmp_path / "ckpt"))
    wait_for(tmp_path / "in_first_call", proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=50)
    assert proc.returncode == 143, output[-3000:]
    assert ("worker 0: SIGTERM before step 1's call ended (restoring, "
            "tracing, compiling): nothing trained since the run's start; "
            "exiting at once with code 143") in output, output[-3000:]
    assert not (tmp_path / "first_batch").exists()


@pytest.mark.slow
def test_a_worker_slow_to_exit_after_a_complete_save_is_still_resumable(
        tmp_path):
    """The script catches `Preempted` and sleeps: the launcher's grace (3 s)
    runs out, it SIGKILLs the worker, finds the checkpoint the worker said
    complete whole on disk, and exits 143, not 137."""
    proc = run_worker(tmp_path, "--mode", "slow_exit", "--checkpoint_dir",
                      str(tmp_path / "ckpt"),
                      launcher=("--grace_seconds", "3"))
    wait_for(tmp_path / "training", proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=100)
    assert "caught Preempted: sleeping" in output, output[-3000:]
    saved = tf.train.latest_checkpoint(str(tmp_path / "ckpt"))
    assert (f"[launcher] the grace of 3 s ran out: SIGKILLed worker 0 on its "
            f"way out; the checkpoint {saved} is complete on disk") in output
    assert proc.returncode == 143, output[-3000:]
    assert processes_mentioning(str(tmp_path)) == []


def test_the_launchers_verdict_reads_the_checkpoints_files(tmp_path):
    prefix = str(tmp_path / "ckpt-6")
    for name in (".index", ".data-00000-of-00002"):
        open(prefix + name, "w").close()
    assert not launch_workers.checkpoint_complete(prefix)  # a shard missing
    open(prefix + ".data-00001-of-00002", "w").close()
    assert launch_workers.checkpoint_complete(prefix)
    os.remove(prefix + ".index")
    assert not launch_workers.checkpoint_complete(prefix)
    seen = []
    launch_workers.note_checkpoint(
        seen, "I1128 console.py:18] tfscale: preemption checkpoint complete: "
        f"{prefix} (step 6, SIGTERM)")
    assert seen == [prefix]


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e-9", "1e12"])
def test_every_bound_is_checked_at_the_edge_in_one_line(value):
    problem = contract.seconds_problem("max_call_seconds", float(value),
                                       "--max_call_seconds")
    assert problem == ("--max_call_seconds must be 0 (no bound) or between "
                       f"0.01 and 86400 seconds, got {float(value)!r}")
    assert contract.seconds_problem("max_call_seconds", 0.0) is None
    assert contract.seconds_problem("collective_timeout_seconds", None) is None
    # A grace may be as short as 0 (SIGKILL at once), not endless.
    assert bool(contract.seconds_problem("grace_seconds", float(value))) == (
        value != "1e-9")


def test_bad_bounds_exit_2_with_one_line(tmp_path):
    code, output = run_command(
        [sys.executable, "run_pretraining.py", "--input_file=x",
         f"--output_dir={tmp_path}", "--max_call_seconds=inf"])
    assert code == 2
    assert output.strip().splitlines()[-1] == (
        "run_pretraining: error: --max_call_seconds must be 0 (no bound) or "
        "between 0.01 and 86400 seconds, got inf")
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "1",
         "--grace_seconds", "nan", "--", "true"])
    assert (code, output.strip().splitlines()[-1]) == (
        2, "tfscale-launch: error: --grace_seconds must be between 0 and "
           "86400 seconds, got nan")


USER_SCRIPT = ("import tfscale\n"
               "tfscale.TrainConfig(global_batch_size=8, "
               "max_call_seconds=float('inf'))\n")


def test_a_users_config_error_exits_2_which_launchers_do_not_restart():
    code, output = run_command([sys.executable, "-c", USER_SCRIPT])
    assert code == 2, output
    assert output.strip().splitlines()[-1] == (
        "tfscale: error: max_call_seconds must be 0 (no bound) or between "
        "0.01 and 86400 seconds, got inf (a setting: exit 2, not restarted)")


def test_an_mpi_rank_without_the_mpi_backend_exits_2(tmp_path):
    with tf.io.TFRecordWriter(str(tmp_path / "records.tfrecord")) as f:
        f.write(tf.train.Example().SerializeToString())
    code, output = run_command(
        [sys.executable, "run_pretraining.py",
         f"--input_file={tmp_path}/records.tfrecord",
         f"--output_dir={tmp_path}/out",
         "--bert_config_file=benchmarks/gpu/bert_base.json"],
        env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    assert code == 2, output[-2000:]
    assert "without --backend=mpi" in output.strip().splitlines()[-1]


IGNORES_SIGINT = ("import signal, sys, time\n"
                  "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                  "print('ready', flush=True)\n"
                  "time.sleep(120)\n"
                  "open(sys.argv[1], 'w').close()\n")


def test_a_second_ctrl_c_stops_the_launcher_and_its_workers_at_once(
        tmp_path):
    marker = str(tmp_path / "finished")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.local", "--num_workers", "2", "--",
         sys.executable, "-c", IGNORES_SIGINT, marker], cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    ready = 0
    while ready < 2:
        line = proc.stdout.readline()
        assert line, "launcher ended early"
        ready += "ready" in line
    proc.send_signal(signal.SIGINT)
    # A person's double Ctrl-C, the second once the first is taken (two
    # sent before the launcher runs are one pending signal).
    while "SIGINT: passing it to all workers" not in line:
        line = proc.stdout.readline()
        assert line, "launcher ended early"
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=20)  # the grace is 30 s
    assert proc.returncode == 130, output
    assert ("[launcher] exit 130: a second SIGINT: SIGKILLed every worker "
            "at once") in output
    assert processes_mentioning(marker) == [] and not os.path.exists(marker)


SECOND_CTRL_C = ("import signal, sys, time\n"
                 # A terminal's foreground job (a background one, as this
                 # test's may be, ignores SIGINT, and so would this).
                 "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                 "from tfscale.cluster.signal_watch import SignalWatch\n"
                 "with SignalWatch() as watch:\n"
                 "    print('ready', flush=True)\n"
                 "    while not watch.requested:\n"
                 "        time.sleep(0.01)\n"
                 "    print('first seen', flush=True)\n"
                 "    time.sleep(60)\n"
                 "    open(sys.argv[1], 'w').close()\n")


def test_a_second_ctrl_c_ends_a_worker_at_once(tmp_path):
    marker = str(tmp_path / "finished")
    proc = subprocess.Popen([sys.executable, "-c", SECOND_CTRL_C, marker],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        assert "ready" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        # (Two signals sent before the process runs are one: the kernel
        # keeps one pending SIGINT.)
        assert "first seen" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, output
    assert "tfscale: a second Ctrl-C: stopped at once" in output
    assert not os.path.exists(marker)


CHIEF_ALONE = """
import os, sys, keras, numpy as np, tfscale
strategy = tfscale.make_strategy(tfscale.resolve_cluster(),
                                 tfscale.ClusterConfig())
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
trainer = tfscale.Trainer.from_compiled(model, tfscale.TrainConfig(
    global_batch_size=16, verbose=0))
x = np.ones((64, 4), "float32")
trainer.fit(x, x[:, :1], batch_size=16, epochs=1)
if trainer.is_chief:  # a Keras habit
    trainer.evaluate(x, x[:, :1], batch_size=16)
if sys.argv[1] == "leave":
    trainer.leave_together()
"""


@pytest.mark.slow
@pytest.mark.parametrize("then", ["leave", "exit"])
def test_evaluate_on_the_chief_alone_is_refused_in_one_line(then):
    """The other worker leaves together, or its script simply ends: the
    chief's `evaluate()` is refused at once naming it (no collective
    mismatch, no 300 s timeout), exit 2, not restarted."""
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--num_workers", "2",
         "--max_restarts", "2", "--", sys.executable, "-c", CHIEF_ALONE,
         then], timeout=200)
    assert code == 2, output[-4000:]
    instead = ("reached leave_together() instead" if then == "leave" else
               "reached the end of its program instead")
    assert ("CollectiveMisuse: evaluate() is a collective, as fit is: call "
            "it on every worker (on worker 0: worker 1 " + instead) in output
    assert "restart 1/2" not in output
