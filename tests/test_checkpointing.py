"""Training checkpoints hold the whole run (in one process, two logical CPUs).

Model-only restore of BERT gives every weight; layers in a plain list are
still saved; a resumed run with dropout and shuffled data ends bit-identical
to an uninterrupted one; an incompatible checkpoint is one error naming the
variable and both shapes.
"""

import os
import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import bert, bert_config
from tests.conftest import REPO
from tests.test_trainer import TWO_CPUS, mirrored
from tfscale import durable
from tfscale.errors import DiskFull
from tfscale.resume import checkpoints as checkpointing
from tfscale.trainer.loop import TrainConfig, Trainer

SEQ, PRED = 16, 4
ONE_CPU = ["/cpu:0"]  # tracing BERT for one replica is twice as fast


def tiny(vocab_size=64):
    return bert_config.preset("bert_tiny", vocab_size=vocab_size)


def bert_batches(n=64, seed=0, vocab_size=64):
    rng = np.random.RandomState(seed)
    inputs = {
        "input_ids": rng.randint(5, vocab_size, (n, SEQ)).astype("int32"),
        "input_mask": np.ones((n, SEQ), "int32"),
        "segment_ids": np.zeros((n, SEQ), "int32"),
        "masked_lm_positions": rng.randint(1, SEQ, (n, PRED)).astype("int32"),
    }
    labels = {
        "masked_lm_ids": rng.randint(5, vocab_size, (n, PRED)).astype("int32"),
        "masked_lm_weights": np.ones((n, PRED), "float32"),
        "next_sentence_labels": rng.randint(0, 2, (n, 1)).astype("int32"),
    }
    return inputs, labels


def bert_trainer(strategy, checkpoint_dir, seed=1, vocab_size=64, **config):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = bert.make_pretrainer(tiny(vocab_size), SEQ, PRED)
        optimizer = keras.optimizers.Adam(1e-3)
        metrics = bert.pretraining_metrics()
    return Trainer(model=model, optimizer=optimizer,
                   loss_fn=bert.pretraining_loss, strategy=strategy,
                   metrics=metrics, config=TrainConfig(
                       global_batch_size=8, checkpoint_dir=checkpoint_dir,
                       verbose=0, **config))


def shuffled_fn(trainer, vocab_size=64):
    inputs, labels = bert_batches(vocab_size=vocab_size)

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((inputs, labels))
        ds = ds.shuffle(32, seed=5, reshuffle_each_iteration=True).repeat()
        return ds.batch(trainer.per_replica_batch_size).prefetch(2)
    return dataset_fn


def values(variables):
    return [np.array(v.numpy()) for v in variables]


def assert_bit_identical(variables, others):
    assert len(variables) == len(others)
    for a, b in zip(values(variables), values(others)):
        np.testing.assert_array_equal(a, b)


def test_bert_checkpoint_restores_every_weight_into_a_fresh_model(tmp_path):
    strategy = mirrored(ONE_CPU)
    trainer = bert_trainer(strategy, str(tmp_path))
    trainer.fit(shuffled_fn(trainer), steps_per_epoch=2)
    trained = values(trainer.model.weights)
    path = tf.train.latest_checkpoint(str(tmp_path))
    restored = []
    for seed in (7, 8):  # any weight the checkpoint lacks differs between them
        keras.utils.set_random_seed(seed)
        fresh = bert.make_pretrainer(tiny(), SEQ, PRED)
        # The plain TF2 idiom of fine-tuning scripts, nothing of tfscale's.
        tf.train.Checkpoint(model=fresh).restore(path).expect_partial()
        restored.append(values(fresh.weights))
    assert len(trained) == len(restored[0]) == 46
    for a, b, c in zip(trained, *restored):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_resume_with_dropout_and_shuffled_input_is_bit_identical(tmp_path):
    strategy = mirrored(TWO_CPUS)
    full = bert_trainer(strategy, str(tmp_path / "full"),
                        save_checkpoints_steps=3)
    full.fit(shuffled_fn(full), steps_per_epoch=6)
    first = bert_trainer(strategy, str(tmp_path / "split"),
                         save_checkpoints_steps=3)

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:  # after step 5: the checkpoint of step 3 is latest
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        first.fit(shuffled_fn(first), steps_per_epoch=6, callbacks=[Die()])
    second = bert_trainer(strategy, str(tmp_path / "split"),
                          save_checkpoints_steps=3)
    second.fit(shuffled_fn(second), steps_per_epoch=6)
    assert int(second.step.numpy()) == 6
    assert_bit_identical(full.model.variables, second.model.variables)
    assert_bit_identical(full.optimizer.variables, second.optimizer.variables)
    assert checkpointing.input_state_steps(str(tmp_path / "split"), 0, 1) == [
        3, 6]


class ListModel(keras.Model):
    """Keeps its layers in a plain list: invisible to TF's object graph."""

    def __init__(self):
        super().__init__()
        self.blocks = [keras.layers.Dense(4), keras.layers.Dropout(0.5),
                       keras.layers.BatchNormalization(), keras.layers.Dense(1)]

    def call(self, x, training=False):
        for block in self.blocks:
            x = block(x, training=training)
        return x


def test_layers_in_a_plain_list_are_still_in_the_training_checkpoint(tmp_path):
    strategy = mirrored(TWO_CPUS)
    x = np.random.RandomState(0).randn(64, 3).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def make(seed):
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            model = ListModel()
            model(x[:2])
            optimizer = keras.optimizers.SGD(0.1)
        assert len(checkpointing.unreachable_weights(model)) == 8
        return Trainer(model=model, optimizer=optimizer,
                       loss_fn=keras.losses.MeanSquaredError(),
                       strategy=strategy, config=TrainConfig(
                           global_batch_size=8, verbose=0,
                           checkpoint_dir=str(tmp_path)))

    def dataset_fn(trainer):
        return lambda context: tf.data.Dataset.from_tensor_slices(
            (x, y)).repeat().batch(trainer.per_replica_batch_size)

    trained = make(1)
    trained.fit(dataset_fn(trained), steps_per_epoch=3)
    resumed = make(2)  # other initial weights, BatchNorm statistics, seeds
    resumed.fit(dataset_fn(resumed), steps_per_epoch=3)  # nothing left to do
    assert int(resumed.step.numpy()) == 3
    assert_bit_identical(trained.model.variables, resumed.model.variables)


def test_incompatible_checkpoint_names_the_variable_and_both_shapes(tmp_path):
    strategy = mirrored(ONE_CPU)
    small = bert_trainer(strategy, str(tmp_path))
    small.fit(shuffled_fn(small), steps_per_epoch=1)
    other = bert_trainer(strategy, str(tmp_path), vocab_size=96)
    with pytest.raises(checkpointing.RestoreError) as error:
        other.fit(shuffled_fn(other, vocab_size=96), steps_per_epoch=2)
    message = str(error.value)
    shapes = (r"model/\S+ has shape \[64(, 128)?\] in the checkpoint but "
              r"\[96(, 128)?\] in the model")
    assert "\n" not in message and re.search(shapes, message), message
    fresh = bert.make_pretrainer(tiny(96), SEQ, PRED)
    with pytest.raises(checkpointing.RestoreError, match=shapes):
        checkpointing.restore_model(fresh, str(tmp_path))
    # Nothing was half-restored.
    assert int(other.step.numpy()) == 0


def test_restore_model_from_a_directory_restores_every_weight(tmp_path):
    strategy = mirrored(ONE_CPU)
    trainer = bert_trainer(strategy, str(tmp_path))
    trainer.fit(shuffled_fn(trainer), steps_per_epoch=1)
    keras.utils.set_random_seed(9)
    fresh = bert.make_pretrainer(tiny(), SEQ, PRED)
    path = checkpointing.restore_model(fresh, str(tmp_path))
    assert os.path.basename(path) == "ckpt-1"
    assert_bit_identical(trainer.model.weights, fresh.weights)


LOAD_EXPORT = """
import sys, numpy as np
from models import bert_export
data = dict(np.load(sys.argv[2]))
encoder = bert_export.load_encoder(sys.argv[1], max_seq_length=16)
sequence, pooled = encoder({k: data[k] for k in ("input_ids", "input_mask",
                                                 "segment_ids")})
model = bert_export.load_pretrainer(sys.argv[1], 16, 4)
mlm = model(data)["mlm_logits"]
np.savez(sys.argv[3], sequence=sequence, pooled=pooled, mlm=mlm)
"""


def test_export_loads_in_a_fresh_process_with_the_same_outputs(tmp_path):
    import subprocess
    import sys
    from models import bert_export
    from tests.conftest import REPO
    keras.utils.set_random_seed(4)
    model = bert.make_pretrainer(tiny(), SEQ, PRED)
    inputs, _ = bert_batches(n=3)
    bert_export.export(model, str(tmp_path / "export"))
    np.savez(tmp_path / "inputs.npz", **inputs)
    code = subprocess.run(
        [sys.executable, "-c", LOAD_EXPORT, str(tmp_path / "export"),
         str(tmp_path / "inputs.npz"), str(tmp_path / "outputs.npz")],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=120,
        capture_output=True, text=True)
    assert code.returncode == 0, code.stderr[-3000:]
    loaded = np.load(tmp_path / "outputs.npz")
    sequence, pooled = model.encoder(
        {k: inputs[k] for k in ("input_ids", "input_mask", "segment_ids")})
    np.testing.assert_array_equal(loaded["sequence"], sequence.numpy())
    np.testing.assert_array_equal(loaded["pooled"], pooled.numpy())
    np.testing.assert_array_equal(loaded["mlm"],
                                  model(inputs)["mlm_logits"].numpy())


def test_trainer_checkpoint_wins_over_backup_and_restore(tmp_path):
    """BackupAndRestore holds epoch 0's end (step 4), the Trainer's checkpoint
    step 6: the resumed run must take step 6's weights, or it would train
    on from older weights with the newer step and end elsewhere."""
    from tests.test_trainer import data, dataset_fn_for, make_trainer
    x, y = data()
    strategy = mirrored(TWO_CPUS)
    config = dict(global_batch_size=16, save_checkpoints_steps=2, verbose=0)
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731

    def run(name, callbacks=()):
        trainer = make_trainer(strategy, TrainConfig(
            checkpoint_dir=str(tmp_path / name), **config), adam)
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / f"b_{name}"))
        trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=4,
                    epochs=2, callbacks=[backup, *callbacks])
        return trainer

    full = run("full")

    class Die(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            # Step 7 begins: ckpt-6 is saved, the backup still holds step 4.
            if self.model.optimizer.iterations.numpy() == 6:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run("split", [Die()])
    assert os.path.exists(tmp_path / "b_split")  # a backup of step 4 is there
    resumed = run("split")
    assert int(resumed.step.numpy()) == 8
    assert_bit_identical(full.model.variables, resumed.model.variables)


def test_a_fit_restores_once_and_builds_its_positioned_input_once(
        tmp_path, monkeypatch):
    """The checkpoint is read once even when BackupAndRestore loaded its
    own weights first, and a positioned input is built once, where the run
    starts (not at the checkpoint's position and again at the epoch a
    callback or initial_epoch names)."""
    from tests.test_trainer import data, dataset_fn_for, make_trainer
    x, y = data()
    strategy = mirrored(TWO_CPUS)
    restores = []
    original = checkpointing.CheckpointKeeper.restore_latest
    monkeypatch.setattr(
        checkpointing.CheckpointKeeper, "restore_latest",
        lambda keeper: restores.append(1) or original(keeper))

    def positioned(trainer, starts):
        plain = dataset_fn_for(trainer, x, y)
        plain.at = lambda position: starts.append(position) or plain
        return plain

    def run(name, epochs, initial_epoch=0, callbacks=()):
        trainer = make_trainer(strategy, TrainConfig(
            global_batch_size=16, checkpoint_dir=str(tmp_path / name),
            save_checkpoints_steps=2, verbose=0))
        starts = []
        restores.clear()
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / f"b_{name}"))
        try:
            trainer.fit(positioned(trainer, starts), steps_per_epoch=4,
                        epochs=epochs, initial_epoch=initial_epoch,
                        callbacks=[backup, *callbacks])
        finally:
            run.starts, run.restores = starts, len(restores)

    class Die(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            # Step 7 begins: ckpt-6 is saved, the backup holds epoch 0.
            if self.model.optimizer.iterations.numpy() == 6:
                raise KeyboardInterrupt

    run("fresh", epochs=2, initial_epoch=1)
    assert run.starts == [64]  # epoch 1: 4 steps x 16 records
    with pytest.raises(KeyboardInterrupt):
        run("killed", epochs=2, callbacks=[Die()])
    assert os.path.exists(tmp_path / "b_killed")
    run("killed", epochs=2)  # ckpt-6 read; the backup of epoch 0 not loaded
    assert (run.starts, run.restores) == ([96], 1)


def test_a_resumed_run_does_not_save_the_step_it_restored(tmp_path,
                                                           monkeypatch):
    """A run restored at its last step (a finished run fit again, or a
    restart right after the final save) writes no second checkpoint of
    that step: the restored step counts as saved."""
    from tests.test_trainer import data, dataset_fn_for, make_trainer
    x, y = data()
    strategy = mirrored(TWO_CPUS)
    saved = []
    original = checkpointing.CheckpointKeeper.save
    monkeypatch.setattr(
        checkpointing.CheckpointKeeper, "save",
        lambda keeper, step: saved.append(step) or original(keeper, step))

    def run():
        trainer = make_trainer(strategy, TrainConfig(
            global_batch_size=16, checkpoint_dir=str(tmp_path / "ckpt"),
            save_checkpoints_steps=4, verbose=0))
        trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=4,
                    epochs=2)
        return trainer

    run()
    assert saved == [4, 8]
    saved.clear()
    again = run()
    assert saved == [] and int(again.step.numpy()) == 8
    assert again.checkpoint_path is None  # this Trainer wrote none


def test_export_command_writes_keras_files_and_googles_checkpoint(tmp_path):
    import subprocess
    import sys
    from models import bert_checkpoints, bert_export
    from tests.conftest import REPO
    strategy = mirrored(ONE_CPU)
    trainer = bert_trainer(strategy, str(tmp_path / "ckpt"))
    trainer.fit(shuffled_fn(trainer), steps_per_epoch=1)
    (tmp_path / "bert_config.json").write_text(
        __import__("json").dumps(tiny().to_dict()))
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    out = tmp_path / "export"
    done = subprocess.run(
        [sys.executable, "export_bert.py", f"--checkpoint={tmp_path}/ckpt",
         f"--bert_config_file={tmp_path}/bert_config.json",
         f"--vocab_file={tmp_path}/vocab.txt", f"--output_dir={out}"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=120,
        capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(out)) == sorted([
        "bert_config.json", "bert_pretrainer.weights.h5", "encoder.weights.h5",
        "vocab.txt", "checkpoint", "bert_model.ckpt.index",
        "bert_model.ckpt.data-00000-of-00001"])
    from_keras = bert_export.load_pretrainer(str(out), SEQ, PRED)
    from_google = bert.make_pretrainer(tiny(), SEQ, PRED)
    bert_checkpoints.load_google_checkpoint(from_google,
                                            str(out / "bert_model.ckpt"))
    assert_bit_identical(trainer.model.weights, from_keras.weights)
    assert_bit_identical(trainer.model.weights, from_google.weights)
    bad = subprocess.run(
        [sys.executable, "export_bert.py", f"--checkpoint={tmp_path}/nothing",
         f"--bert_config_file={tmp_path}/bert_config.json",
         f"--output_dir={out}"], cwd=REPO, timeout=120, capture_output=True,
        text=True, env=dict(os.environ, PYTHONPATH=REPO))
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].startswith(
        "export_bert: error: --checkpoint: ")


def test_phase_one_checkpoint_initialises_a_longer_sequence_phase_two(tmp_path):
    """NVIDIA's two-phase recipe: seq 16 here stands for 128, 32 for 512."""
    trainer = bert_trainer(mirrored(ONE_CPU), str(tmp_path))
    trainer.fit(shuffled_fn(trainer), steps_per_epoch=1)
    keras.utils.set_random_seed(11)
    phase_two = bert.make_pretrainer(tiny(), 2 * SEQ, PRED + 2)
    checkpointing.restore_model(phase_two, str(tmp_path))
    assert_bit_identical(trainer.model.weights, phase_two.weights)


def test_a_save_killed_midway_leaves_no_temp_folder_behind(tmp_path):
    """TensorFlow writes a checkpoint's shards into `ckpt-N_temp/` and
    merges them into place: a save killed there (kill -9) left the folder
    for good. The next start removes it, the chief's and each worker's
    input folder's, and resumes from the last whole checkpoint."""
    from tests.test_trainer import data, dataset_fn_for, make_trainer
    x, y = data()
    config = TrainConfig(global_batch_size=16, save_checkpoints_steps=2,
                         verbose=0, checkpoint_dir=str(tmp_path / "ckpt"))
    trainer = make_trainer(mirrored(TWO_CPUS), config)
    trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=4)
    input_folder = checkpointing.input_dir(str(tmp_path / "ckpt"), 0, 1)
    leftovers = [tmp_path / "ckpt" / "ckpt-6_temp",
                 pathlib.Path(input_folder) / "ckpt-6_temp"]
    for leftover in leftovers:  # what a save killed at step 6 leaves
        leftover.mkdir()
        (leftover / "part-00000-of-00001.data-00000-of-00001").write_bytes(
            b"\0" * 64)
    resumed = make_trainer(mirrored(TWO_CPUS), config)
    resumed.fit(dataset_fn_for(resumed, x, y), steps_per_epoch=4, epochs=2)
    assert int(resumed.step.numpy()) == 8
    assert not any(leftover.exists() for leftover in leftovers)


def flip_a_data_byte(prefix):
    (data,) = tf.io.gfile.glob(prefix + ".data-*")
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupt_latest_checkpoint_is_passed_over_for_the_one_before(
        tmp_path, caplog):
    """ckpt-4 with a flipped byte (TensorFlow: "Checksum does not match"):
    named, moved aside whole into ckpt-4.corrupt/, ckpt-2 restored; the run
    then ends bit-identical to an uninterrupted one (before: DataLossError,
    exit 1, restarted into the same error; mutation tried: the corrupt
    case re-raised -> fails)."""
    strategy = mirrored(ONE_CPU)
    full = bert_trainer(strategy, str(tmp_path / "full"),
                        save_checkpoints_steps=2)
    full.fit(shuffled_fn(full), steps_per_epoch=6)
    split = str(tmp_path / "split")
    first = bert_trainer(strategy, split, save_checkpoints_steps=2)
    first.fit(shuffled_fn(first), steps_per_epoch=4)
    flip_a_data_byte(os.path.join(split, "ckpt-4"))
    second = bert_trainer(strategy, split, save_checkpoints_steps=2)
    with caplog.at_level("WARNING"):
        second.fit(shuffled_fn(second), steps_per_epoch=6)
    said = [r.getMessage() for r in caplog.records
            if "is corrupt" in r.getMessage()]
    assert said == [
        "tfscale: ckpt-4 is corrupt (Checksum does not match): moved to "
        f"ckpt-4.corrupt; resumed from {os.path.join(split, 'ckpt-2')}"]
    assert sorted(os.listdir(os.path.join(split, "ckpt-4.corrupt"))) == [
        "ckpt-4.data-00000-of-00001", "ckpt-4.index"]
    assert int(second.step.numpy()) == 6
    assert tf.train.latest_checkpoint(split).endswith("ckpt-6")
    assert_bit_identical(full.model.variables, second.model.variables)
    assert_bit_identical(full.optimizer.variables, second.optimizer.variables)


def test_no_whole_checkpoint_left_is_one_line(tmp_path):
    strategy = mirrored(ONE_CPU)
    trainer = bert_trainer(strategy, str(tmp_path), save_checkpoints_steps=2,
                           max_checkpoints_to_keep=1)
    trainer.fit(shuffled_fn(trainer), steps_per_epoch=2)
    flip_a_data_byte(os.path.join(str(tmp_path), "ckpt-2"))
    again = bert_trainer(strategy, str(tmp_path), save_checkpoints_steps=2)
    with pytest.raises(checkpointing.RestoreError,
                       match=r": ckpt-2 is corrupt \(Checksum does not "
                             r"match\): moved to ckpt-2.corrupt; no whole "
                             r"checkpoint is left to resume from"):
        again.fit(shuffled_fn(again), steps_per_epoch=4)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 kB file system of its own (tmpfs; skipped where this user
    cannot mount one)."""
    import subprocess
    folder = tmp_path / "disk"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs",
                           str(folder)], capture_output=True)
    if done.returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield str(folder)
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def keeper_of(folder, values=32 * 1024):
    weights = tf.Variable(tf.zeros([values]))
    return checkpointing.CheckpointKeeper(folder, is_chief=True,
                                          weights=weights)


def test_a_full_disk_is_one_line_before_the_save_and_while_it(small_disk,
                                                            monkeypatch):
    """Before: `ResourceExhaustedError: ...ckpt-300_temp...; No space left
    on device`, exit 1, restarted into the same error. Now `DiskFull` (exit
    2, not restarted) naming the folder, the last checkpoint's bytes and
    the bytes free; checked before the save, and a save that fills the
    disk leaves no `_temp` folder (mutations tried: the ENOSPC branch
    removed -> TensorFlow's ResourceExhaustedError here; the check before
    the save removed -> the next test fails)."""
    keeper = keeper_of(small_disk)
    assert keeper.save(1).endswith("ckpt-1")  # 128 kB of 256
    with pytest.raises(DiskFull, match=(
            rf"^no room for checkpoint ckpt-2 in {small_disk}: the last one "
            r"\(ckpt-1\) took 131\.\d kB, \d+\.\d kB free; free space")):
        keeper.save(2)
    monkeypatch.setattr(checkpointing, "check_room", lambda *a: None)
    with pytest.raises(DiskFull, match="no room for checkpoint ckpt-2"):
        keeper.save(2)
    assert sorted(os.listdir(small_disk)) == [
        "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
    assert tf.train.latest_checkpoint(small_disk).endswith("ckpt-1")


def test_the_room_check_reads_the_free_bytes_of_the_folder(tmp_path,
                                                           monkeypatch):
    keeper = keeper_of(str(tmp_path), values=16)
    keeper.save(1)
    monkeypatch.setattr(durable, "free_bytes", lambda folder: 10)
    with pytest.raises(DiskFull, match=r"took \d+ B, 10 B free"):
        keeper.save(2)


def test_a_failed_write_names_its_path_and_leaves_no_partial_file(tmp_path):
    def fill(path):
        with open(path, "wb") as f:
            f.write(b"\0" * 2048)
        raise OSError(28, "Can't synchronously write data")

    final = str(tmp_path / "encoder.weights.h5")
    with pytest.raises(DiskFull, match=(
            rf"^cannot write {final}: the disk is full \(.* free in ")):
        durable.commit(fill, final)
    assert os.listdir(tmp_path) == []

    def refuse(path):
        raise PermissionError(13, "Permission denied")

    with pytest.raises(OSError, match=f"cannot write {final}: Permission "
                                      "denied"):
        durable.commit(refuse, final)


def test_a_job_that_meets_a_full_disk_exits_2_in_one_line(tmp_path):
    import subprocess
    import sys
    script = ("from tfscale import cli\n"
              "from tfscale.errors import DiskFull\n"
              "def job(config):\n"
              "    raise DiskFull('no room for checkpoint ckpt-2 in /x')\n"
              "cli.run_job('run_pretraining', job, None)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "run_pretraining: error: no room for checkpoint ckpt-2 in /x")
    assert "Traceback" not in done.stderr


def test_a_worker_other_than_the_chief_names_the_chiefs_checkpoint(tmp_path):
    """Before: after a Ctrl-C at step 197, worker 1 said `saved
    .../ckpt-121` (the checkpoint it had restored) while worker 0 wrote
    ckpt-197: a worker's own save goes to a private folder and named
    nothing (mutation tried: `path or chief_path` -> `path` fails)."""
    from tfscale.resume.position import RunPosition
    from tfscale.resume.start import Saver
    position = RunPosition(8)
    keeper = checkpointing.CheckpointKeeper(
        str(tmp_path), is_chief=False, worker_index=1, num_workers=2,
        step=position.step_variable)
    saver = Saver(keeper, position)
    saver.saved_at(121, str(tmp_path / "ckpt-121"))
    position.advance(197)
    saver.save()
    assert saver.on_disk == str(tmp_path / "ckpt-197")
    keeper.close()
