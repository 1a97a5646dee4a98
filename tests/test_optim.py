import keras
import numpy as np
import pytest

from tfscale.optim import (Lamb, OptimConfig, WarmupCosineDecay,
                           WarmupPolynomialDecay, make_optimizer,
                           scale_learning_rate)


def numpy_lamb(w, grads, lr, b1=0.9, b2=0.999, eps=1e-6, wd=0.0, decay=True,
               adapt=True):
    """The paper's LAMB (Algorithm 2), with bias correction, decay inside."""
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        if decay:
            u = u + wd * w
        ratio = 1.0
        if adapt:
            wn, un = np.linalg.norm(w), np.linalg.norm(u)
            ratio = wn / un if wn > 0 and un > 0 else 1.0
        w = w - lr * ratio * u
    return w


class TwoLayers(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3, name="dense")
        self.layer_norm = keras.layers.LayerNormalization(name="layer_norm")

    def call(self, x):
        return self.layer_norm(self.dense(x))


def test_lamb_matches_numpy_reference_with_exclusions():
    model = TwoLayers()
    model(np.zeros((1, 4), "float32"))
    rng = np.random.RandomState(0)
    initial = [v.numpy().copy() + 0.1 for v in model.trainable_variables]
    for v, w in zip(model.trainable_variables, initial):
        v.assign(w)
    grads = [[rng.randn(*w.shape).astype("float32") for w in initial]
             for _ in range(5)]
    opt = Lamb(0.01, weight_decay_rate=0.1,
               exclude_from_weight_decay=("layer_norm", "bias"))
    for step in grads:
        opt.apply(step, model.trainable_variables)
    for i, v in enumerate(model.trainable_variables):
        excluded = "layer_norm" in v.path or "bias" in v.path
        expected = numpy_lamb(initial[i], [g[i] for g in grads], 0.01, wd=0.1,
                              decay=not excluded, adapt=not excluded)
        np.testing.assert_allclose(v.numpy(), expected, rtol=1e-5, atol=1e-6,
                                   err_msg=v.path)


def test_lamb_decay_is_inside_the_trust_ratio():
    # With zero gradients Adam's part is 0 and u = wd * w, so the trust ratio
    # is 1/wd and the step is exactly lr * w (independent of wd). Decay
    # applied outside the ratio (Keras's Lamb) would step by lr * wd * w.
    v = keras.Variable(np.full((4,), 2.0, "float32"), name="kernel")
    opt = Lamb(0.1, weight_decay_rate=0.01, exclude_from_weight_decay=())
    opt.apply([np.zeros(4, "float32")], [v])
    np.testing.assert_allclose(v.numpy(), 2.0 - 0.1 * 2.0, rtol=1e-6)


def test_lamb_config_round_trip():
    opt = Lamb(WarmupPolynomialDecay(1e-3, 10, 100), weight_decay_rate=0.01,
               exclude_from_weight_decay=("LayerNorm",))
    clone = Lamb.from_config(opt.get_config())
    assert clone.weight_decay_rate == 0.01
    assert clone.exclude_from_weight_decay_patterns == ("LayerNorm",)
    assert float(clone.learning_rate) == pytest.approx(float(opt.learning_rate))


def test_polynomial_schedule_boundaries():
    s = WarmupPolynomialDecay(1.0, warmup_steps=10, total_steps=100,
                              end_learning_rate=0.0, power=1.0)
    assert float(s(0)) == 0.0  # Google's: the first update has rate 0
    assert float(s(9)) == pytest.approx(0.9)
    # Google's BERT: decay measured from step 0, warmup overrides it.
    assert float(s(10)) == pytest.approx(0.9)
    assert float(s(55)) == pytest.approx(0.45)
    assert float(s(100)) == pytest.approx(0.0)
    assert float(s(1000)) == pytest.approx(0.0)
    clone = WarmupPolynomialDecay.from_config(s.get_config())
    assert float(clone(37)) == pytest.approx(float(s(37)))


def test_cosine_schedule_boundaries():
    s = WarmupCosineDecay(2.0, warmup_steps=4, total_steps=104,
                          end_learning_rate=0.2)
    assert float(s(1)) == pytest.approx(0.5)
    assert float(s(4)) == pytest.approx(2.0)
    assert float(s(54)) == pytest.approx(0.2 + 1.8 * 0.5)
    assert float(s(104)) == pytest.approx(0.2)
    clone = WarmupCosineDecay.from_config(s.get_config())
    assert float(clone(70)) == pytest.approx(float(s(70)))


@pytest.mark.parametrize("rule, expected", [
    ("none", 0.1), ("linear", 0.4), ("sqrt", 0.2)])
def test_batch_size_scaling_rules(rule, expected):
    assert scale_learning_rate(0.1, 1024, 256, rule) == pytest.approx(expected)


def test_make_optimizer_scales_and_warms_up():
    config = OptimConfig(optimizer="lamb", learning_rate=1e-3, warmup_steps=10,
                         total_steps=100, scaling_rule="sqrt",
                         reference_batch_size=256)
    opt = make_optimizer(config, global_batch_size=1024)
    schedule = opt._learning_rate
    assert schedule.peak_learning_rate == pytest.approx(2e-3)
    assert schedule.warmup_steps == 10


def test_adamw_excludes_by_variable_path():
    model = TwoLayers()
    model(np.zeros((1, 4), "float32"))
    config = OptimConfig(optimizer="adamw", learning_rate=0.1, weight_decay=0.5,
                         warmup_steps=0, total_steps=10, schedule="constant",
                         exclude_from_weight_decay=("layer_norm", "bias"))
    for v in model.trainable_variables:  # biases and beta start at zero
        v.assign(np.full(v.shape, 0.5, "float32"))
    opt = make_optimizer(config, 8, model.trainable_variables)
    before = {v.path: v.numpy().copy() for v in model.trainable_variables}
    # Zero gradients: only weight decay can move a variable.
    opt.apply([np.zeros_like(b) for b in before.values()],
              model.trainable_variables)
    for v in model.trainable_variables:
        changed = not np.allclose(v.numpy(), before[v.path])
        excluded = "layer_norm" in v.path or "bias" in v.path
        assert changed != excluded, v.path


def test_optim_config_rejects_bad_values():
    with pytest.raises(ValueError, match="optimizer"):
        OptimConfig(optimizer="adagrad")
    with pytest.raises(ValueError, match="warmup_steps"):
        OptimConfig(warmup_steps=20, total_steps=10)


def google_learning_rate(t, init_lr, num_train_steps, num_warmup_steps):
    """Google BERT's optimization.create_optimizer, written out in NumPy."""
    decayed = init_lr * (1.0 - min(t, num_train_steps) / num_train_steps)
    if t < num_warmup_steps:
        return init_lr * t / num_warmup_steps
    return decayed


def test_polynomial_schedule_matches_google_at_every_step():
    s = WarmupPolynomialDecay(2e-5, warmup_steps=10, total_steps=20)
    ours = [float(s(t)) for t in range(25)]
    google = [google_learning_rate(t, 2e-5, 20, 10) for t in range(25)]
    np.testing.assert_allclose(ours, google, rtol=1e-6, atol=1e-12)
    assert ours[0] == 0.0  # the first update has rate 0
    # Google's decay runs from step 0, so after warmup the rate is already
    # lr * (1 - W / T): 2e-5 * 9/10 at t = 9, then 2e-5 * 1/2 at t = 10.
    assert ours[9] == pytest.approx(1.8e-5) and ours[10] == pytest.approx(1e-5)


def test_optimizer_applies_the_rate_of_its_iteration_count():
    """The rate used by update t is the schedule at optimizer.iterations = t."""
    s = WarmupPolynomialDecay(1.0, warmup_steps=4, total_steps=8)
    var = keras.Variable(np.zeros(1, "float32"))
    opt = keras.optimizers.SGD(learning_rate=s)
    steps = []
    for t in range(6):
        before = float(var.numpy()[0])
        opt.apply([np.ones(1, "float32")], [var])
        steps.append(before - float(var.numpy()[0]))  # = rate (gradient 1)
    np.testing.assert_allclose(
        steps, [google_learning_rate(t, 1.0, 8, 4) for t in range(6)],
        rtol=1e-6, atol=1e-7)
