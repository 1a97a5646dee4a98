"""The one-GPU levers, each behind its own flag, exact on the CPU.

Steps per launch (`TrainConfig.steps_per_launch`): K steps in one XLA
program end bit-identical to one step a launch, on the CPU layout and on
tf.distribute's GPU branch (`MirroredStrategy(["/gpu:0"])`), with dropout
and a step count that leaves steps over; flags, batch checks and the
layout's limits hold per launch. Dropout from 16 random bits
(`--dropout_bits=16`): the keep rate it states, over 10^6 draws.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks.gpu.step_calls import make_data
from models import bert, bert_config, elementwise
from tfscale.errors import ConfigError
from tfscale.optim.lamb import Lamb
from tfscale.cluster.signal_watch import SignalWatch
from tfscale.step.feed import BatchSizeError
from tfscale.trainer.loop import TrainConfig, Trainer

# One layer: the levers act on the step, not the depth (each trainer here
# compiles its programs with XLA, the cost of these tests).
TINY = bert_config.preset("bert_tiny", vocab_size=128, num_hidden_layers=1,
                          hidden_size=64, intermediate_size=128)


def bert_trainer(device="/cpu:0", steps_per_launch=1, devices=None,
                 **fields):
    keras.utils.set_random_seed(0)
    strategy = tf.distribute.MirroredStrategy(devices or [device])
    with strategy.scope():
        model = bert.make_pretrainer(TINY, 16, 4)
        optimizer = Lamb(1e-3, weight_decay_rate=0.01)
        metrics = bert.pretraining_metrics()
    config = dict(global_batch_size=8, jit_compile=True, compile_update=True,
                  verbose=0, steps_per_execution=6, log_steps=5,
                  timed_steps_per_log=0, max_call_seconds=0,
                  steps_per_launch=steps_per_launch)
    config.update(fields)
    return Trainer(model=model, optimizer=optimizer, strategy=strategy,
                   loss_fn=bert.pretraining_loss, metrics=metrics,
                   config=TrainConfig(**config))


def train(trainer, steps=13, data=None):
    data = data if data is not None else make_data(8, 16, 4, 128)
    trainer.fit(lambda context: data, steps_per_epoch=steps, epochs=1)
    return ([v.numpy() for v in trainer.model.weights],
            [row["interval_loss"] for row in trainer.intervals])


@pytest.mark.parametrize("device", ["/cpu:0", "/gpu:0"])
def test_k_steps_a_launch_end_where_one_step_a_launch_ends(device):
    """13 steps in calls of up to 6, 3 a launch: whole launches and the
    steps left over before each log boundary; with dropout."""
    one, one_losses = train(bert_trainer(device, 1))
    launched = bert_trainer(device, 3)
    assert launched.step_layout.startswith("one XLA program per 3 steps")
    many, many_losses = train(launched)
    assert int(launched.step.numpy()) == 13
    assert many_losses == one_losses
    for a, b in zip(one, many):
        np.testing.assert_array_equal(a, b)


class StopAtOnce(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.model.stop_training = True


def test_a_raised_flag_ends_the_call_after_its_first_launch():
    trainer = bert_trainer(steps_per_launch=3, steps_per_execution=9,
                           log_steps=9)
    trainer.fit(lambda context: make_data(8, 16, 4, 128), steps_per_epoch=27,
                epochs=1, callbacks=[StopAtOnce()])
    assert int(trainer.step.numpy()) == 3  # one launch, not the call's 9


def test_every_steps_batch_is_checked_inside_a_launch():
    trainer = bert_trainer(steps_per_launch=3)
    x, y = make_data(8, 16, 4, 128).take(1).get_single_element()
    short = tf.data.Dataset.from_tensors((x, y)).repeat(4).concatenate(
        tf.data.Dataset.from_tensors(tf.nest.map_structure(
            lambda t: t[:5], (x, y)))).repeat()
    with pytest.raises(BatchSizeError):
        trainer.fit(lambda context: short, steps_per_epoch=12, epochs=1)


@pytest.mark.parametrize("device", ["/cpu:0", "/gpu:0"])
def test_a_signal_while_the_first_launch_compiles_ends_the_worker_at_once(
        device, monkeypatch, tmp_path):
    """XLA compiles the K-step program in the first call that launches
    one (minutes for BERT on a GPU): that call is armed like a fit's first
    call (a signal ends the process at once, the run being what is on
    disk), with a line that names the steps the restart runs again; its
    time is kept out of the pace; no later call is armed."""
    armed = []

    def record(watch, say):
        armed.append(None if say is None else say.keywords["phase"])
        if say is not None:
            armed.append(say("SIGTERM"))
        watch._state.at_once = say

    monkeypatch.setattr(SignalWatch, "exit_at_once", record)
    trainer = bert_trainer(device, steps_per_launch=3, steps_per_execution=9,
                           log_steps=9, max_call_seconds=60,
                           checkpoint_dir=str(tmp_path / "ckpt"))
    assert not trainer.launch_ran
    trainer.fit(lambda context: make_data(8, 16, 4, 128), steps_per_epoch=27,
                epochs=1)
    assert trainer.launch_ran
    phases = [a for a in armed if not isinstance(a, tuple)]
    lines = [a for a in armed if isinstance(a, tuple)]
    launch = "compiling its 3-step launch"
    assert phases[0] == "restoring, tracing, compiling"
    assert phases.count(launch) == 1
    assert all(p is None for p in phases[phases.index(launch) + 1:])
    first, compiling = lines
    assert first == ("tfscale: worker 0: SIGTERM before step 1's call ended "
                     "(restoring, tracing, compiling): nothing trained since "
                     "the run's start; exiting at once with code 143", 143)
    # Calls of 1, 1, 2 and 2 steps before it (the pace, far from its
    # bound, doubles the steps a call measured, one call late).
    assert compiling == ("tfscale: worker 0: SIGTERM before step 7's call "
                         "ended (compiling its 3-step launch): steps 1-6 not "
                         "saved (the restart runs them again from the run's "
                         "start); exiting at once with code 143", 143)


def test_k_steps_a_launch_need_the_step_to_be_one_program():
    with pytest.raises(ConfigError, match=r"steps_per_launch 3 needs the "
                       r"step to be one XLA program .* this step: compute "
                       r"in XLA"):
        bert_trainer(steps_per_launch=3, devices=["/cpu:0", "/cpu:1"],
                     global_batch_size=16)
    with pytest.raises(ConfigError, match="steps_per_launch must be >= 1"):
        TrainConfig(global_batch_size=8, steps_per_launch=0)


def test_sixteen_bit_dropout_keeps_the_rate_it_states():
    """10^6 draws at rate 0.1: the kept share within 5 standard deviations
    of 1 - 6554/65536 (the rate quantized to 1/65,536), the kept values
    scaled by its inverse, the gradient through the same mask."""
    x = tf.ones([1000, 1000], tf.float32)
    seed = tf.constant([11, 7])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = elementwise.dropout(x, 0.1, seed, bits=16)
    keep_probability = 1 - 6554 / 65536
    kept = float(tf.reduce_mean(tf.cast(y != 0, tf.float64)))
    sigma = (keep_probability * (1 - keep_probability) / 1e6) ** 0.5
    assert abs(kept - keep_probability) < 5 * sigma, kept
    values = np.unique(y.numpy())
    np.testing.assert_allclose(values, [0.0, 1 / keep_probability],
                               rtol=1e-7)
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), y.numpy())
    again = elementwise.dropout(x, 0.1, seed, bits=16)
    other = elementwise.dropout(x, 0.1, tf.constant([11, 8]), bits=16)
    assert np.array_equal(again.numpy(), y.numpy())
    assert not np.array_equal(other.numpy(), y.numpy())
    # Other masks than the 32-bit draw's, under XLA the same as without.
    assert not np.array_equal(
        elementwise.dropout(x, 0.1, seed).numpy() != 0, y.numpy() != 0)
    compiled = tf.function(lambda x: elementwise.dropout(x, 0.1, seed,
                                                         bits=16),
                           jit_compile=True)
    np.testing.assert_array_equal(compiled(x).numpy(), y.numpy())


def test_bert_with_sixteen_bit_dropout_trains():
    keras.utils.set_random_seed(0)
    model = bert.make_pretrainer(TINY, 16, 4, dropout_bits=16)
    x, y = make_data(8, 16, 4, 128).take(1).get_single_element()
    loss = tf.reduce_mean(bert.pretraining_loss(y, model(x, training=True)))
    assert np.isfinite(float(loss))
    layer = model.encoder.layer_0
    assert layer.attention.dropout.bits == layer.output_dropout.bits == 16
