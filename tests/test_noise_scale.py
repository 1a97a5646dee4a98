"""The gradient noise scale against the truth, and AdaScale acting on it.

The truth: softmax regression on a fixed data set, where the per-example
gradients over the whole set at the current weights give tr(Sigma) and
|G|^2 exactly. The Trainer (at learning rate 0, so the weights stay there)
must land within 25% of the exact B_simple: on 2 real workers x 2
accumulation steps reading shuffled TFRecords through the toolkit's
pipeline, and in one process under fp16 loss scaling (the loss scale must
come out of the squared norms). That 1 worker x 6 accumulation steps and 2
and 3 workers report the same estimate is checked on run_pretraining.py in
test_global_order.py.
"""

import json
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from input_pipelines.record_order import index as record_index
from tests.conftest import run_command, run_workers
from tests.test_pretraining import corpus, pretrain_args  # noqa: F401
from tests.test_trainer import mirrored
from tfscale import noise_scale, precision
from tfscale.noise_scale import NoiseScaleConfig
from tfscale.optim.adascale import AdaScale
from tfscale.trainer import TrainConfig, Trainer

EXAMPLES, FEATURES, CLASSES = 4096, 20, 5


def softmax_data(seed=0):
    """x, labels drawn from a softmax model, and weights part of the way
    to it (where the gradient is neither large nor vanishing)."""
    rng = np.random.RandomState(seed)
    x = rng.randn(EXAMPLES, FEATURES).astype("float32")
    true_kernel = rng.randn(FEATURES, CLASSES)
    logits = x @ true_kernel
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = np.array([rng.choice(CLASSES, p=row) for row in p], np.int64)
    kernel = (0.3 * true_kernel).astype("float32")
    bias = np.zeros(CLASSES, "float32")
    return x, y, kernel, bias


def exact_b_simple(x, y, kernel, bias) -> float:
    """tr(Sigma) / |G|^2 from every example's gradient (float64)."""
    z = x.astype(np.float64) @ kernel + bias
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1  # d loss / d logits
    per_example = np.concatenate(
        [(x[:, :, None] * p[:, None, :]).reshape(len(y), -1), p], axis=1)
    mean = per_example.mean(0)
    trace = (per_example ** 2).sum(1).mean() - (mean ** 2).sum()
    return trace / (mean ** 2).sum()


def test_step_estimates_are_the_unbiased_two_batch_formulas():
    """Draws micro-batch gradients from a known distribution and checks the
    step estimates average to |G|^2 and tr(Sigma) (and their normalisation:
    each contribution is the micro-batch mean / n)."""
    rng = np.random.RandomState(0)
    dim, n, b = 50, 4, 8
    true_g = rng.randn(dim) * 0.1
    sigma = np.abs(rng.randn(dim))  # per-example std per coordinate
    estimates = []
    for _ in range(4000):
        examples = true_g + sigma * rng.randn(n, b, dim)
        means = examples.mean(1)
        contributions = means / n
        small_sum = (contributions ** 2).sum()
        big = (contributions.sum(0) ** 2).sum()
        estimates.append(noise_scale.step_estimates(small_sum, n, big, n * b))
    g2, trace = np.mean(estimates, axis=0)
    assert g2 == pytest.approx((true_g ** 2).sum(), rel=0.1)
    assert trace == pytest.approx((sigma ** 2).sum(), rel=0.05)


def test_exact_b_simple_is_what_the_formula_says():
    """The reference itself, on two examples by hand."""
    x = np.array([[1.0, 0.0], [0.0, 1.0]], "float32")
    y = np.array([0, 1])
    value = exact_b_simple(x, y, np.zeros((2, 2)), np.zeros(2))
    grads = []
    for xi, yi in zip(x, y):
        e = np.full(2, 0.5)
        e[yi] -= 1
        grads.append(np.concatenate([np.outer(xi, e).ravel(), e]))
    grads = np.array(grads)
    mean = grads.mean(0)
    expected = ((grads - mean) ** 2).sum(1).mean() / (mean ** 2).sum()
    assert value == pytest.approx(expected)


def softmax_trainer(x, y, kernel, bias, *, accumulation, batch=32,
                    config=NoiseScaleConfig(decay=0.995), optimizer_fn=None,
                    checkpoint_dir=None):
    strategy = mirrored(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(CLASSES)])
        model.layers[0].set_weights([kernel, bias])
        optimizer = (optimizer_fn or (lambda: keras.optimizers.SGD(0.0)))()
    trainer = Trainer(
        model=model, optimizer=optimizer,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        strategy=strategy,
        config=TrainConfig(global_batch_size=batch,
                           num_accumulation_steps=accumulation,
                           precision=model.dtype_policy.name,
                           log_steps=100, verbose=0, noise_scale=config,
                           checkpoint_dir=checkpoint_dir))

    def dataset_fn(context):
        return (tf.data.Dataset.from_tensor_slices((x, y)).repeat()
                .shuffle(EXAMPLES, seed=1)
                .batch(trainer.per_replica_batch_size))
    return trainer, dataset_fn


def test_fp16_estimate_has_the_loss_scale_taken_out():
    """mixed_float16 scales the loss by 2^15 before the backward pass: the
    micro-batch norms and the reduced one must both be unscaled."""
    x, y, kernel, bias = softmax_data()
    exact = exact_b_simple(x, y, kernel, bias)
    precision.set_precision("mixed_float16")
    try:
        trainer, dataset_fn = softmax_trainer(x, y, kernel, bias,
                                              accumulation=4)
        assert trainer.loss_scale is not None
        trainer.fit(dataset_fn, steps_per_epoch=400, epochs=1)
    finally:
        precision.set_precision("float32")
    estimate = trainer.noise_scale.estimate()
    assert estimate.steps == 400
    assert estimate.b_simple == pytest.approx(exact, rel=0.25)
    # Units: tr(Sigma) is one example's gradient variance (exact ~7.5 here),
    # not a loss-scaled one.
    assert 1 < estimate.trace < 30


def test_one_micro_batch_per_step_measures_nothing_and_says_so(caplog):
    x, y, kernel, bias = softmax_data()
    trainer, dataset_fn = softmax_trainer(x, y, kernel, bias, accumulation=1)
    assert trainer.noise_scale is None
    with caplog.at_level("INFO"):
        history = trainer.fit(dataset_fn, steps_per_epoch=3, epochs=1)
    assert "gradient noise scale not measured" in caplog.text
    assert "gradient_noise_scale" not in history.history


def test_preconditioned_needs_an_adam_family_optimizer():
    x, y, kernel, bias = softmax_data()
    with pytest.raises(ValueError, match="Adam-family optimizer"):
        softmax_trainer(x, y, kernel, bias, accumulation=2,
                        config=NoiseScaleConfig(mode="preconditioned"))
    trainer, dataset_fn = softmax_trainer(
        x, y, kernel, bias, accumulation=2,
        config=NoiseScaleConfig(mode="preconditioned", decay=0.9),
        optimizer_fn=lambda: keras.optimizers.Adam(1e-3))
    trainer.fit(dataset_fn, steps_per_epoch=20, epochs=1)
    # v_hat exists only after the first update: 19 steps counted.
    assert trainer.noise_scale.estimate().steps == 19
    assert trainer.noise_scale.summary()["mode"] == "preconditioned"


def test_config_and_groups_are_checked_and_named():
    with pytest.raises(ValueError, match="mode must be one of"):
        NoiseScaleConfig(mode="fast")
    with pytest.raises(ValueError, match="decay must be in"):
        NoiseScaleConfig(decay=1.0)
    with pytest.raises(ValueError, match="not name=regex"):
        noise_scale.parse_groups("embeddings")
    groups = noise_scale.parse_groups("emb=_embeddings/|norm, enc=layer_")
    assert groups == (("emb", ("_embeddings/", "norm")), ("enc", ("layer_",)))


def test_relative_cost_follows_the_empirical_model():
    # B = B_noise: half the batch costs 1.5x the steps, 0.75x the examples.
    steps, examples = noise_scale.relative_cost(100.0, 100.0, 50.0)
    assert steps == pytest.approx(1.5) and examples == pytest.approx(0.75)
    sentence = noise_scale.closing_sentence(
        {"b_simple": 100.0, "global_batch_size": 100, "mode": "plain",
         "decay": 0.99}, step=50)
    assert "B_simple ~ 100 examples at step 50" in sentence
    assert "1.50x the steps and 0.75x the examples" in sentence


def test_checkpoint_continues_the_moving_averages(tmp_path):
    """Two fits of 10 steps with a checkpoint between end where one fit of
    20 steps ends (the EMA state is in the checkpoint)."""
    x, y, kernel, bias = softmax_data()

    def run(directory, splits):
        for steps in splits:
            trainer, dataset_fn = softmax_trainer(
                x, y, kernel, bias, accumulation=2,
                optimizer_fn=lambda: keras.optimizers.SGD(0.05),
                checkpoint_dir=str(directory))
            trainer.fit(dataset_fn, steps_per_epoch=steps, epochs=1)
        summary = trainer.noise_scale.summary()
        return {k: v for k, v in summary.items() if k != "mode"}

    whole = run(tmp_path / "whole", [20])
    resumed = run(tmp_path / "cut", [10, 20])
    assert whole["steps_averaged"] == resumed["steps_averaged"] == 20
    assert resumed == pytest.approx(whole, rel=1e-6)


# ---- 2 real workers ------------------------------------------------------------


def write_records(folder, x, y, shards=4):
    folder.mkdir()
    for shard in range(shards):
        path = str(folder / f"data-{shard:05d}-of-{shards:05d}")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(shard, len(y), shards):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(
                        float_list=tf.train.FloatList(value=x[i])),
                    "y": tf.train.Feature(
                        int64_list=tf.train.Int64List(value=[y[i]]))}))
                writer.write(example.SerializeToString())
        record_index.write(path)
    return str(folder / "data-*")


@pytest.mark.slow
def test_two_workers_estimate_is_within_a_quarter_of_the_exact_value(tmp_path):
    x, y, kernel, bias = softmax_data()
    exact = exact_b_simple(x, y, kernel, bias)
    records = write_records(tmp_path / "records", x, y)
    np.savez(tmp_path / "init.npz", kernel=kernel, bias=bias)
    out = tmp_path / "job"
    run_workers(2, ["tests.workers.noise_truth", f"--records={records}",
                    f"--init={tmp_path / 'init.npz'}", f"--output_dir={out}",
                    "--global_batch=32", "--accumulation=2", "--steps=400"],
                timeout=300)
    result = json.loads((out / "summary.json").read_text())
    assert (result["num_workers"], result["steps"]) == (2, 400)  # x 2 acc.
    summary = result["noise_scale"]
    assert summary["steps_averaged"] == 400
    assert summary["b_simple"] == pytest.approx(exact, rel=0.25), (
        summary, exact)


# ---- AdaScale ------------------------------------------------------------------------


def noisy_regression(noise, seed):
    """y = x . w* + noise * e with |w*| = 1; the weights start at 0."""
    rng = np.random.RandomState(seed)
    target = rng.randn(10, 1)
    target /= np.linalg.norm(target)
    x = rng.randn(50_000, 10).astype("float32")
    y = (x @ target + noise * rng.randn(50_000, 1)).astype("float32")
    return x, y, target


def steps_to_target(noise, batch, reference, adascale, seed=0,
                    learning_rate=0.002):
    """Steps until |w - w*|^2 < 0.1 (from 1), and AdaScale's mean gain."""
    x, y, target = noisy_regression(noise, seed)
    strategy = mirrored(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(
            1, use_bias=False, kernel_initializer="zeros")])
        schedule = (AdaScale(learning_rate, reference, batch) if adascale
                    else learning_rate)
        optimizer = keras.optimizers.SGD(schedule)
    trainer = Trainer(model=model, optimizer=optimizer,
                      loss_fn=keras.losses.MeanSquaredError(),
                      strategy=strategy,
                      config=TrainConfig(global_batch_size=batch,
                                         num_accumulation_steps=4,
                                         log_steps=50, verbose=0))

    class Target(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step, self.gains = None, []

        def on_train_batch_end(self, batch, logs=None):
            distance = float(((model.layers[0].kernel.numpy() - target)
                              ** 2).sum())
            if adascale:
                self.gains.append(schedule.current_gain())
            if distance < 0.1 and self.step is None:
                self.step = batch + 1
                model.stop_training = True

    def dataset_fn(context):
        return (tf.data.Dataset.from_tensor_slices((x, y)).repeat()
                .shuffle(10_000, seed=seed)
                .batch(trainer.per_replica_batch_size))
    callback = Target()
    trainer.fit(dataset_fn, steps_per_epoch=3000, epochs=1,
                callbacks=[callback])
    assert callback.step is not None, "the target was not reached"
    gain = np.mean(callback.gains) if adascale else None
    if adascale:  # the schedule walked the gains
        assert schedule.progress() == pytest.approx(
            sum(callback.gains[:-1]) + 1.0, rel=1e-4)
    return callback.step, gain


def test_adascale_takes_a_quarter_of_the_steps_at_4x_a_small_batch():
    """Noisy labels: B_simple is in the hundreds, so B = 32 is far below
    it, the gain approaches S = 4 and the target comes in ~1/4 the steps of
    batch 8 (plain batch 32 at batch 8's rate barely helps)."""
    base, _ = steps_to_target(5.0, 8, 8, adascale=False)
    plain, _ = steps_to_target(5.0, 32, 8, adascale=False)
    scaled, gain = steps_to_target(5.0, 32, 8, adascale=True)
    assert 3.4 < gain <= 4.0
    assert 0.18 < scaled / base < 0.36, (base, scaled)
    assert plain / base > 0.7, (base, plain)


def test_adascale_gain_saturates_far_above_the_noise_scale():
    """Clean labels: B_simple is about 11, so at batch 256 (S = 4 over
    reference 64) a step is worth little more than one: the gain stays near
    1 and so does the step count."""
    base, _ = steps_to_target(0.0, 64, 64, adascale=False)
    scaled, gain = steps_to_target(0.0, 256, 64, adascale=True)
    assert 1.0 <= gain < 1.3
    assert scaled / base > 0.7, (base, scaled)


def test_adascale_gain_formula_and_refusals():
    schedule = AdaScale(0.1, reference_batch_size=8, global_batch_size=32)
    assert schedule.gain(gradient_squared=1.0, trace=0.0) == 1.0
    assert schedule.gain(gradient_squared=0.0, trace=1.0) == 4.0
    # var = 80/8 = 10, sqr = 1: (10 + 1) / (10/4 + 1) = 11 / 3.5
    assert schedule.gain(1.0, 80.0) == pytest.approx(11 / 3.5)
    with pytest.raises(ValueError, match="scales up"):
        AdaScale(0.1, reference_batch_size=64, global_batch_size=32)
    from tfscale.optim import OptimConfig
    with pytest.raises(ValueError, match="derived for SGD"):
        OptimConfig(optimizer="lamb", scaling_rule="adascale",
                    reference_batch_size=8)
    x, y, target = noisy_regression(1.0, 0)
    strategy = mirrored(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(AdaScale(0.1, 8, 8))
    with pytest.raises(ValueError, match="AdaScale needs the gradient noise"):
        Trainer(model=model, optimizer=optimizer,
                loss_fn=keras.losses.MeanSquaredError(), strategy=strategy,
                config=TrainConfig(global_batch_size=8))


@pytest.mark.slow
def test_adascale_and_noise_flags_on_run_pretraining(corpus, tmp_path):  # noqa: F811
    """The entry point: AdaScale runs (its gain in the log line and the
    intervals), and each misuse is one line naming the flag."""
    def run(out, *extra):
        return run_command([sys.executable, "run_pretraining.py",
                            *pretrain_args(corpus, out, 8, *extra)],
                           timeout=300)
    code, output = run(tmp_path / "ada", "--optimizer=sgd",
                       "--lr_scaling=adascale", "--reference_batch_size=8",
                       "--num_accumulation_steps=4", "--log_steps=4",
                       "--num_warmup_steps=2")
    assert code == 0, output[-3000:]
    assert "AdaScale gain" in output
    last = json.loads((tmp_path / "ada" / "summary.json").read_text())[
        "intervals"][-1]
    assert 1.0 <= last["adascale_gain"] <= 4.0  # S = 32 / 8
    for extra, message in (
            (["--optimizer=lamb", "--lr_scaling=adascale",
              "--reference_batch_size=8"],
             "--lr_scaling 'adascale' is derived for SGD"),
            (["--optimizer=sgd", "--lr_scaling=adascale",
              "--reference_batch_size=8"],  # 1 worker, 1 micro-batch
             "--lr_scaling: AdaScale needs the gradient noise scale"),
            (["--noise_scale_groups=encoder"],
             "--noise_scale_groups: noise scale group 'encoder' is not "
             "name=regex"),
            (["--noise_scale=preconditioned", "--optimizer=sgd",
              "--num_accumulation_steps=2"],
             "--noise_scale: the preconditioned noise scale needs an "
             "Adam-family optimizer")):
        code, output = run(tmp_path / "bad", *extra)
        assert code != 0, extra
        last_line = output.strip().splitlines()[-1]
        assert last_line.startswith("run_pretraining: error: "), output[-2000:]
        assert message in last_line, last_line


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
