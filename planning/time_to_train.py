"""Time to train at any GPU count from two or more measured results (MLPerf's
figure: minutes from start to the target), with a band that widens with
the distance from what was measured.

    minutes(N, B) = E(B) / B x (t0 + b x t1 + sync(N)) / 60

- b = B / N, the examples each GPU takes a step: a step's compute is
  t0 + b x t1, a fixed part (launches, the update, the evaluations spread
  over the steps) and a part per example (least squares over the results'
  step times less their sync; two results: exact);
- sync(N): the gradients' all-reduce on the system (`collectives.py`);
- E(B) = E_min (1 + B / B_noise): the examples the run needs to reach its
  target at global batch B (McCandlish, Kaplan, OpenAI Dota Team, "An
  Empirical Model of Large-Batch Training", arXiv:1812.06162, eq. 2.11:
  past the gradient noise scale B_noise a batch needs more examples),
  least squares of examples on B over the results.

The band (`Band`). Inside the measured batches the model interpolates:
the larger of the results' run-to-run spread (`Result.runs`: the largest
distance of one run from its result's mean; without runs
`DEFAULT_SPREAD`) and the fit's largest relative residual, either way.
Outside them it extrapolates, and the literature bounds what can happen:
past the largest measured batch B_hi, the examples lie between the model
(the noise-scale model, which a well-tuned schedule reaches) and steps no
fewer than at B_hi, E(B_hi) x B / B_hi (Shallue et al., "Measuring the
Effects of Data Parallelism on Neural Network Training", arXiv:1811.03600:
past a point, "maximal data parallelism", more batch buys no fewer
steps); below the smallest, B_lo, between the model and E(B_lo) (perfect
scaling: no more examples than at B_lo). The step time likewise: inside
the measured batches per GPU, the same floor either way; past the largest, b_hi,
between t(b_hi) (a larger batch is never faster) and t(b_hi) x b / b_hi (no
slower per example); below the smallest, between t(b_lo) x b / b_lo and
t(b_lo). A row whose batch or batch per GPU is outside the measured ones
is marked extrapolated. The check against MLPerf Training results of
other rounds, held out of the fit, is in tests/test_planning.py.
"""

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple

from planning import collectives, projection
from planning.systems import System

# The band inside the measured range, either way, where no result gives its
# runs: the median run-to-run spread of MLPerf Training's BERT results
# (published.json's `mlperf_run_spreads`: 161 results, v2.0-v4.0, every
# submitter; a test recomputes it). BERT's runs stop at a step that varies
# with the seed; ResNet-50's at nearly fixed epochs (median 0.05%): the
# wider of the two, as a job of unknown kind may vary as much.
DEFAULT_SPREAD = 0.0768


@dataclasses.dataclass(frozen=True)
class Result:
    """One measured result: minutes to the target on `gpus` GPUs at
    `global_batch`, having seen `examples` (the runs' mean); `runs`: the
    minutes of the runs `minutes` averages, where known."""
    gpus: int
    global_batch: int
    minutes: float
    examples: float
    runs: Tuple[float, ...] = ()

    @property
    def spread(self) -> Optional[float]:
        """The largest relative distance of a run from `minutes` (None
        without two runs or more)."""
        if len(self.runs) < 2:
            return None
        return max(abs(m / self.minutes - 1) for m in self.runs)

    @property
    def step_seconds(self) -> float:
        return self.minutes * 60 / (self.examples / self.global_batch)

    @property
    def per_gpu(self) -> float:
        return self.global_batch / self.gpus


@dataclasses.dataclass(frozen=True)
class Model:
    """What the results determine (see the module docstring)."""
    t0: float
    t1: float
    e_min: float
    b_noise: float
    parameters: float
    gradient_bytes: int
    batches: Tuple[float, float] = (0.0, math.inf)  # measured B range
    per_gpu: Tuple[float, float] = (0.0, math.inf)  # measured b range
    residual: float = 0.0  # the fit's largest relative residual
    # The results' largest run-to-run spread (DEFAULT_SPREAD where one gave
    # no runs) and whether the runs gave it.
    spread: float = DEFAULT_SPREAD
    spread_measured: bool = False
    results: int = 2  # how many results the fit rests on
    # The results' one batch per GPU when they all ran it (a weak-scaling
    # pair): t0 is then the whole compute at it, t1 unknown (0).
    one_per_gpu: Optional[float] = None

    @property
    def floor(self) -> float:
        """The band either way inside the measured range."""
        return max(self.spread, self.residual)

    @property
    def exact(self) -> bool:
        """Two results fit the step's two parts and the examples' two
        terms exactly: no residual checks anything."""
        return self.results <= 2

    def examples(self, global_batch: float) -> float:
        return self.e_min * (1 + global_batch / self.b_noise)

    def compute_seconds(self, per_gpu: float) -> float:
        return self.t0 + per_gpu * self.t1

    def step_seconds(self, system: System, gpus: int,
                     global_batch: int, plan=projection.Plan()) -> float:
        return (self.compute_seconds(global_batch / gpus)
                + sync(system, gpus, self.parameters, self.gradient_bytes,
                       plan))

    def minutes(self, system: System, gpus: int, global_batch: int,
                plan=projection.Plan()) -> float:
        return (self.examples(global_batch) / global_batch
                * self.step_seconds(system, gpus, global_batch, plan) / 60)


@dataclasses.dataclass(frozen=True)
class Band:
    """A prediction and its band; `extrapolated`: what lies outside the
    measured range ("batch", "batch per GPU"), empty inside it."""
    value: float
    low: float
    high: float
    extrapolated: Tuple[str, ...] = ()

    def holds(self, x: float) -> bool:
        return self.low <= x <= self.high


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


def _line(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    return mean_y - slope * mean_x, slope


def fit_results(system: System, parameters: float, gradient_bytes: int,
                results: Sequence[Result], plan=projection.Plan()) -> Model:
    """The model two or more results determine (results at one batch per
    GPU: a step's compute at that batch only, `Model.one_per_gpu`).

    Raises:
        ValueError: Fewer than two results; examples that fall as the
            batch grows (no noise scale fits).
    """
    if len(results) < 2:
        raise ValueError("time to train needs two results or more (GPUS:"
                         "BATCH:MINUTES:EXAMPLES each)")
    per_gpu = [r.per_gpu for r in results]
    rest = [r.step_seconds - sync(system, r.gpus, parameters, gradient_bytes,
                                  plan) for r in results]
    one = max(per_gpu) - min(per_gpu) < 1e-9 * max(per_gpu)
    # One batch per GPU (the same script on 8 and on 32 GPUs): the step's
    # compute at it is known, not how it splits (`one_per_gpu`).
    t0, t1 = (sum(rest) / len(rest), 0.0) if one else _line(per_gpu, rest)
    batches = [r.global_batch for r in results]
    if max(batches) == min(batches):
        e_min, b_noise = sum(r.examples for r in results) / len(results), \
            math.inf
    else:
        e_min, slope = _line(batches, [r.examples for r in results])
        if slope < 0:
            raise ValueError(
                "the larger batches needed fewer examples: no noise scale "
                "fits (" + ", ".join(f"{r.global_batch}: {r.examples:.4g}"
                                     for r in results) + ")")
        b_noise = e_min / slope if slope > 0 else math.inf
    spreads = [r.spread for r in results]
    measured = all(s is not None for s in spreads)
    model = Model(t0, t1, e_min, b_noise, parameters, gradient_bytes,
                  (min(batches), max(batches)), (min(per_gpu), max(per_gpu)),
                  results=len(results), one_per_gpu=per_gpu[0] if one else None,
                  spread=max(DEFAULT_SPREAD if s is None else s
                             for s in spreads),
                  spread_measured=measured)
    worst = max(max(abs(model.examples(r.global_batch) / r.examples - 1),
                    abs(model.compute_seconds(r.per_gpu) / step - 1))
                for r, step in zip(results, rest))
    return dataclasses.replace(model, residual=worst)


def fit(system: System, parameters: float, gradient_bytes: int,
        a: Result, b: Result, plan=projection.Plan()) -> Model:
    """The model two results determine (`fit_results`)."""
    return fit_results(system, parameters, gradient_bytes, [a, b], plan)


def examples_band(model: Model, global_batch: float) -> Band:
    """E(B) and its band (the module docstring)."""
    value = model.examples(global_batch)
    low, high = model.batches
    base = model.floor
    if global_batch > high * (1 + 1e-9):
        steps_flat = model.examples(high) * global_batch / high
        return Band(value, value * (1 - base), steps_flat * (1 + base),
                    ("batch",))
    if global_batch < low * (1 - 1e-9):
        return Band(value, value * (1 - base),
                    model.examples(low) * (1 + base), ("batch",))
    return Band(value, value * (1 - base), value * (1 + base))


def compute_band(model: Model, per_gpu: float) -> Band:
    """A step's compute, t0 + b t1, and its band (the module docstring)."""
    value = model.compute_seconds(per_gpu)
    low, high = model.per_gpu
    base = model.floor
    if per_gpu > high * (1 + 1e-9):
        edge = model.compute_seconds(high)
        return Band(value, min(value, edge) * (1 - base),
                    max(value, edge * per_gpu / high) * (1 + base),
                    ("batch per GPU",))
    if per_gpu < low * (1 - 1e-9):
        edge = model.compute_seconds(low)
        return Band(value, min(value, edge * per_gpu / low) * (1 - base),
                    max(value, edge) * (1 + base), ("batch per GPU",))
    return Band(value, value * (1 - base), value * (1 + base))


@dataclasses.dataclass(frozen=True)
class Row:
    """Time to train on `gpus` GPUs at `global_batch`."""
    gpus: int
    global_batch: int
    step: Band        # seconds
    examples: Band
    minutes: Band
    steps: float

    @property
    def extrapolated(self) -> Tuple[str, ...]:
        return tuple(dict.fromkeys(self.step.extrapolated
                                   + self.examples.extrapolated))


def predict_row(model: Model, system: System, gpus: int, global_batch: int,
                plan=projection.Plan()) -> Row:
    """Minutes to the target, with their band, on `gpus` GPUs at
    `global_batch`."""
    wire = sync(system, gpus, model.parameters, model.gradient_bytes, plan)
    compute = compute_band(model, global_batch / gpus)
    step = Band(compute.value + wire, compute.low + wire, compute.high + wire,
                compute.extrapolated)
    examples = examples_band(model, global_batch)
    minutes = Band(*(e / global_batch * s / 60 for e, s in (
        (examples.value, step.value), (examples.low, step.low),
        (examples.high, step.high))))
    return Row(gpus, global_batch, step, examples, minutes,
               examples.value / global_batch)


def predict(model: Model, system: System, gpus: int, global_batch: int,
            plan=projection.Plan(), examples: Optional[float] = None
            ) -> float:
    """Minutes to the target on `gpus` GPUs at `global_batch` (with
    `examples`, the step count a run measured instead of the model's)."""
    if examples is None:
        return model.minutes(system, gpus, global_batch, plan)
    return (examples / global_batch
            * model.step_seconds(system, gpus, global_batch, plan) / 60)


def batches_for(gpus: Sequence[int], *, global_batch: Optional[int] = None,
                per_gpu: Optional[int] = None) -> List[int]:
    """The global batch of each GPU count: `global_batch` for all, or
    `per_gpu` x GPUs."""
    if (global_batch is None) == (per_gpu is None):
        raise ValueError("give the batch to train at: --train_batch B (the "
                         "same global batch on every count) or "
                         "--train_batch_per_gpu b (B = b x GPUs)")
    return [global_batch if global_batch is not None else per_gpu * n
            for n in gpus]
