"""`trainer.fit` takes what `model.fit` takes; `model.fit` with the switch
does the gradient math right on several replicas. In one process, two
logical CPUs (the two-worker runs are in test_keras_tutorial.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tests.test_trainer import TWO_CPUS, data, mirrored
from tfscale import _compat
from tfscale.trainer.loop import TrainConfig, Trainer

ONE_CPU = ["/cpu:0"]


def mlp(strategy, seed=3):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        return keras.Sequential([keras.Input((6,)),
                                 keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(1)])


def compiled_trainer(strategy, **compile_args):
    """An MLP compiled under `strategy` with SGD and MSE, and its Trainer
    (global batch 32)."""
    model = mlp(strategy)
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=compile_args.pop("loss", "mse"), **compile_args)
    return model, Trainer.from_compiled(
        model, TrainConfig(global_batch_size=32, verbose=0))


def weights(model):
    return [v.numpy() for v in model.trainable_variables]


def assert_same(a, b, tol=1e-5):
    for x, y in zip(weights(a), weights(b)):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def test_dataset_of_global_batches_matches_keras_fit_on_one_device():
    x, y = data(256)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    reference = mlp(tf.distribute.get_strategy())
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    reference.fit(dataset, epochs=2, verbose=0, shuffle=False)

    model, trainer = compiled_trainer(mirrored(TWO_CPUS))
    history = trainer.fit(dataset, epochs=2)
    assert history.epoch == [0, 1]
    assert int(trainer.step.numpy()) == 16
    assert_same(model, reference)


def test_arrays_validation_initial_epoch_and_compiled_metrics():
    x, y = data(256)
    xv, yv = data(70, seed=1)
    model, trainer = compiled_trainer(mirrored(TWO_CPUS), metrics=["mae"])
    history = trainer.fit(x, y, batch_size=32, epochs=3,
                          validation_data=(xv, yv), initial_epoch=1)
    assert history.epoch == [1, 2]
    assert {"loss", "mae", "val_loss", "val_mae"} <= set(history.history)
    # 256 examples, 8 steps per epoch, from epoch 1: 16 steps taken.
    assert int(trainer.step.numpy()) == 24
    # Every one of the 70 validation examples counts, as in Keras.
    logs = trainer.evaluate(xv, yv, batch_size=32)
    with tf.distribute.get_strategy().scope():
        plain = mlp(tf.distribute.get_strategy())
    plain.set_weights(model.get_weights())
    plain.compile(loss="mse", metrics=["mae"])
    expected = plain.evaluate(xv, yv, batch_size=32, verbose=0,
                              return_dict=True)
    assert logs["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert logs["mae"] == pytest.approx(expected["mae"], rel=1e-5)
    assert history.history["val_loss"][-1] == pytest.approx(logs["loss"],
                                                            rel=1e-5)


def test_sample_weights_as_keras_fit_weighs_them():
    """The Loss goes through its own __call__ (dtype conversion, weights),
    with the reduction the step needs: same result as Keras's fit."""
    x, y = data(128)
    w = np.linspace(0.0, 2.0, 128).astype("float32")
    reference = mlp(tf.distribute.get_strategy())
    reference.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.MeanSquaredError())
    reference.fit(x, y, sample_weight=w, batch_size=32, epochs=2,
                  shuffle=False, verbose=0)
    model, trainer = compiled_trainer(mirrored(TWO_CPUS),
                                      loss=keras.losses.MeanSquaredError())
    trainer.fit(x, y, sample_weight=w, batch_size=32, epochs=2, shuffle=False)
    assert_same(model, reference)


def test_inputs_that_do_not_fit_are_one_line_errors():
    x, y = data(64)
    strategy = mirrored(TWO_CPUS)
    _, trainer = compiled_trainer(strategy)
    with pytest.raises(ValueError, match="batch_size 16 differs from the "
                                         "Trainer's global batch size 32"):
        trainer.fit(x, y, batch_size=16)
    batched16 = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        16, drop_remainder=True)
    with pytest.raises(ValueError, match="batches hold 16 examples"):
        trainer.fit(batched16)
    forever = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    with pytest.raises(ValueError, match="repeats forever: pass "
                                         "steps_per_epoch"):
        trainer.fit(forever)
    with pytest.raises(ValueError, match="steps_per_epoch is required"):
        trainer.fit(lambda context: forever)
    with pytest.raises(ValueError, match="less than one global batch"):
        trainer.fit(x[:20], y[:20])
    with pytest.raises(ValueError, match="compile the model first"):
        Trainer.from_compiled(mlp(strategy), TrainConfig(global_batch_size=32))


def test_loss_scale_optimizer_applies_the_gradient_once():
    """A LossScaleOptimizer (what compile makes for mixed_float16) must not
    all-reduce again inside its inner optimizer: N replicas, N x the step."""
    x, y = data(128)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    results = []
    for devices, wrap in ((ONE_CPU, False), (TWO_CPUS, True)):
        strategy = mirrored(devices)
        model = mlp(strategy)
        with strategy.scope():
            optimizer = keras.optimizers.SGD(0.05)
            if wrap:
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        trainer = Trainer(model=model, optimizer=optimizer,
                          loss_fn=keras.losses.MeanSquaredError(),
                          strategy=strategy,
                          config=TrainConfig(global_batch_size=32, verbose=0))
        assert (trainer.loss_scale is not None) == wrap
        trainer.fit(dataset, epochs=2)
        results.append(model)
    assert_same(*results)
    # And the switch for `fit` turns the inner aggregation off too.
    with mirrored(TWO_CPUS).scope():
        lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    _compat.disable_gradient_aggregation(lso)
    pairs = [(tf.ones(2), tf.Variable(tf.zeros(2)))]
    assert lso.inner_optimizer._all_reduce_sum_gradients(pairs) == pairs


@pytest.mark.parametrize("optimizer_fn", [
    lambda: keras.optimizers.SGD(0.05, global_clipnorm=0.05),
    lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, clipnorm=0.02)),
], ids=["global_clipnorm", "loss_scale_clipnorm"])
def test_fit_with_the_switch_clips_after_the_all_reduce(optimizer_fn):
    """Keras clips each replica's partial gradient; with the switch, two
    replicas clip the reduced gradient, as one device does."""
    tfscale.enable_multi_worker_fit()
    x, y = data(128)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    models = []
    for devices in (ONE_CPU, TWO_CPUS):
        strategy = mirrored(devices)
        model = mlp(strategy)
        with strategy.scope():
            model.compile(optimizer=optimizer_fn(), loss="mse")
        model.fit(strategy.experimental_distribute_dataset(dataset)
                  if len(devices) > 1 else dataset, epochs=2, verbose=0)
        models.append(model)
    assert_same(*models)


def test_fit_with_keras_gradient_accumulation_points_to_the_trainer():
    tfscale.enable_multi_worker_fit()
    x, y = data(64)
    strategy = mirrored(TWO_CPUS)
    model = mlp(strategy)
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(
            0.05, gradient_accumulation_steps=2), loss="mse")
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2 is "
                       r"not supported by model.fit .* use tfscale.Trainer "
                       r"with TrainConfig\(num_accumulation_steps=2\)"):
        model.fit(x, y, batch_size=32, verbose=0)


def test_precision_that_disagrees_with_the_model_policy_is_an_error():
    strategy = mirrored(TWO_CPUS)
    model = mlp(strategy)  # built under the float32 policy
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.05)
    with pytest.raises(ValueError, match="TrainConfig.precision is "
                       "'mixed_float16' but the model was built with dtype "
                       "policy 'float32'"):
        Trainer(model=model, optimizer=optimizer,
                loss_fn=keras.losses.MeanSquaredError(), strategy=strategy,
                config=TrainConfig(global_batch_size=32,
                                   precision="mixed_float16"))
