"""The Trainer in one process, under MirroredStrategy on two logical CPUs."""

import csv
import threading
import weakref
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale import precision
from tfscale.trainer.loop import TrainConfig, Trainer

TWO_CPUS = ["/cpu:0", "/cpu:1"]
_STRATEGIES = {}


def mirrored(devices):
    """One strategy per device set for the whole process: collective keys of
    separate MirroredStrategy objects over the same devices collide."""
    key = tuple(devices)
    if key not in _STRATEGIES:
        _STRATEGIES[key] = tf.distribute.MirroredStrategy(list(devices))
    return _STRATEGIES[key]


def data(n=256, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, 6).astype("float32")
    y = (x @ rng.randn(6, 1)).astype("float32")
    return x, y


def build(strategy, optimizer_fn=lambda: keras.optimizers.SGD(0.05), seed=3):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        optimizer = optimizer_fn()
        metrics = [keras.metrics.MeanAbsoluteError(name="mae")]
    return model, optimizer, metrics


def make_trainer(strategy, config, optimizer_fn=lambda: keras.optimizers.SGD(0.05)):
    model, optimizer, metrics = build(strategy, optimizer_fn)
    trainer = Trainer(model=model, optimizer=optimizer,
                      loss_fn=keras.losses.MeanSquaredError(),
                      strategy=strategy, config=config, metrics=metrics)
    return trainer


def dataset_fn_for(trainer, x, y, repeat=True):
    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.repeat() if repeat else ds
        return ds.batch(trainer.per_replica_batch_size)
    return dataset_fn


def weights(model):
    return [v.numpy() for v in model.trainable_variables]


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []
        self.batch_logs = []

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(f"epoch_begin_{epoch}")

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(dict(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(f"epoch_end_{epoch}")

    def on_train_end(self, logs=None):
        self.calls.append("train_end")


def test_trains_on_two_replicas_and_drives_callbacks():
    strategy = mirrored(TWO_CPUS)
    trainer = make_trainer(strategy, TrainConfig(global_batch_size=32,
                                                 log_steps=5, verbose=0))
    x, y = data()
    recorder = Recorder()
    history = trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=10,
                          epochs=3, callbacks=[recorder])
    assert recorder.calls == ["train_begin", "epoch_begin_0", "epoch_end_0",
                              "epoch_begin_1", "epoch_end_1", "epoch_begin_2",
                              "epoch_end_2", "train_end"]
    assert len(recorder.batch_logs) == 30
    # What model.fit's logs hold, nothing more (a CSVLogger's columns).
    assert all(set(logs) == {"loss", "mae"} for logs in recorder.batch_logs)
    assert set(history.history) == {"loss", "mae"}
    # The interval's numbers in their own place.
    assert [r["step"] for r in trainer.intervals] == list(range(5, 31, 5))
    assert [r["first"] for r in trainer.intervals] == [True] + [False] * 5
    report = trainer.intervals[0]  # log_steps=5: step 5 reports
    assert report["learning_rate"] == pytest.approx(0.05)
    assert report["examples_per_second"] > 0
    parts = sum(report[p] for p in ("input_wait", "compute", "sync", "update"))
    assert parts == pytest.approx(report["timed_step_time"], rel=0.05)
    assert report["interval_loss"] > 0
    losses = history.history["loss"]
    assert losses[-1] < 0.5 * losses[0]
    assert int(trainer.step.numpy()) == 30
    assert int(trainer.optimizer.iterations.numpy()) == 30


def test_timed_and_fused_steps_train_alike():
    # All steps timed (part by part) versus the default (mostly fused).
    x, y = data()
    results = []
    for timed in (100, 4):
        trainer = make_trainer(mirrored(TWO_CPUS), TrainConfig(
            global_batch_size=16, log_steps=100, timed_steps_per_log=timed,
            verbose=0))
        trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=8)
        results.append(weights(trainer.model))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_accumulation_matches_one_big_batch():
    x, y = data()
    big = make_trainer(mirrored(["/cpu:0"]),
                       TrainConfig(global_batch_size=32, verbose=0))
    big.fit(dataset_fn_for(big, x, y), steps_per_epoch=5)
    # Two replicas x two micro-batches of 8 = the same 32 examples per step.
    accum = make_trainer(mirrored(TWO_CPUS),
                         TrainConfig(global_batch_size=32,
                                     num_accumulation_steps=2, verbose=0))
    assert accum.per_replica_batch_size == 8
    accum.fit(dataset_fn_for(accum, x, y), steps_per_epoch=5)
    for a, b in zip(weights(big.model), weights(accum.model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(accum.optimizer.iterations.numpy()) == 5


def test_a_micro_batch_sets_the_accumulation_for_the_replica_count():
    # Elastic: the same global batch and micro-batches on 1 or 2 replicas.
    one = make_trainer(mirrored(["/cpu:0"]), TrainConfig(
        global_batch_size=32, micro_batch_size=8, verbose=0))
    two = make_trainer(mirrored(TWO_CPUS), TrainConfig(
        global_batch_size=32, micro_batch_size=8, verbose=0))
    assert (one.per_replica_batch_size, one.config.num_accumulation_steps) \
        == (8, 4)
    assert (two.per_replica_batch_size, two.config.num_accumulation_steps) \
        == (8, 2)
    from tfscale.errors import ConfigError
    with pytest.raises(ConfigError, match=r"global batch 32 is not 2 "
                       r"replica\(s\) x micro-batch 12 x a whole number"):
        make_trainer(mirrored(TWO_CPUS), TrainConfig(
            global_batch_size=32, micro_batch_size=12, verbose=0))
    with pytest.raises(ConfigError, match="excludes num_accumulation_steps"):
        TrainConfig(global_batch_size=32, micro_batch_size=8,
                    num_accumulation_steps=2)


def test_xla_matches_no_xla():
    x, y = data()
    results = []
    for jit in (False, True):
        trainer = make_trainer(mirrored(TWO_CPUS),
                               TrainConfig(global_batch_size=16,
                                           jit_compile=jit, verbose=0))
        trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=6)
        results.append(weights(trainer.model))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_clipping_applies_to_the_reduced_gradient():
    x, y = data()
    trainer = make_trainer(mirrored(TWO_CPUS),
                           TrainConfig(global_batch_size=16,
                                       clip_global_norm=1e-3, verbose=0),
                           optimizer_fn=lambda: keras.optimizers.SGD(1.0))
    before = weights(trainer.model)
    trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=1)
    delta = np.sqrt(sum(np.sum((a - b) ** 2)
                        for a, b in zip(weights(trainer.model), before)))
    assert delta == pytest.approx(1e-3, rel=1e-3)


def test_resume_ends_where_uninterrupted_run_ends(tmp_path):
    x, y = data()
    config = dict(global_batch_size=16, save_checkpoints_steps=2, verbose=0)
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731  (has slots)
    full = make_trainer(mirrored(TWO_CPUS), TrainConfig(
        checkpoint_dir=str(tmp_path / "full"), **config), adam)
    full.fit(dataset_fn_for(full, x, y), steps_per_epoch=4, epochs=2)

    class StopAfter(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:  # after step 6 of the second attempt's epoch 1
                self.model.stop_training = True

    first = make_trainer(mirrored(TWO_CPUS), TrainConfig(
        checkpoint_dir=str(tmp_path / "split"), **config), adam)
    first.fit(dataset_fn_for(first, x, y), steps_per_epoch=4, epochs=1)
    assert int(first.step.numpy()) == 4
    second = make_trainer(mirrored(TWO_CPUS), TrainConfig(
        checkpoint_dir=str(tmp_path / "split"), **config), adam)
    second.fit(dataset_fn_for(second, x, y), steps_per_epoch=4, epochs=2)
    assert int(second.step.numpy()) == 8
    for a, b in zip(weights(full.model), weights(second.model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert second.checkpoint_path.endswith("ckpt-8")


def test_evaluate_counts_every_example_once():
    x, y = data(n=50)
    trainer = make_trainer(mirrored(TWO_CPUS),
                           TrainConfig(global_batch_size=16, verbose=0))
    logs = trainer.evaluate(dataset_fn_for(trainer, x, y, repeat=False))
    prediction = trainer.model.predict(x, verbose=0)
    expected = np.mean((prediction - y) ** 2)
    assert logs["loss"] == pytest.approx(expected, rel=1e-5)
    assert logs["mae"] == pytest.approx(np.mean(np.abs(prediction - y)),
                                        rel=1e-5)


def test_float16_skips_non_finite_steps_and_lowers_the_scale():
    precision.set_precision("mixed_float16")
    try:
        x, y = data()
        trainer = make_trainer(mirrored(TWO_CPUS),
                               TrainConfig(global_batch_size=16, verbose=0,
                                           precision="mixed_float16",
                                           log_steps=40))
        trainer.loss_scale.scale.assign(2.0 ** 40)  # overflows float16
        recorder = Recorder()
        history = trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=40,
                              callbacks=[recorder])
    finally:
        precision.set_precision("float32")
    skipped = int(trainer.step.numpy()) - int(trainer.optimizer.iterations.numpy())
    assert skipped > 0
    report = trainer.intervals[-1]
    assert report["skipped_steps"] == skipped
    assert report["loss_scale"] == float(trainer.loss_scale.scale.numpy())
    assert float(trainer.loss_scale.scale.numpy()) < 2.0 ** 40
    assert np.isfinite(history.history["loss"][-1])
    assert all(np.all(np.isfinite(w)) for w in weights(trainer.model))


def test_keras_file_callbacks_work(tmp_path):
    x, y = data()
    trainer = make_trainer(mirrored(TWO_CPUS),
                           TrainConfig(global_batch_size=16, verbose=0))
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")),
        keras.callbacks.BackupAndRestore(str(tmp_path / "backup"),
                                         delete_checkpoint=False),
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.EarlyStopping(monitor="loss", patience=100),
    ]
    trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=3, epochs=2,
                callbacks=callbacks)
    assert (tmp_path / "m.weights.h5").exists()
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert os.listdir(tmp_path / "tb" / "train")
    assert (tmp_path / "backup" / "training_metadata.json").exists()


def test_early_stopping_stops_training():
    x, y = data()
    trainer = make_trainer(mirrored(TWO_CPUS),
                           TrainConfig(global_batch_size=16, verbose=0))
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=0,
                                            min_delta=1e9)
    history = trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=2,
                          epochs=10, callbacks=[stopper])
    assert len(history.history["loss"]) == 2


def test_terminate_on_nan_stops_at_the_bad_step():
    x, y = data()
    y = y.copy()
    y[40:48] = np.nan  # the third batch of 16
    trainer = make_trainer(mirrored(TWO_CPUS),
                           TrainConfig(global_batch_size=16, verbose=0))
    trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=10,
                callbacks=[keras.callbacks.TerminateOnNaN()])
    assert int(trainer.step.numpy()) == 3


def test_batch_must_divide_into_replicas_and_micro_batches():
    with pytest.raises(ValueError, match="not divisible by replicas"):
        make_trainer(mirrored(TWO_CPUS),
                     TrainConfig(global_batch_size=30,
                                 num_accumulation_steps=4))


def test_fit_and_evaluate_delete_their_iterators_off_the_main_thread(
        tmp_path, monkeypatch):
    # Deleting a tf.data iterator can block for up to a minute in TF 2.21
    # (see step/feed.py); the Trainer must leave no reference behind (a
    # checkpoint, a cycle) so the background thread does the deletion.
    from tfscale.step import feed as replica_feed
    freed = []
    original_init = replica_feed.ReplicaFeed.__init__
    original_iter = iter

    def watch(iterator):
        weakref.finalize(iterator, lambda: freed.append(
            threading.current_thread().name))

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        watch(self.iterator)

    monkeypatch.setattr(replica_feed.ReplicaFeed, "__init__", init)
    x, y = data(n=64)
    trainer = make_trainer(mirrored(TWO_CPUS), TrainConfig(
        global_batch_size=16, checkpoint_dir=str(tmp_path), verbose=0))
    strategy = trainer.strategy
    original_distribute = strategy.distribute_datasets_from_function

    def distribute(*args, **kwargs):
        dataset = original_distribute(*args, **kwargs)

        class Watched:
            def __iter__(self):
                iterator = original_iter(dataset)
                watch(iterator)
                return iterator
        return Watched()

    monkeypatch.setattr(strategy, "distribute_datasets_from_function",
                        distribute)
    trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=2, epochs=1,
                validation_data=dataset_fn_for(trainer, x, y, repeat=False))
    for thread in threading.enumerate():
        if thread.name == "tfscale-delete-iterator":
            thread.join(60)
    assert freed == ["tfscale-delete-iterator"] * 2


def test_an_error_in_fit_closes_the_callbacks_files_and_keeps_the_backup(
        tmp_path):
    """on_train_end never runs after an error: the Trainer closes what
    TensorBoard and CSVLogger hold open, and BackupAndRestore's backup (which
    only a normal end deletes) stays for the restart."""
    strategy = mirrored(TWO_CPUS)
    trainer = make_trainer(strategy, TrainConfig(global_batch_size=16,
                                                 log_steps=2))
    x, y = data()

    class Fail(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(trainer.step.numpy()) == 7:
                raise RuntimeError("injected")

    board = keras.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq=2)
    csv_logger = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=3,
                    epochs=5, callbacks=[board, csv_logger, backup, Fail()])
    assert csv_logger.csv_file.closed
    writers = board._writers.values()
    assert writers and all(w._closed for w in writers)
    rows = list(csv.reader(open(tmp_path / "log.csv")))
    assert [r[0] for r in rows[1:]] == ["0", "1"]
    assert (tmp_path / "backup" / "training_metadata.json").exists()


@pytest.mark.parametrize("drop_remainder", [True, False],
                         ids=["static batch", "dynamic batch"])
@pytest.mark.parametrize("per_call", [1, 4])
def test_a_dataset_fn_of_global_batches_is_refused(drop_remainder, per_call):
    """The Keras habit, batches of the global size, with 2 replicas and 2
    micro-batches: refused in one line naming dataset_fn, both batches and
    the arithmetic, whether the batch dimension is known when the step is
    traced (checked on the host) or not (on the device, first step of a
    call). Before the check it trained at 4x the gradient, silently."""
    from tfscale.step.feed import BatchSizeError
    trainer = make_trainer(mirrored(TWO_CPUS), TrainConfig(
        global_batch_size=32, num_accumulation_steps=2, verbose=0,
        steps_per_execution=per_call, log_steps=8, timed_steps_per_log=1))
    x, y = data()

    def dataset_fn(context):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
            32, drop_remainder=drop_remainder)

    with pytest.raises(BatchSizeError) as raised:
        trainer.fit(dataset_fn, steps_per_epoch=8)
    assert str(raised.value) == (
        "dataset_fn yields batches of 32 examples; the Trainer takes 8 per "
        "replica per micro-batch (global batch 32 = 8 per replica x 2 "
        "replica(s) x 2 accumulation step(s)): batch the dataset with "
        "trainer.per_replica_batch_size")
    assert "\n" not in str(raised.value)
    assert int(trainer.optimizer.iterations.numpy()) == 0


def test_model_fit_after_the_trainer_is_a_plain_model_fit():
    """The Trainer leaves the user's optimizer and model as it found them:
    on 2 replicas, `model.fit` of a model the Trainer trained ends where a
    plain `model.fit` from the same weights ends (the Trainer switched the
    optimizer's own cross-replica sum off for good: 0.6 away)."""
    strategy = mirrored(TWO_CPUS)
    x, y = data()
    models = []
    for seed in (3, 4):
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)),
                                      keras.layers.Dense(8, activation="tanh"),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        models.append(model)
    used, fresh = models
    optimizer = used.optimizer
    Trainer.from_compiled(used, TrainConfig(global_batch_size=32,
                                            verbose=0)).fit(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1)
    assert used.optimizer is optimizer
    assert "_all_reduce_sum_gradients" not in vars(optimizer)
    fresh.set_weights(used.get_weights())
    for model in models:
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(weights(used), weights(fresh)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


PLAIN_SCRIPT = """
import sys, tempfile
import keras, numpy as np, tensorflow as tf
from tfscale import Trainer, TrainConfig
x = np.random.RandomState(0).randn(256, 6).astype("float32")
y = x.sum(1, keepdims=True)
strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
trainer = Trainer.from_compiled(model, TrainConfig(
    global_batch_size=32, verbose=int(sys.argv[1]), log_steps=8,
    checkpoint_dir=tempfile.mkdtemp(), save_checkpoints_steps=8))
trainer.fit(lambda context: tf.data.Dataset.from_tensor_slices((x, y))
            .repeat().batch(32), steps_per_epoch=16)
"""


@pytest.mark.parametrize("verbose", [2, 0])
def test_a_plain_python_script_shows_progress_on_stdout(verbose):
    """From plain Python (no absl app): the interval and checkpoint lines on
    stdout at verbose 2 (they went to absl's INFO log, hidden there), none
    at 0; absl's INFO lines (TensorFlow's own) stay hidden either way."""
    import re
    import subprocess
    import sys
    from tests.conftest import REPO
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN_SCRIPT, str(verbose)], cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines()
             if line.startswith("tfscale: ")]
    if verbose == 2:
        assert [line.split(":")[1].strip() for line in lines
                if line.startswith("tfscale: step ")] == ["step 8", "step 16"]
        assert sum("saved checkpoint" in line for line in lines) == 2
    else:
        assert lines == []
    # (absl's INFO lines from Python; TensorFlow's C++ start-up lines
    # before absl's log is set up are not Python's to hide.)
    assert not re.search(r"^I\d{4} .*\.py:\d+\]", proc.stderr, re.MULTILINE)


def test_a_resume_with_another_global_batch_says_both(tmp_path, capsys):
    """The checkpoint keeps the run's global batch (NVIDIA's per-rank
    batch follows the rank count, so a restart on 3 ranks instead of 2
    goes on at another one): the resume line says the checkpoint's and
    this run's."""
    x, y = data()
    for batch, steps in ((16, 4), (32, 6)):
        trainer = make_trainer(mirrored(["/cpu:0"]), TrainConfig(
            global_batch_size=batch, verbose=2, log_steps=100,
            checkpoint_dir=str(tmp_path)))
        trainer.fit(dataset_fn_for(trainer, x, y), steps_per_epoch=steps)
    resumed = [line for line in capsys.readouterr().out.splitlines()
               if "resumed from" in line]
    assert len(resumed) == 1
    # (The input's saved tf.data state would bring back batches of 16.)
    assert resumed[0].endswith(
        "; input starts over (its saved state yields the checkpoint's "
        "batches, of another size); the checkpoint's run: global batch 16; "
        "this run: global batch 32")


def test_a_second_fit_trains_on_as_keras_fit_does(tmp_path):
    # Keras's fit called again trains `epochs - initial_epoch` more epochs
    # from where the model is; the Trainer trained 0 steps and returned {}.
    x, y = data()
    keras_model, keras_optimizer, _ = build(tf.distribute.get_strategy())
    keras_model.compile(optimizer=keras_optimizer, loss="mse")
    trainer = make_trainer(mirrored(["/cpu:0"]), TrainConfig(
        global_batch_size=16, verbose=0,
        checkpoint_dir=str(tmp_path / "ckpt")))
    runs = []
    for epochs, initial in ((1, 0), (1, 0), (3, 1)):
        keras_model.fit(x[:80], y[:80], batch_size=16, epochs=epochs,
                        initial_epoch=initial, shuffle=False, verbose=0)
        history = trainer.fit(dataset_fn_for(trainer, x[:80], y[:80]),
                              steps_per_epoch=5, epochs=epochs,
                              initial_epoch=initial)
        runs.append((int(trainer.step.numpy()),
                     int(keras_optimizer.iterations.numpy()),
                     len(history.history.get("loss", []))))
    assert runs == [(5, 5, 1), (10, 10, 1), (20, 20, 2)], runs
    assert trainer.checkpoint_path.endswith("ckpt-20")
    for a, b in zip(weights(keras_model), weights(trainer.model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ctrl_c_is_recorded_once():
    # The first SIGINT asks the run to save and stop at the agreed step (as
    # a preemption); outside fit, Python's own. Where SIGINT is ignored (a
    # background job), it stays ignored. (A second one ends the process at
    # once: tests/test_preemption_phases.py, in a process of its own.)
    import signal

    from tfscale.cluster.signal_watch import SignalWatch
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with SignalWatch() as watch:
            os.kill(os.getpid(), signal.SIGINT)
            assert watch.requested and watch.interrupted
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with SignalWatch() as watch:
            os.kill(os.getpid(), signal.SIGTERM)
            assert watch.requested and not watch.interrupted
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with SignalWatch() as watch:
            os.kill(os.getpid(), signal.SIGINT)
            assert not watch.requested
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
