"""One failed worker ends the job at once, and what was written stays.

Real processes through launch.local, on both backends:
  - a user's own Trainer script whose callback raises on worker 1: every
    worker ends within 30 s of the raise (before the fix, MPI ranks sat until
    the collective timeout), the launcher names worker 1 and the error, and
    the chief's CSVLogger rows, TensorBoard scalars and BackupAndRestore
    backup from before the failure are on disk;
  - run_pretraining.py with a corrupt record that only worker 1 reads: the
    same, through the entry point's own exit (`tfscale.cli.leave`).
"""

import glob
import json
import os
import re
import shutil
import signal
import sys
import time

import pytest

from tests.conftest import run_command
from tests.test_pretraining import pretrain_args

pytestmark = pytest.mark.slow
BACKENDS = ["mwms", "mpi"]
# The workers' collective timeout (train_worker.py): without the fail-fast
# exit, MPI ranks end only when it fires.
COLLECTIVE_TIMEOUT = 60


def launcher(backend, num_workers=2):
    return [sys.executable, "-m", "launch.local", "--num_workers",
            str(num_workers), "--threads_per_worker", "1",
            *(["--backend", "mpi"] if backend == "mpi" else []), "--"]


def scalars(log_dir):
    """{step: set of tags} written to the event files in log_dir."""
    import tensorflow as tf
    written = {}
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                written.setdefault(int(event.step), set()).add(value.tag)
    return written


def assert_every_interval_written(log_dir, steps):
    """Each of `steps` has every batch scalar (the interval's loss,
    throughput, time split: the same tags at every interval)."""
    written = scalars(log_dir)
    tags = written.get(steps[0], set())
    assert "batch_loss" in tags and "batch_examples_per_second" in tags, \
        written
    for step in steps:
        assert tags <= written.get(step, set()), (step, written)


@pytest.mark.parametrize("backend", BACKENDS + ["keras_fit"])
def test_exception_in_a_user_script_ends_every_worker_and_keeps_the_logs(
        tmp_path, backend):
    """A Trainer script on both backends, and plain `model.fit` with
    `tfscale.enable_multi_worker_fit` (MWMS)."""
    out = tmp_path / "out"
    out.mkdir()
    if backend == "keras_fit":
        script = ["--keras_fit", "--steps", "200"]
    else:
        script = ["--backend", backend, "--steps", "4", "--epochs", "200",
                  "--csv", str(tmp_path / "log.csv"),
                  "--tensorboard", str(tmp_path / "tb"),
                  "--backup_dir", str(tmp_path / "backup")]
    command = launcher("mpi" if backend == "mpi" else "mwms") + [
        sys.executable, "-m", "tests.workers.train_worker", "--out", str(out),
        "--raise_at", "10", "--collective_timeout", str(COLLECTIVE_TIMEOUT),
        *script]
    code, output = run_command(command, timeout=4 * COLLECTIVE_TIMEOUT)
    ended = time.time()
    assert code == 1, output[-5000:]
    raised = json.loads((out / "raised_at.json").read_text())
    assert raised["step"] == 10
    # The whole job, launcher included, ends well before the timeout.
    assert ended - raised["time"] < 30, (ended - raised["time"], output[-5000:])
    assert ("[launcher] worker 1 failed (exit code 1): tfscale: worker 1 "
            "failed: RuntimeError: injected failure at step 10; ending the "
            "job; stopping the other workers") in output, output[-5000:]
    assert "Traceback" in output  # the traceback is printed, then the line
    if backend == "keras_fit":
        return
    # Epochs 0 and 1 (steps 1-8) ended before the failure (epoch 2).
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["0", "1"], rows
    # TensorBoard writes each log interval (2 steps): every interval the
    # chief logged (its "tfscale: step N:" lines) is on disk, whether the
    # chief was then killed (MPI) or failed itself (MWMS).
    logged = [int(m) for m in re.findall(
        r"\[worker 0\] .*tfscale: step (\d+): loss", output)]
    assert logged[:4] == [2, 4, 6, 8], logged
    assert_every_interval_written(tmp_path / "tb" / "train", logged)
    # A failed run keeps BackupAndRestore's backup (only a normal end
    # deletes it).
    assert (tmp_path / "backup" / "training_metadata.json").exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_record_on_one_worker_ends_the_entry_point_job(
        corpus, tmp_path, backend):  # noqa: F811
    """run_pretraining.py, records read per worker (sharded order): worker
    1's files have a corrupt record. Worker 1 names it and fails, and the
    job ends at once, not after a collective timeout."""
    from input_pipelines.record_files import shard_files
    records = tmp_path / "records"
    shutil.copytree(corpus / "records", records)
    files = sorted(glob.glob(str(records / "train-*.tfrecord")))
    own, by_file = shard_files(files, 2, 1)
    assert by_file and set(own).isdisjoint(shard_files(files, 2, 0)[0])
    for name in own:  # flip bytes in the middle of worker 1's files
        with open(name, "r+b") as f:
            f.seek(os.path.getsize(name) // 2)
            f.write(b"\xff" * 64)
    args = pretrain_args(corpus, tmp_path / "run", 2000,
                         "--input_order=sharded",
                         "--collective_timeout=120", f"--backend={backend}")
    args[0] = f"--input_file={records}/train-*.tfrecord"
    started = time.time()
    code, output = run_command(launcher(backend) + [
        sys.executable, "run_pretraining.py", *args], timeout=400)
    # (A bad record is no passing failure: exit 2, which no launcher
    # restarts.)
    assert code == 2, output[-5000:]
    assert ("[launcher] worker 1 stopped on an error a restart would repeat "
            "(exit 2): run_pretraining: error: --input_file: bad input "
            "record: ") in output, output[-5000:]
    failed = [line for line in output.splitlines()
              if line.startswith("[launcher] worker 1 stopped")][0]
    assert any(os.path.basename(name) in failed for name in own), failed
    # Started, trained some steps, failed: far less than the 120 s a
    # collective would wait for the failed worker.
    assert time.time() - started < 100, output[-3000:]


def test_two_thousand_shards_under_a_1024_descriptor_limit(corpus, tmp_path):  # noqa: F811
    """ImageNet- and Wikipedia-scale shard counts on a node whose hard limit
    is 1,024 open files: 2 workers of run_pretraining.py read 2,000 record
    files (indexing them first) in the global order, each worker holding a
    bounded pool of descriptors."""
    import tensorflow as tf
    records = [r.numpy() for r in tf.data.TFRecordDataset(
        sorted(glob.glob(str(corpus / "records" / "train-*.tfrecord"))))]
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2000):
        with tf.io.TFRecordWriter(str(shards / f"part-{i:05d}")) as writer:
            for j in range(2):
                writer.write(records[(2 * i + j) % len(records)])
    args = pretrain_args(corpus, tmp_path / "run", 6, "--log_steps=3",
                         "--save_checkpoints_steps=6")
    args[0] = f"--input_file={shards}/part-*"
    command = " ".join([*launcher("mwms"), sys.executable,
                        "run_pretraining.py", *args])
    code, output = run_command(
        ["bash", "-c", f"ulimit -Sn 1024 -Hn 1024 && exec {command}"],
        timeout=400)
    assert code == 0, output[-5000:]
    # (Both workers index at the start; each saves what it built, so they
    # share the work.)
    assert re.search(r"indexed \d+ record file\(s\)", output), output[-3000:]
    assert "global order of 4000 records in 2000 files" in output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["num_workers"] == 2


def test_a_worker_killed_while_writing_its_backup_restarts_from_the_last_one(
        tmp_path):
    # The second epoch's backup is cut short by a SIGKILL while its weights
    # are written; the restart resumes from the first epoch's backup.
    backup, out = tmp_path / "backup", tmp_path / "out.json"
    command = [sys.executable, "-m", "tests.workers.backup_kill",
               f"--backup_dir={backup}", f"--out={out}"]
    code, output = run_command(command + ["--kill_at=2"], timeout=120)
    assert code == -signal.SIGKILL, output
    assert not out.exists()
    code, output = run_command(command, timeout=120)
    assert code == 0, output
    result = json.loads(out.read_text())
    assert (result["first_step"], result["last_step"]) == (3, 12)  # epoch 1
    # (A normal end deletes the backup, what the kill left included.)
    assert not backup.exists() or os.listdir(backup) == []


@pytest.mark.parametrize("how", ["keras_fit_mid_write", "trainer_mid_commit"])
def test_a_backup_killed_at_any_point_restores_whole(tmp_path, how):
    # model.fit (after enable_multi_worker_fit) killed while its backup's
    # weights are written: Keras wrote them in place, and the restart
    # failed with "truncated file". The Trainer's backup killed after its
    # commit (the metadata renamed) but before the weights' rename: with
    # two renames (weights, then metadata) a kill between them restored
    # the newer weights under the older epoch. Either way the restart must
    # restore a whole backup: the weights of the epoch it names. (Mutations
    # tried:
    # keras_fit without make_backups_atomic; the two-rename backup.)
    backup, out = tmp_path / "backup", tmp_path / "out.json"
    command = [sys.executable, "-m", "tests.workers.backup_kill",
               f"--backup_dir={backup}", f"--out={out}"]
    if how == "keras_fit_mid_write":
        command.append("--keras_fit")
        kill = "--kill_at=2"
    else:
        kill = "--kill_before_replace=4"  # the second backup's second
    code, output = run_command(command + [kill], timeout=120)
    assert code == -signal.SIGKILL, output
    assert not out.exists()
    epoch_2 = json.loads((tmp_path / "out.json.epoch-2.json").read_text())
    code, output = run_command(command, timeout=120)
    assert code == 0, output[-3000:]
    result = json.loads(out.read_text())
    if how == "keras_fit_mid_write":
        # Keras's fit restores the epoch, and reads its data from the start.
        assert (result["first_step"], result["last_step"]) == (3, 12)
    else:  # the committed backup, finished by the restore
        assert (result["first_step"], result["last_step"]) == (6, 12)
        assert result["restored"] == epoch_2
