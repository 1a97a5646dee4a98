"""What the engine computes for a study, as numbers: the noise-scale
estimator's and the optimizers' outputs on fixed inputs (golden vectors).

A study's definition (`time_to_accuracy.Study.definition`) holds their
digests, not the source text of the code that computes them: moving or
renaming that code keeps a study's results; changing a number it computes
gives the study a new digest. Numbers are rounded to 9 significant digits,
so a change of summation order alone (a last-bit difference) keeps them.
"""

import hashlib
import json

import keras
import numpy as np
import tensorflow as tf

from tfscale.noise import norms as noise_norms
from tfscale.noise import scale as noise_scale
from tfscale.step import row as step_row
from tfscale.optim import OptimConfig, make_optimizer

DIGITS = 9


def rounded(value):
    """`value` (nested lists, tuples, dicts, floats) with every float at
    DIGITS significant digits."""
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [rounded(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(f"{float(value):.{DIGITS - 1}e}")
    if isinstance(value, np.integer):
        return int(value)
    return value


def digest(value) -> str:
    return hashlib.sha256(json.dumps(rounded(value), sort_keys=True)
                          .encode()).hexdigest()


def _gradients(rng):
    return [tf.constant(rng.standard_normal(shape), tf.float32)
            for shape in ((3, 4), (5,), (2, 2))]


def estimator_outputs() -> dict:
    """The noise-scale estimator on fixed inputs: the squared norms of
    fixed gradients (plain and preconditioned by an Adam that has taken
    fixed steps), and the estimate, interval and summary of 300 fixed
    steps' numbers read from rows as the step writes them."""
    rng = np.random.RandomState(20261126)
    groups = noise_norms.Groups(("a", "b"), (0, 1, 0))
    grads = _gradients(rng)
    variables = [tf.Variable(tf.zeros_like(g)) for g in grads]
    adam = keras.optimizers.Adam(1e-3)
    adam.build(variables)
    for _ in range(noise_norms.SETTLE_UPDATES + 1):
        adam.apply_gradients(zip(_gradients(rng), variables))
    factors, ready = noise_norms.Preconditioner(adam, variables).factors()
    outputs = {
        "plain_norms": noise_norms.squared_norms(grads, groups).numpy(),
        "preconditioned_norms": noise_norms.squared_norms(
            grads, groups, factors).numpy(),
        "ready": float(ready.numpy())}
    layout = step_row.RowLayout(noise_groups=2)
    scale = noise_scale.NoiseScale(noise_scale.NoiseScaleConfig(decay=0.95),
                                   groups, global_batch_size=64,
                                   optimizer="sgd")
    trace = []
    # 8 micro-batches of 8: |G|^2 2 and 0.5, tr Sigma 100 and 40, each
    # measured norm off by a gamma-distributed factor.
    g2, tr = np.array([2.0, 0.5]), np.array([100.0, 40.0])
    for step in range(300):
        small = (g2 + tr / 8) / 8 * rng.gamma(20.0, 1 / 20, 2)
        big = (g2 + tr / 64) * rng.gamma(20.0, 1 / 20, 2)
        row = [0.0] * layout.size
        row[layout.LOSS] = 1.0
        noise = [*small, 8.0, *big, 1.0]
        row[layout.SIGNALS + 1:layout.SIGNALS + 1 + len(noise)] = noise
        scale.update(layout.noise(row))
        if step % 25 == 24:
            estimate = scale.estimate()
            trace.append([estimate.b_simple, estimate.interval,
                          estimate.relative_error,
                          scale.estimate("a").b_simple])
    outputs["trace"] = trace
    summary = scale.summary()
    outputs["summary"] = {k: v for k, v in summary.items()
                          if k not in ("optimizer",)}
    outputs["log_text"] = scale.log_text()
    return outputs


def optimizer_outputs() -> dict:
    """Each study optimizer (SGD with momentum, AdamW, LAMB), with its
    study settings and a warmup schedule, applied for 5 steps to fixed
    weights and gradients: the weights after each step and the rates."""
    outputs = {}
    for name, decay in (("sgd", 1e-4), ("adamw", 1e-4), ("lamb", 0.01)):
        rng = np.random.RandomState(7)
        variables = [keras.Variable(g, name=f"w{i}")
                     for i, g in enumerate(_gradients(rng))]
        config = OptimConfig(optimizer=name, learning_rate=0.05,
                             schedule="polynomial", warmup_steps=2,
                             total_steps=6, weight_decay=decay)
        optimizer = make_optimizer(config, 64, variables)
        steps = []
        for _ in range(5):
            optimizer.apply_gradients(zip(_gradients(rng), variables))
            steps.append([v.numpy() for v in variables])
        outputs[name] = {"weights": steps, "rates": [
            float(keras.ops.convert_to_numpy(optimizer.learning_rate))]}
    return outputs
