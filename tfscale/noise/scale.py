"""The gradient noise scale, measured in the training step at no extra cost.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training",
appendix A.1): a gradient over a batch of b examples has expected squared norm
E|G_b|^2 = |G|^2 + tr(Sigma)/b, where G is the true gradient and Sigma the
covariance of one example's gradient. Two batch sizes give both terms. A
data-parallel step already has two: every micro-batch of every replica
(b = global batch / n, n = replicas x accumulation steps) and the whole step
(B = the global batch). With |G_b|^2 the mean of the n micro-batches'
squared norms and |G_B|^2 the reduced gradient's:

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

both unbiased. Each is noisy at one step, so each is smoothed by its own
exponential moving average (bias-corrected as Adam's moments are; `decay`
0.99: a window of about 1 / (1 - decay) = 100 steps), and

    B_simple = EMA(tr Sigma) / EMA(|G|^2)           (in examples)

estimates B_noise, the batch of McCandlish et al.'s trade-off: steps to a
target S = S_min (1 + B_noise / B), examples E = E_min (1 + B / B_noise).
B_simple equals B_noise only when the Hessian is a multiple of the identity;
it grows as the loss falls.

Its uncertainty: the same EMAs also average the squares and the product of
the per-step estimates, which give their spread; the bias-corrected EMA of n
steps is a weighted mean with an effective count n_eff = (sum w)^2 /
sum w^2 (about 2 / (1 - decay) - 1 = 199 steps once full, n at the start),
so each average's variance is the weighted spread over n_eff - 1. The 95%
interval of the ratio is Fieller's (Student's t at n_eff - 1 degrees of
freedom): every rho with (trace - rho |G|^2)^2 <= t^2 Var(trace - rho |G|^2).
It has no upper bound whenever |G|^2's own interval reaches 0, which is
where the delta method on log(B_simple) under-covered (simulated at a
relative error of 1.0: 75% for a nominal 95%, every miss an upper bound too
low; Fieller's: 94-95% from 0.05 to 1.5, `tests/test_noise_scale.py`). It
treats the steps as independent draws around a fixed value; training moves
the value, so read the interval as the estimate's noise, not as the drift.
Nothing is reported until the window (1 / (1 - decay) steps) has filled:
before, the average leans on the first steps ("warming up").

What the step adds (`step/train_step.py`): each micro-batch's squared gradient norm per
variable group, loss scale removed, before it joins the accumulated sum
(`squared_norms`); their sum and a count ride as G + 1 floats in the step's
existing all-reduce; after it, the reduced gradient's squared norm per group
(loss scale removed, before clipping). The host (`NoiseScale`) turns the
G + 1 + G numbers into the estimates; its EMAs are variables in the
checkpoint, so a resumed run continues them on any worker count.

The preconditioned variant (AdaptDL's, for Adam and LAMB) divides every
gradient by sqrt(v_hat) + epsilon, v_hat being the optimizer's bias-corrected
second moment before this step's update: the noise scale of the direction
Adam actually moves in. Steps count from the optimizer's
`SETTLE_UPDATES`-th update on: v_hat is an average of the squared gradients
so far, and after few of them a coordinate's g^2 / v_hat is heavy-tailed
(after one, F(1, 1), which has no mean), so a single early step could
outweigh a thousand later ones in the average.
"""

import dataclasses
import math
from typing import Optional, Tuple

import tensorflow as tf

from tfscale.noise.norms import SETTLE_UPDATES, TOTAL, Groups
from tfscale.noise.numbers import NoiseNumbers

MODES = ("off", "plain", "preconditioned")
_STATE = 6  # steps and five EMAs per group (NoiseScale)


def _range(low: float, high: float) -> str:
    return (f"{low:,.0f}-{high:,.0f}" if math.isfinite(high)
            else f">= {low:,.0f}, no upper bound yet")


@dataclasses.dataclass(frozen=True)
class NoiseScaleConfig:
    """How the gradient noise scale is measured.

    Attributes:
        mode: "plain" (the default), "preconditioned" (Adam, AdamW, LAMB:
            gradients divided by sqrt(v_hat) + epsilon) or "off".
        decay: EMA decay of the two estimates (window about 1 / (1 - decay)
            steps).
        groups: ((name, (path regex, ...)), ...): also measure per variable
            group; a variable joins the first group with a pattern found in
            its path, "other" when none matches. Empty: the whole model only.
    """

    mode: str = "plain"
    decay: float = 0.99
    groups: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"noise scale mode must be one of {MODES}, got "
                             f"{self.mode!r}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"noise scale decay must be in [0, 1), got "
                             f"{self.decay}")
        names = [name for name, _ in self.groups]
        if len(set(names)) != len(names) or TOTAL in names:
            raise ValueError(f"noise scale group names must be unique and not "
                             f"{TOTAL!r}, got {names}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def parse_groups(spec: str) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """"embeddings=embed,encoder=layer_\\d+|transformer" -> groups.

    Raises:
        ValueError: An entry is not name=regex[|regex...].
    """
    groups = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, sep, patterns = entry.partition("=")
        if not sep or not name or not patterns:
            raise ValueError(f"noise scale group {entry!r} is not "
                             "name=regex[|regex...]")
        groups.append((name.strip(), tuple(patterns.split("|"))))
    return tuple(groups)


Z_95 = 1.959964  # the normal quantile of a two-sided 95% interval


def t_quantile(dof: float) -> float:
    """Student's t 97.5% quantile for `dof` >= 2 degrees of freedom
    (Cornish-Fisher expansion around Z_95): within 0.1% of the table from 5
    on, a little under it at 2-4 (4.17, 3.16, 2.77 for 4.30, 3.18, 2.78)."""
    z = Z_95
    return (z + (z ** 3 + z) / (4 * dof)
            + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z)
            / (384 * dof ** 3))


def fieller(numerator: float, denominator: float, var_numerator: float,
            var_denominator: float, covariance: float, quantile: float
            ) -> Tuple[float, float]:
    """Fieller's interval for numerator / denominator (two means with this
    covariance), cut to [0, inf): every rho with (N - rho D)^2 <= q^2
    Var(N - rho D). Bounded only when D's own interval excludes 0; else
    (low, inf): "no upper bound"."""
    q2 = quantile * quantile
    a = denominator * denominator - q2 * var_denominator
    b = numerator * denominator - q2 * covariance
    c = numerator * numerator - q2 * var_numerator
    discriminant = b * b - a * c
    if a > 0:
        root = math.sqrt(max(discriminant, 0.0))
        return max((b - root) / a, 0.0), (b + root) / a
    if a == 0 or discriminant <= 0:  # every rho
        return 0.0, math.inf
    root = math.sqrt(discriminant)
    lower, upper = sorted(((b - root) / a, (b + root) / a))
    # The set is outside (lower, upper); on [0, inf) it starts at upper
    # unless lower >= 0 too (then [0, lower] joins it: report from 0).
    return (max(upper, 0.0) if lower < 0 else 0.0), math.inf


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The smoothed estimates of one group after some steps.

    Attributes:
        gradient_squared: EMA of |G|^2.
        trace: EMA of tr(Sigma) (one example's gradient covariance).
        steps: Steps averaged.
        effective_steps: n_eff of the EMA's weights.
        warmed_up: The window (1 / (1 - decay) steps) has filled.
        covariance: (Var |G|^2, Var tr Sigma, Cov) of the two averages, from
            the spread of the per-step values over n_eff - 1; None until
            n_eff >= 3.
    """

    gradient_squared: float
    trace: float
    steps: int
    effective_steps: float = 0.0
    warmed_up: bool = False
    covariance: Optional[Tuple[float, float, float]] = None

    @property
    def b_simple(self) -> Optional[float]:
        """tr(Sigma) / |G|^2 in examples; None until both are positive."""
        if self.steps == 0 or self.gradient_squared <= 0 or self.trace <= 0:
            return None
        return self.trace / self.gradient_squared

    @property
    def interval(self) -> Optional[Tuple[float, float]]:
        """A 95% interval of tr(Sigma) / |G|^2 (Fieller's, with Student's t
        at n_eff - 1 degrees of freedom; high is inf whenever the interval
        of |G|^2 reaches 0); None until n_eff >= 3. It exists when
        B_simple does not (|G|^2 <= 0 so far): then it is unbounded."""
        if self.covariance is None:
            return None
        var_g, var_t, cov = self.covariance
        return fieller(self.trace, self.gradient_squared, var_t, var_g, cov,
                       t_quantile(self.effective_steps - 1))

    @property
    def relative_error(self) -> Optional[float]:
        """The standard error of log(B_simple) by the delta method (a
        summary of the noise; the interval is Fieller's, not exp of it)."""
        if self.b_simple is None or self.covariance is None:
            return None
        var_g, var_t, cov = self.covariance
        g2, trace = self.gradient_squared, self.trace
        return math.sqrt(max(var_t / trace ** 2 + var_g / g2 ** 2
                             - 2 * cov / (trace * g2), 0.0))


def effective_steps(decay: float, steps: int) -> float:
    """n_eff = (sum w)^2 / sum w^2 of the bias-corrected EMA's weights
    (1 - decay) decay^k, k < steps."""
    if steps <= 0:
        return 0.0
    if decay == 0:
        return 1.0
    return ((1 - decay ** steps) ** 2 * (1 + decay)
            / ((1 - decay) * (1 - decay ** (2 * steps))))


def estimate_from_means(means, steps: int, decay: float,
                        window: int) -> Estimate:
    """An `Estimate` from the bias-corrected EMA means of |G|^2, tr Sigma,
    their squares and product over `steps` steps: the weighted variance
    over (n_eff - 1) is each average's variance (exact for independent
    steps)."""
    g2, trace, g2_sq, trace_sq, product = means
    effective = effective_steps(decay, steps)
    covariance = None
    if effective >= 3:
        scale = 1.0 / (effective - 1)
        covariance = (max(g2_sq - g2 * g2, 0.0) * scale,
                      max(trace_sq - trace * trace, 0.0) * scale,
                      (product - g2 * trace) * scale)
    return Estimate(g2, trace, steps, effective, steps >= window, covariance)


def step_estimates(small_sum: float, count: float, big: float,
                   global_batch_size: int) -> Tuple[float, float]:
    """One step's unbiased (|G|^2, tr Sigma).

    Args:
        small_sum: The sum over the step's `count` micro-batches of the
            squared norm of each one's contribution to the step's gradient.
            The step's loss is divided by the global batch B, so a
            contribution is the micro-batch's mean gradient / count.
        count: n, micro-batches in the step (replicas x accumulation).
        big: The squared norm of the step's (reduced) gradient.
        global_batch_size: B.
    """
    n = count
    batch_big = float(global_batch_size)
    batch_small = batch_big / n
    # The mean over micro-batches of |their mean gradient|^2.
    small = n * small_sum
    gradient_squared = (batch_big * big - batch_small * small) / (
        batch_big - batch_small)
    trace = (small - big) / (1.0 / batch_small - 1.0 / batch_big)
    return gradient_squared, trace


class NoiseScale:
    """The EMAs of the estimates, per group, on the host.

    Args:
        config: A `NoiseScaleConfig` (enabled).
        groups: The step's `Groups`.
        global_batch_size: B.
        optimizer: The optimizer's name ("sgd", "adamw", "lamb", ...): the
            closing advice depends on it (`closing_sentence`).

    State (checkpointed): per group (and for the whole model, "all", when
    there are groups) a float64 variable [steps, EMA |G|^2, EMA tr Sigma,
    EMA |G|^4, EMA (tr Sigma)^2, EMA |G|^2 tr Sigma] (raw EMAs of the
    per-step estimates; bias correction divides by 1 - decay^steps).
    """

    def __init__(self, config: NoiseScaleConfig, groups: Groups,
                 global_batch_size: int, optimizer: Optional[str] = None):
        self.config = config
        self.optimizer = optimizer
        self.groups = groups
        self.global_batch_size = global_batch_size
        self._names = tuple(groups.names) + (
            (TOTAL,) if TOTAL not in groups.names else ())
        with tf.device("/cpu:0"):
            self.variables = {
                name: tf.Variable(tf.zeros([_STATE], tf.float64),
                                  trainable=False, name=f"noise_scale_{name}")
                for name in self._names}
        self._state = {name: [0.0] * _STATE for name in self._names}
        self.last_step_values = None

    @property
    def window(self) -> int:
        """Steps the EMA averages: 1 / (1 - decay)."""
        return max(1, round(1 / (1 - self.config.decay)))

    def update(self, numbers: NoiseNumbers) -> None:
        """Adds one step's numbers (`NoiseNumbers`); a non-finite
        step, or one the preconditioner does not count, is not counted."""
        values = (*numbers.small_sums, numbers.count, *numbers.big,
                  numbers.ready)
        if numbers.count < 2 or numbers.ready <= 0 or not all(
                math.isfinite(v) for v in values):
            return
        self.last_step_values = {}
        for name, s, b in zip(self.groups.names, numbers.small_sums,
                              numbers.big):
            self.last_step_values[name] = step_estimates(
                s, numbers.count, b, self.global_batch_size)
        if TOTAL not in self.groups.names:
            # The whole model's per-step values are the groups' sums.
            self.last_step_values[TOTAL] = tuple(
                sum(v[i] for v in self.last_step_values.values())
                for i in range(2))
        for name, (g2, trace) in self.last_step_values.items():
            self._add(self._state[name], g2, trace)

    def _add(self, state: list, g2: float, trace: float) -> None:
        decay = self.config.decay
        state[0] += 1
        for i, value in enumerate((g2, trace, g2 * g2, trace * trace,
                                   g2 * trace), start=1):
            state[i] = decay * state[i] + (1 - decay) * value

    def estimate(self, group: Optional[str] = None) -> Estimate:
        """The smoothed estimate of `group` (None: the whole model)."""
        state = self._state[TOTAL if group is None else group]
        steps = int(state[0])
        if steps == 0:
            return Estimate(0.0, 0.0, 0)
        correction = 1.0 - self.config.decay ** steps
        return estimate_from_means([v / correction for v in state[1:]],
                                   steps, self.config.decay, self.window)

    def logs(self) -> dict:
        """{gradient_noise_scale, its 95% interval (_low, _high: inf when
        unbounded), critical_batch_ratio, gradient_noise_scale/<group>...}
        once the window has filled (only _low and _high while |G|^2 is not
        yet above 0); {gradient_noise_scale_warmup: steps} before; empty
        until measured."""
        estimate = self.estimate()
        if not estimate.steps:
            return {}
        if not estimate.warmed_up:
            return {"gradient_noise_scale_warmup": float(estimate.steps)}
        low, high = estimate.interval or (0.0, math.inf)
        logs = {"gradient_noise_scale_low": low,
                "gradient_noise_scale_high": high}
        if estimate.b_simple is None:
            return logs
        logs.update(gradient_noise_scale=estimate.b_simple,
                    critical_batch_ratio=(self.global_batch_size
                                          / estimate.b_simple))
        if len(self.groups.names) > 1:
            for name in self.groups.names:
                value = self.estimate(name).b_simple
                if value is not None:
                    logs[f"gradient_noise_scale/{name}"] = value
        return logs

    def log_text(self) -> str:
        """The noise scale's part of a log line."""
        logs = self.logs()
        if self.config.mode == "preconditioned" and not self.estimate().steps:
            return (f"; noise scale waiting for the optimizer's second "
                    f"moments (counts from update {SETTLE_UPDATES})")
        if "gradient_noise_scale_warmup" in logs:
            return (f"; noise scale warming up "
                    f"({logs['gradient_noise_scale_warmup']:.0f}/"
                    f"{self.window} steps)")
        if "gradient_noise_scale_low" not in logs:
            return ""
        interval = _range(logs["gradient_noise_scale_low"],
                          logs["gradient_noise_scale_high"])
        if "gradient_noise_scale" not in logs:
            return f"; noise scale: |G|^2 not above 0 yet (95% {interval})"
        return (f"; noise scale {logs['gradient_noise_scale']:.4g} (95% "
                f"{interval}; batch/noise "
                f"{logs['critical_batch_ratio']:.3g})")

    # The checkpoint holds the variables; the host state is copied in
    # before a save and out after a restore.

    def store(self) -> None:
        for name, variable in self.variables.items():
            variable.assign(self._state[name])

    def load(self) -> None:
        for name, variable in self.variables.items():
            self._state[name] = [float(v) for v in variable.numpy()]

    def summary(self) -> dict:
        """What summary.json holds (b_simple and its interval only once the
        window has filled; `b_simple_interval` [low, high], high None when
        unbounded)."""
        estimate = self.estimate()
        interval = estimate.interval if estimate.warmed_up else None
        result = {"mode": self.config.mode, "decay": self.config.decay,
                  "optimizer": self.optimizer,
                  "window_steps": self.window,
                  "steps_averaged": estimate.steps,
                  "effective_steps": estimate.effective_steps,
                  "warmed_up": estimate.warmed_up,
                  "gradient_squared": estimate.gradient_squared,
                  "trace_sigma": estimate.trace,
                  "b_simple": (estimate.b_simple if estimate.warmed_up
                               else None),
                  "b_simple_interval": (
                      [interval[0], interval[1] if math.isfinite(interval[1])
                       else None] if interval else None),
                  "global_batch_size": self.global_batch_size}
        if len(self.groups.names) > 1:
            result["groups"] = {name: self.estimate(name).b_simple
                                for name in self.groups.names}
        return result
