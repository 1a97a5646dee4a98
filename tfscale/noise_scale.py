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
and the delta method on log(tr Sigma / |G|^2) gives an approximate 95%
interval. It treats the steps as independent draws around a fixed value;
training moves the value, so read the interval as the estimate's noise, not
as the drift. Nothing is reported until the window (1 / (1 - decay) steps)
has filled: before, the average leans on the first steps ("warming up").

What the step adds (`step.py`): each micro-batch's squared gradient norm per
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
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from tfscale import _compat
from tfscale.errors import ConfigError
from tfscale.optim.lamb import matches_any

MODES = ("off", "plain", "preconditioned")
TOTAL = "all"  # the whole model's group name in logs and summaries
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


# ---- in the step (graph side) ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Groups:
    """Which group each variable is in.

    Attributes:
        names: Group names, in order ("all" alone without groups).
        of_variable: The group index of each variable.
    """

    names: Tuple[str, ...]
    of_variable: Tuple[int, ...]


def assign_groups(variables, config: NoiseScaleConfig) -> Groups:
    if not config.groups:
        return Groups((TOTAL,), (0,) * len(variables))
    names = [name for name, _ in config.groups]
    of_variable = []
    for variable in variables:
        for i, (_, patterns) in enumerate(config.groups):
            if matches_any(variable.path, patterns):
                of_variable.append(i)
                break
        else:
            if "other" not in names:
                names.append("other")
            of_variable.append(names.index("other"))
    return Groups(tuple(names), tuple(of_variable))


def squared_norms(grads, groups: Groups, preconditioners=None) -> tf.Tensor:
    """float32 [G]: the squared norm of `grads` in each group (times the
    preconditioners, elementwise, when given)."""
    sums: List[list] = [[] for _ in groups.names]
    for i, (grad, group) in enumerate(zip(grads, groups.of_variable)):
        grad = tf.cast(grad, tf.float32)
        if preconditioners is not None:
            grad = grad * preconditioners[i]
        # l2_loss is sum(g^2) / 2 in one kernel (square + sum are two).
        sums[group].append(tf.nn.l2_loss(grad))
    return 2.0 * tf.stack([tf.add_n(s) if s else tf.constant(0.0)
                           for s in sums])


# Updates before the preconditioned noise scale counts a step: v_hat then
# averages about 100 squared gradients per coordinate (for normally
# distributed gradients its relative noise is sqrt(2 / 100) = 14%; with
# Adam's beta_2 = 0.999 its window is ~1,000). On the truth test's softmax
# regression this brought the estimate's relative error from 0.03-0.26
# (counting from the first update, 6 draws) to 0.022-0.024 (8 draws).
SETTLE_UPDATES = 100


class Preconditioner:
    """1 / (sqrt(v_hat) + epsilon) of an Adam-family optimizer, per variable.

    Raises:
        ConfigError: The optimizer keeps no second moments (not Adam, AdamW
            or LAMB): field "noise_scale".
    """

    def __init__(self, optimizer, variables):
        moments = _compat.second_moments(optimizer, variables)
        if moments is None:
            raise ConfigError(
                "noise_scale", f"the preconditioned noise scale needs an Adam-family "
                f"optimizer (Adam, AdamW, LAMB); {type(optimizer).__name__} "
                "keeps no second moments: use mode 'plain'")
        self._moments = moments
        self._optimizer = optimizer

    def factors(self) -> Tuple[list, tf.Tensor]:
        """(per-variable factors, ready): ready is 1.0 once the optimizer
        has taken `SETTLE_UPDATES` updates (v_hat has settled)."""
        optimizer = self._optimizer
        t = tf.cast(optimizer.iterations, tf.float32)
        ready = tf.cast(t >= SETTLE_UPDATES, tf.float32)
        correction = 1.0 - tf.pow(tf.cast(optimizer.beta_2, tf.float32),
                                  tf.maximum(t, 1.0))
        epsilon = tf.cast(optimizer.epsilon, tf.float32)
        factors = [1.0 / (tf.sqrt(tf.cast(v, tf.float32) / correction)
                          + epsilon) for v in self._moments]
        return factors, ready


# ---- on the host ---------------------------------------------------------------


Z_95 = 1.959964  # the normal quantile of a two-sided 95% interval


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The smoothed estimates of one group after some steps.

    Attributes:
        gradient_squared: EMA of |G|^2.
        trace: EMA of tr(Sigma) (one example's gradient covariance).
        steps: Steps averaged.
        effective_steps: n_eff of the EMA's weights.
        relative_error: The standard error of log(B_simple) (delta method);
            None until it is defined.
        warmed_up: The window (1 / (1 - decay) steps) has filled.
    """

    gradient_squared: float
    trace: float
    steps: int
    effective_steps: float = 0.0
    relative_error: Optional[float] = None
    warmed_up: bool = False

    @property
    def b_simple(self) -> Optional[float]:
        """tr(Sigma) / |G|^2 in examples; None until both are positive."""
        if self.steps == 0 or self.gradient_squared <= 0 or self.trace <= 0:
            return None
        return self.trace / self.gradient_squared

    @property
    def interval(self) -> Optional[Tuple[float, float]]:
        """An approximate 95% interval of B_simple; None until defined."""
        value = self.b_simple
        if value is None or self.relative_error is None:
            return None
        if Z_95 * self.relative_error > 30:  # no bound worth a number
            return 0.0, math.inf
        spread = math.exp(Z_95 * self.relative_error)
        return value / spread, value * spread


def effective_steps(decay: float, steps: int) -> float:
    """n_eff = (sum w)^2 / sum w^2 of the bias-corrected EMA's weights
    (1 - decay) decay^k, k < steps."""
    if steps <= 0:
        return 0.0
    if decay == 0:
        return 1.0
    return ((1 - decay ** steps) ** 2 * (1 + decay)
            / ((1 - decay) * (1 - decay ** (2 * steps))))


def _relative_error(means, effective: float) -> Optional[float]:
    """The standard error of log(trace / g2) from the EMA means of g2,
    trace, g2^2, trace^2 and g2 * trace (delta method)."""
    g2, trace, g2_sq, trace_sq, product = means
    if g2 <= 0 or trace <= 0 or effective < 2:
        return None
    var_g = max(g2_sq - g2 * g2, 0.0)
    var_t = max(trace_sq - trace * trace, 0.0)
    cov = product - g2 * trace
    relative = (var_t / trace ** 2 + var_g / g2 ** 2
                - 2 * cov / (trace * g2)) / effective
    return math.sqrt(max(relative, 0.0))


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

    State (checkpointed): per group (and for the whole model, "all", when
    there are groups) a float64 variable [steps, EMA |G|^2, EMA tr Sigma,
    EMA |G|^4, EMA (tr Sigma)^2, EMA |G|^2 tr Sigma] (raw EMAs of the
    per-step estimates; bias correction divides by 1 - decay^steps).
    """

    def __init__(self, config: NoiseScaleConfig, groups: Groups,
                 global_batch_size: int):
        self.config = config
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

    @property
    def width(self) -> int:
        """How many floats the step returns for it: G small sums, the
        count, G reduced norms, the preconditioner's ready flag."""
        return 2 * len(self.groups.names) + 2

    def update(self, values: Sequence[float]) -> None:
        """Adds one step's G small sums, count, G big norms and ready flag
        (the floats the step returns); a non-finite step is not counted."""
        g = len(self.groups.names)
        small, count = values[:g], float(values[g])
        big, ready = values[g + 1:2 * g + 1], float(values[2 * g + 1])
        if count < 2 or ready <= 0 or not all(
                math.isfinite(v) for v in values):
            return
        self.last_step_values = {}
        for name, s, b in zip(self.groups.names, small, big):
            self.last_step_values[name] = step_estimates(
                float(s), count, float(b), self.global_batch_size)
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
        means = [v / correction for v in state[1:]]
        effective = effective_steps(self.config.decay, steps)
        return Estimate(means[0], means[1], steps, effective,
                        _relative_error(means, effective),
                        steps >= self.window)

    def logs(self) -> dict:
        """{gradient_noise_scale, its 95% interval (_low, _high: inf when
        unbounded), critical_batch_ratio, gradient_noise_scale/<group>...}
        once the window has filled; {gradient_noise_scale_warmup: steps}
        before; empty until measurable."""
        estimate = self.estimate()
        if estimate.b_simple is None:
            return {}
        if not estimate.warmed_up:
            return {"gradient_noise_scale_warmup": float(estimate.steps)}
        low, high = estimate.interval or (0.0, math.inf)
        logs = {"gradient_noise_scale": estimate.b_simple,
                "gradient_noise_scale_low": low,
                "gradient_noise_scale_high": high,
                "critical_batch_ratio": (self.global_batch_size
                                         / estimate.b_simple)}
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
        if "gradient_noise_scale" not in logs:
            return ""
        return (f"; noise scale {logs['gradient_noise_scale']:.4g} (95% "
                f"{_range(logs['gradient_noise_scale_low'], logs['gradient_noise_scale_high'])}"
                f"; batch/noise {logs['critical_batch_ratio']:.3g})")

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


def relative_cost(b_noise: float, batch: float, other: float
                  ) -> Tuple[float, float]:
    """(steps, examples) to the same target at batch `other`, relative to
    `batch`, by S = S_min (1 + B_noise/B) and E = E_min (1 + B/B_noise)."""
    steps = (1 + b_noise / other) / (1 + b_noise / batch)
    examples = (1 + other / b_noise) / (1 + batch / b_noise)
    return steps, examples


# B_crit / B_simple measured in the time-to-accuracy study (B_simple at the
# step each tuned run reached its target, B_crit widened by its leave-one-
# batch-out range; docs/batch-size.md): in runs of at least 5 windows of the
# EMA, and in shorter ones, where the average still holds the first steps.
# Advice prices a batch change over B_simple's interval stretched by the
# range that applies, nothing narrower.
STUDY_RATIO = (0.54, 4.04)
STUDY_RATIO_EARLY = (0.54, 18.2)
SETTLED_WINDOWS = 5


def closing_sentence(summary: Optional[dict], step: int) -> str:
    """The plain sentence a run ends with (empty without a measurement):
    the value with its interval, and what halving or doubling the batch
    would cost as the range the study supports."""
    if not summary:
        return ""
    batch = summary["global_batch_size"]
    window = summary.get("window_steps") or round(1 / (1 - summary["decay"]))
    if not summary.get("warmed_up", True) or summary.get("b_simple") is None:
        if summary.get("steps_averaged"):
            return (f"  gradient noise scale: warming up "
                    f"({summary['steps_averaged']} of the {window} steps "
                    "its average needs): no value yet")
        return ("  gradient noise scale: not measured (it needs >= 2 "
                "micro-batches per step and a few steps)")
    b_simple = summary["b_simple"]
    interval = summary.get("b_simple_interval") or [b_simple, b_simple]
    low, high = interval[0], interval[1] or math.inf
    kind = (" (preconditioned)" if summary["mode"] == "preconditioned"
            else "")
    text = (f"  gradient noise scale{kind}: B_simple {b_simple:,.0f} "
            f"examples, 95% interval {_range(low, high)} (the last ~{window}"
            f" steps, at step {step}); this run's global batch {batch} is "
            f"{batch / b_simple:.2g}x it. It is the value at this point of "
            "training (it grows as the loss falls), and B_simple is not the "
            "critical batch: ")
    if not math.isfinite(high):
        return text + ("with no upper bound yet, it prices no change of "
                       "batch.")
    settled = summary.get("steps_averaged", 0) >= SETTLED_WINDOWS * window
    ratio = STUDY_RATIO if settled else STUDY_RATIO_EARLY
    lo, hi = low * ratio[0], high * ratio[1]
    half = [relative_cost(b, batch, batch / 2) for b in (lo, hi)]
    double = [relative_cost(b, batch, batch * 2) for b in (lo, hi)]

    def span(pair, i):
        a, b = sorted((pair[0][i], pair[1][i]))
        return f"{a:.2f}-{b:.2f}x"
    return text + (
        f"in the study (docs/batch-size.md) the measured critical batch was "
        f"{ratio[0]:g}-{ratio[1]:g}x B_simple"
        f"{'' if settled else ' measured this early'}, so for a critical "
        f"batch of {lo:,.0f}-{hi:,.0f}, S = S_min(1 + B_noise/B) and E = "
        f"E_min(1 + B/B_noise) put half the batch at {span(half, 0)} the "
        f"steps and {span(half, 1)} the examples, double the batch at "
        f"{span(double, 0)} the steps and {span(double, 1)} the examples.")
