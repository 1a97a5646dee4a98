"""Time to train at any GPU count from two measured results (MLPerf's
figure: minutes from start to the target), where per-GPU batches are small
enough that a step's fixed costs matter.

    minutes(N, B) = E(B) / B x (t0 + b x t1 + sync(N)) / 60

- b = B / N, the examples each GPU takes a step: a step's compute is
  t0 + b x t1, a fixed part (launches, the update, the evaluations spread
  over the steps) and a part per example;
- sync(N): the gradients' all-reduce on the system (`collectives.py`);
- E(B) = E_min (1 + B / B_noise): the examples the run needs to reach its
  target at global batch B (McCandlish et al. 2018: more examples at a
  batch past the noise scale).

Two results give the four unknowns: their examples give E_min and B_noise
(one B_noise, infinite, when both ran one batch), their step times
(minutes x 60 / steps, less the sync) give t0 and t1. The check against
MLPerf Training v3.0 is in tests/test_planning.py (published.json,
`mlperf_training_v3_0_h100`).
"""

import dataclasses
import math
from typing import Optional

from planning import collectives, projection
from planning.systems import System


@dataclasses.dataclass(frozen=True)
class Result:
    """One measured result: minutes to the target on `gpus` GPUs at
    `global_batch`, having seen `examples` (the runs' mean)."""
    gpus: int
    global_batch: int
    minutes: float
    examples: float

    @property
    def step_seconds(self) -> float:
        return self.minutes * 60 / (self.examples / self.global_batch)


@dataclasses.dataclass(frozen=True)
class Model:
    """What two results determine (see the module docstring)."""
    t0: float
    t1: float
    e_min: float
    b_noise: float
    parameters: float
    gradient_bytes: int

    def examples(self, global_batch: int) -> float:
        return self.e_min * (1 + global_batch / self.b_noise)

    def step_seconds(self, system: System, gpus: int,
                     global_batch: int, plan=projection.Plan()) -> float:
        return (self.t0 + global_batch / gpus * self.t1
                + sync(system, gpus, self.parameters, self.gradient_bytes,
                       plan))

    def minutes(self, system: System, gpus: int, global_batch: int,
                plan=projection.Plan()) -> float:
        return (self.examples(global_batch) / global_batch
                * self.step_seconds(system, gpus, global_batch, plan) / 60)


def sync(system: System, gpus: int, parameters: float, gradient_bytes: int,
         plan=projection.Plan()) -> float:
    """The gradient all-reduce of one step on `gpus` GPUs."""
    if gpus < 2:
        return 0.0
    nodes = projection.nodes_for(system, gpus)
    sized = dataclasses.replace(system, gpus_per_node=min(
        gpus, system.gpus_per_node))
    return collectives.gradient_sync(sized, nodes, parameters * gradient_bytes,
                                     plan.algorithm, plan.zero1,
                                     plan.bus_bandwidth, plan.fusion_bytes)


def fit(system: System, parameters: float, gradient_bytes: int,
        a: Result, b: Result, plan=projection.Plan()) -> Model:
    """The model two results determine.

    Raises:
        ValueError: The results cannot tell the unknowns apart (the same
            examples per GPU a step, or a batch that needs fewer examples).
    """
    if a.global_batch == b.global_batch or math.isclose(a.examples,
                                                        b.examples):
        b_noise, e_min = math.inf, (a.examples + b.examples) / 2
    else:
        ratio = b.examples / a.examples
        b_noise = (b.global_batch - ratio * a.global_batch) / (ratio - 1)
        if b_noise <= 0:
            raise ValueError(
                "the larger batch needed fewer examples: no noise scale fits "
                f"({a.global_batch}: {a.examples:.4g}, {b.global_batch}: "
                f"{b.examples:.4g})")
        e_min = a.examples / (1 + a.global_batch / b_noise)
    per_gpu = (a.global_batch / a.gpus, b.global_batch / b.gpus)
    if math.isclose(*per_gpu):
        raise ValueError("both results ran the same batch per GPU: the fixed "
                         "and the per-example parts of a step cannot be told "
                         "apart")
    rest = [r.step_seconds - sync(system, r.gpus, parameters,
                                  gradient_bytes, plan) for r in (a, b)]
    t1 = (rest[0] - rest[1]) / (per_gpu[0] - per_gpu[1])
    t0 = rest[0] - per_gpu[0] * t1
    return Model(t0, t1, e_min, b_noise, parameters, gradient_bytes)


def predict(model: Model, system: System, gpus: int, global_batch: int,
            plan=projection.Plan(), examples: Optional[float] = None
            ) -> float:
    """Minutes to the target on `gpus` GPUs at `global_batch` (with
    `examples`, the step count a run measured instead of the model's)."""
    if examples is None:
        return model.minutes(system, gpus, global_batch, plan)
    return (examples / global_batch
            * model.step_seconds(system, gpus, global_batch, plan) / 60)
