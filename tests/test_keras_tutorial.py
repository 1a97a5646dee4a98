"""TensorFlow's multi-worker Keras tutorial, in Keras 3, on 2 real workers:
`model.fit` with `tfscale.enable_multi_worker_fit()`, and the same script
with `trainer.fit`. See tests/workers/keras_tutorial.py."""

import csv
import os
import re

import numpy as np
import pytest

from tests.conftest import run_workers

pytestmark = pytest.mark.slow


OUTPUTS = {}


def tutorial(num_workers, out, *args, launcher_args=(), expect_ok=True):
    out.mkdir()
    code, OUTPUTS[out.name] = run_workers(
        num_workers, ["tests.workers.keras_tutorial", f"--out={out}", *args],
        launcher_args=launcher_args, timeout=400, expect_ok=expect_ok)
    if not expect_ok:
        return code
    return [load(out / f"weights_{i}.npz") for i in range(num_workers)]


def assert_each_worker_said_where_it_trains(output, num_workers):
    """One `placement:` line from each worker's own script (a user's
    `model.fit` or Trainer prints it, not only the jobs)."""
    for index in range(num_workers):
        said = [line for line in output.splitlines()
                if line.startswith(f"[worker {index}]")
                and "tfscale: placement: 1 replica on CPU:0" in line]
        assert len(said) == 1, output[-3000:]
        assert f"(worker {index} sees no GPU)" in said[0]
        # Its precision and all-reduce, as the jobs' banner says them.
        numerics = [line for line in output.splitlines()
                    if line.startswith(f"[worker {index}] tfscale: "
                                       "precision ")]
        assert len(numerics) == 1, output[-3000:]
        assert ", all-reduce ring (auto), a worker silent 30 s is held " \
            "lost" in numerics[0] or ", all-reduce auto, a worker silent " \
            "30 s is held lost" in numerics[0], numerics


def load(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k[4:]))]


def assert_close(a, b, tol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def assert_identical(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_tutorial_on_two_workers_fit_trainer_and_kill9_resume(tmp_path):
    fit2 = tutorial(2, tmp_path / "fit2", "--mode=fit")
    fit1 = tutorial(1, tmp_path / "fit1", "--mode=fit")
    trainer2 = tutorial(2, tmp_path / "trainer2", "--mode=trainer")
    # Every worker holds the same weights, and 2 workers end where 1 does,
    # through fit and through the Trainer alike.
    assert_identical(fit2[0], fit2[1])
    assert_identical(trainer2[0], trainer2[1])
    assert_each_worker_said_where_it_trains(OUTPUTS["fit2"], 2)
    assert_each_worker_said_where_it_trains(OUTPUTS["trainer2"], 2)
    # The Trainer computes what fit computes, bit for bit (same slices, same
    # all-reduce, on CPUs its default update op by op as Keras's; an
    # XLA-compiled one, `compile_update=True`, rounds otherwise: 1.1e-3
    # apart after 48 Adam steps); one worker sums each batch's gradient in another order,
    # which moves the conv kernel (|w| ~ 0.3) by ~1e-4 after 48 steps.
    assert_identical(trainer2[0], fit2[0])
    assert_close(fit2[0], fit1[0], tol=3e-4)
    # It trained.
    assert any(np.abs(w).sum() > 0 for w in fit2[0])
    for run in ("fit2", "trainer2"):
        out = tmp_path / run
        # Files from the chief only: one TensorBoard writer, one CSV with a
        # row per epoch, the chief's checkpoints, the chief's backup.
        events = list((out / "tensorboard" / "train").iterdir())
        assert len(events) == 1, events
        rows = list(csv.DictReader(open(out / "log.csv")))
        assert [r["epoch"] for r in rows] == ["0", "1", "2"]
        assert sorted(os.listdir(out / "ckpt")) == [
            "epoch01.weights.h5", "epoch02.weights.h5", "epoch03.weights.h5"]
        assert (out / "backup" / "training_metadata.json").exists()
        for index in (0, 1):
            epochs = (out / f"epochs_{index}.txt").read_text().split()
            assert epochs == ["0", "1", "2"]

    # kill -9 of worker 1 in the middle of epoch 1; the launcher restarts
    # both, every worker restores the chief's BackupAndRestore backup of
    # epoch 0, and the run ends where the uninterrupted one (fit2) ends.
    resumed = tutorial(2, tmp_path / "killed", "--mode=fit",
                       "--kill_at_epoch=1",
                       launcher_args=["--max_restarts", "1"])
    assert (tmp_path / "killed" / "killed").exists()
    for index in (0, 1):
        epochs = (tmp_path / "killed" / f"epochs_{index}.txt").read_text()
        # First attempt: epochs 0 and 1 (killed); second: 1 and 2.
        assert epochs.split() == ["0", "1", "1", "2"], (index, epochs)
    assert_identical(resumed[0], resumed[1])
    assert_close(resumed[0], fit2[0], tol=1e-6)

    # SIGTERM to worker 1 after batch 3 of epoch 1 (a scheduler preempting
    # its node; before, TensorFlow's notifier caught it and training went
    # on until the SIGKILL): both workers agree on that batch, the chief's
    # backup is written there and both exit 143; the launcher restarts
    # them, the rerun reads the epoch's first 4 batches without training
    # on them, and the run ends where the uninterrupted one ends (mutation
    # tried: the skip removed -> the weights differ).
    out = tmp_path / "termed"
    resumed = tutorial(2, out, "--mode=fit", "--term_at_epoch=1",
                       launcher_args=["--max_restarts", "1"])
    said = OUTPUTS["termed"]
    assert ("[worker 0] tfscale: preemption checkpoint complete: "
            f"{out / 'backup'} (epoch 2, batch 4, SIGTERM)") in said, said[-4000:]
    assert re.search(r"\[launcher\] worker \d was preempted \(exit 143\)",
                     said), said[-4000:]
    assert ("[worker 0] tfscale: resuming epoch 2 after its batch 4: its "
            "first 4 batches are read, not trained on") in said, said[-4000:]
    for index in (0, 1):
        epochs = (out / f"epochs_{index}.txt").read_text()
        assert epochs.split() == ["0", "1", "1", "2"], (index, epochs)
    assert_identical(resumed[0], resumed[1])
    assert_close(resumed[0], fit2[0], tol=1e-6)


def test_a_preempted_fit_without_a_backup_says_nothing_saved(tmp_path):
    code = tutorial(2, tmp_path / "unsaved", "--mode=fit", "--epochs=1",
                    "--term_at_epoch=0", "--no_backup",
                    launcher_args=["--max_restarts", "1"], expect_ok=False)
    said = OUTPUTS["unsaved"]
    assert code == 3, said[-4000:]
    assert ("[worker 0] tfscale: preempted (SIGTERM) in epoch 1 after batch "
            "4: no keras.callbacks.BackupAndRestore: nothing saved") in said
    assert said.rstrip().splitlines()[-1].startswith(
        "[launcher] exit 3: nothing saved: a restart would start over"), \
        said[-3000:]
    assert "restart 1/1" not in said

