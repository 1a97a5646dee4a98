"""OptimConfig -> optimizer with its learning-rate schedule.

Large-batch recipe (Goyal et al. 2017; You et al. 2019): the base learning
rate is given for a reference batch size and scaled to the actual global batch
by a rule (none, linear, sqrt), then warmed up linearly; or, with "adascale"
(SGD), scaled at every step by the gain the gradient noise scale gives
(`adascale.py`).
"""

import dataclasses
import math
from typing import Sequence

import keras

from tfscale.optim.adascale import AdaScale
from tfscale.optim.lamb import DEFAULT_EXCLUDE, Lamb, matches_any
from tfscale.optim.schedules import WarmupCosineDecay, WarmupPolynomialDecay

OPTIMIZERS = ("lamb", "adamw", "sgd")
SCHEDULES = ("polynomial", "cosine", "constant")
SCALING_RULES = ("none", "linear", "sqrt", "adascale")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer, schedule and scaling.

    Attributes:
        optimizer: "lamb", "adamw" or "sgd" (with momentum).
        learning_rate: Peak rate for `reference_batch_size`.
        schedule: "polynomial" (BERT), "cosine" or "constant" (after warmup).
        warmup_steps, total_steps: Schedule span in optimizer steps.
        end_learning_rate: Rate at `total_steps`.
        power: Exponent of the polynomial decay.
        weight_decay: Decay rate (LAMB: inside the trust ratio; AdamW and
            SGD: decoupled, scaled by the learning rate, Keras's
            `weight_decay`). 0 disables it.
        exclude_from_weight_decay: Variable path patterns with no decay (and,
            for LAMB, no layer adaptation).
        momentum: SGD momentum.
        beta_1, beta_2, epsilon: Adam/LAMB moments.
        scaling_rule: "none", "linear", "sqrt", or "adascale" (SGD only;
            needs `reference_batch_size`; warmup_steps and total_steps
            then count reference-batch steps).
        reference_batch_size: Global batch the `learning_rate` was tuned for;
            0 means the actual global batch (no scaling).
    """

    optimizer: str = "lamb"
    learning_rate: float = 1e-3
    schedule: str = "polynomial"
    warmup_steps: int = 0
    total_steps: int = 1000
    end_learning_rate: float = 0.0
    power: float = 1.0
    weight_decay: float = 0.01
    exclude_from_weight_decay: Sequence[str] = DEFAULT_EXCLUDE
    momentum: float = 0.9
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-6
    scaling_rule: str = "none"
    reference_batch_size: int = 0

    def __post_init__(self):
        for name, allowed in (("optimizer", OPTIMIZERS),
                              ("schedule", SCHEDULES),
                              ("scaling_rule", SCALING_RULES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be in "
                f"[0, total_steps ({self.total_steps})]")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.scaling_rule == "adascale":
            if self.optimizer != "sgd":
                raise ValueError(
                    "scaling_rule 'adascale' is derived for SGD (with "
                    f"momentum), not {self.optimizer!r}: its gain assumes an "
                    "update linear in the gradient")
            if self.reference_batch_size <= 0:
                raise ValueError("scaling_rule 'adascale' needs "
                                 "reference_batch_size > 0 (the batch the "
                                 "learning rate was tuned at)")


def scale_learning_rate(learning_rate: float, global_batch_size: int,
                        reference_batch_size: int, rule: str) -> float:
    """Scales a rate tuned at `reference_batch_size` to `global_batch_size`.

    linear: lr * B / B_ref (Goyal et al., SGD); sqrt: lr * sqrt(B / B_ref)
    (Hoffer et al.; the usual rule for Adam/LAMB); none: lr; adascale: lr
    (the gain is applied at every step by `AdaScale`).
    """
    if rule not in SCALING_RULES:
        raise ValueError(f"scaling rule must be one of {SCALING_RULES}, got {rule!r}")
    if rule in ("none", "adascale") or reference_batch_size <= 0:
        return learning_rate
    ratio = global_batch_size / reference_batch_size
    return learning_rate * (ratio if rule == "linear" else math.sqrt(ratio))


def make_learning_rate(config: OptimConfig, global_batch_size: int):
    """The (scaled) learning-rate schedule of `config`."""
    schedule = _base_schedule(config, global_batch_size)
    if config.scaling_rule == "adascale":
        # The reference run's length is the schedule's: the run ends when
        # AdaScale's progress reaches it (about total_steps / r steps).
        return AdaScale(schedule, config.reference_batch_size,
                        global_batch_size, reference_steps=config.total_steps)
    return schedule


def _base_schedule(config: OptimConfig, global_batch_size: int):
    peak = scale_learning_rate(config.learning_rate, global_batch_size,
                               config.reference_batch_size, config.scaling_rule)
    if config.schedule == "polynomial":
        return WarmupPolynomialDecay(peak, config.warmup_steps,
                                     config.total_steps,
                                     config.end_learning_rate, config.power)
    if config.schedule == "cosine":
        return WarmupCosineDecay(peak, config.warmup_steps, config.total_steps,
                                 config.end_learning_rate)
    # constant after warmup: a polynomial of power 0 stays at the peak.
    return WarmupPolynomialDecay(peak, config.warmup_steps, config.total_steps,
                                 peak, 0.0)


def make_optimizer(config: OptimConfig, global_batch_size: int,
                   trainable_variables=None):
    """Builds the optimizer of `config`.

    Call under `strategy.scope()`. For AdamW, pass the model's trainable
    variables so the path-based decay exclusions can be resolved (Keras's own
    `var_names` matches short names only; docs/facts.md, fact 10).

    Returns:
        A `keras.optimizers.Optimizer`.
    """
    learning_rate = make_learning_rate(config, global_batch_size)
    if config.optimizer == "lamb":
        return Lamb(learning_rate, beta_1=config.beta_1, beta_2=config.beta_2,
                    epsilon=config.epsilon,
                    weight_decay_rate=config.weight_decay,
                    exclude_from_weight_decay=config.exclude_from_weight_decay)
    if config.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(
            learning_rate, momentum=config.momentum,
            weight_decay=config.weight_decay or None)
    else:
        optimizer = keras.optimizers.AdamW(
            learning_rate, weight_decay=config.weight_decay,
            beta_1=config.beta_1, beta_2=config.beta_2, epsilon=config.epsilon)
    if config.weight_decay and trainable_variables is not None:
        optimizer.exclude_from_weight_decay(var_list=[
            v for v in trainable_variables
            if matches_any(v.path, config.exclude_from_weight_decay)])
    return optimizer
