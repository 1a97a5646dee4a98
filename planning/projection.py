"""A step at N GPUs, term by term, and what follows from it.

    step(N) = k x micro + update + fixed + tensors + exposed sync + straggler

- k x micro: the step's compute, unchanged by N (weak scaling: each GPU
  keeps its micro-batch and accumulation);
- update: the optimizer on every weight (ZeRO-1: 1/N of it), measured or
  the framework's passes over the weights at the GPU's memory bandwidth
  (`frameworks.py`);
- fixed: per-step time the GPU count does not change (`Workload`);
- tensors: the framework's cost per gradient tensor per step (Horovod's
  negotiation), with more than one GPU;
- exposed sync: the gradient all-reduces (`collectives.py`: NCCL's latency
  per collective and per hop, and the bytes over the bus bandwidth) less
  what the last backward pass hides (the overlap);
- straggler: a synchronous step waits for the slowest of N workers; with a
  per-micro-batch jitter c, a step's time varies c x micro x sqrt(k), and
  the expected maximum of N normal draws is `expected_max(N)` deviations
  above the mean.

Weak-scaling efficiency is step(1 GPU) / step(N). Strong scaling holds the
global batch of the first GPU count of the sweep and lowers the
accumulation (then the micro-batch) as N grows.
"""

import dataclasses
import functools
import itertools
import math
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from planning import collectives, frameworks
from planning.systems import System
from planning.workload import Workload, update_estimate

TERMS = ("compute", "update", "fixed", "tensors", "sync", "straggler")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the job runs: the framework (`frameworks.py`), the collective's
    algorithm, ZeRO-1, the fusion buffer's bytes, and a bus bandwidth that
    overrides the system's (a measured backend)."""
    algorithm: str = "auto"
    zero1: bool = False
    bus_bandwidth: Optional[float] = None
    fusion_bytes: float = 64e6
    framework: frameworks.Framework = frameworks.PRESETS["tfscale"]


def update_seconds(workload: Workload, system: System,
                   plan: "Plan") -> float:
    """The whole update on one GPU: measured, or the framework's passes
    over the weights (0 when it folds the update into the compute)."""
    if workload.update_seconds is not None:
        return workload.update_seconds
    passes = plan.framework.update_passes
    if not passes:
        return 0.0
    return update_estimate(workload.parameters, system.memory_bandwidth,
                           passes=passes)


def overlap(workload: Workload, plan: "Plan") -> float:
    return (plan.framework.overlap if workload.overlap is None
            else workload.overlap)


@functools.lru_cache(maxsize=None)
def expected_max(n: int) -> float:
    """E[max of n standard normal draws]: the integral of x n phi(x)
    Phi(x)^(n-1) over x, by the midpoint rule on [-8, 8]."""
    if n <= 1:
        return 0.0
    normal = statistics.NormalDist()
    width = 16 / 4000
    xs = (-8 + (i + 0.5) * width for i in range(4000))
    return sum(x * n * normal.pdf(x) * normal.cdf(x) ** (n - 1) * width
               for x in xs)


def nodes_for(system: System, gpus: int) -> int:
    return max(1, math.ceil(gpus / system.gpus_per_node))


def step_split(workload: Workload, system: System, gpus: int,
               plan: Plan = Plan()) -> Dict[str, float]:
    """Seconds of each term of one step on `gpus` GPUs (a node's worth or
    whole nodes; fewer GPUs than a node use that node's links)."""
    nodes = nodes_for(system, gpus)
    sized = dataclasses.replace(system, gpus_per_node=min(
        gpus, system.gpus_per_node))
    k, micro = workload.accumulation, workload.micro_seconds
    sync = collectives.gradient_sync(sized, nodes, workload.gradient_size,
                                     plan.algorithm, plan.zero1,
                                     plan.bus_bandwidth, plan.fusion_bytes
                                     ) if gpus > 1 else 0.0
    hidden = overlap(workload, plan) * workload.backward_share * micro
    update = update_seconds(workload, system, plan) / (
        gpus if plan.zero1 else 1)
    tensors = (workload.tensors * plan.framework.tensor_seconds
               if gpus > 1 else 0.0)
    return {"compute": k * micro, "update": update,
            "fixed": workload.fixed_seconds, "tensors": tensors,
            "sync": max(0.0, sync - hidden),
            "straggler": (workload.jitter * micro * math.sqrt(k)
                          * expected_max(gpus))}


def step_seconds(workload, system, gpus, plan=Plan()) -> float:
    return sum(step_split(workload, system, gpus, plan).values())


def throughput(workload, system, gpus, plan=Plan()) -> float:
    """Examples per second of all `gpus` GPUs."""
    return (gpus * workload.examples_per_gpu
            / step_seconds(workload, system, gpus, plan))


def strong_workload(workload: Workload, global_batch: int,
                    gpus: int) -> Optional[Workload]:
    """The workload that keeps `global_batch` on `gpus` GPUs: fewer
    micro-batches, then smaller ones (compute taken as linear in the
    micro-batch below it); None when the batch does not split into whole
    examples on every GPU (strong scaling ends there: the batch is never
    changed to keep a row)."""
    per_gpu = global_batch / gpus
    if per_gpu >= workload.micro_batch:
        accumulation = per_gpu / workload.micro_batch
        if accumulation != int(accumulation):
            return None
        return workload.with_accumulation(int(accumulation))
    if per_gpu != int(per_gpu) or per_gpu < 1:
        return None
    size = int(per_gpu)
    return dataclasses.replace(
        workload, accumulation=1, micro_batch=size,
        micro_seconds=workload.micro_seconds * size / workload.micro_batch)


def solve(f, low: float, high: float, steps: int = 200) -> float:
    """The x in [low, high] where the increasing `f` crosses 0
    (geometric bisection: the bounds span orders of magnitude)."""
    for _ in range(steps):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if f(middle) < 0 else (low, middle)
    return high


def needed_network(workload: Workload, system: System, gpus: int,
                   target: float, plan: Plan = Plan()) -> Optional[float]:
    """The NIC line rate per node (bytes/s, all its NICs) at which weak
    scaling reaches `target` efficiency on `gpus` GPUs; 0 inside one node;
    None when no network would (latency, jitter or the node's own links
    use the budget)."""
    if nodes_for(system, gpus) == 1:
        return 0.0
    single = step_seconds(workload, system, 1, plan)

    def short(line_rate):  # < 0 while the efficiency falls short
        faster = dataclasses.replace(
            system, nic_bandwidth=line_rate / system.nics_per_node)
        return single / step_seconds(workload, faster, gpus, plan) - target

    ceiling = system.intra_bandwidth / system.network_efficiency
    if short(ceiling) < 0:
        return None
    return solve(short, 1e3, ceiling)


@dataclasses.dataclass(frozen=True)
class Uncertainty:
    """Relative spreads of the inputs a band spans: compute, network
    bandwidth, and jitter (as a factor)."""
    compute: float = 0.03
    network: float = 0.2
    jitter_factor: float = 2.0
    # The compute's own band as factors of its value (a compute moved from
    # another system: `systems.ComputeMove`), beyond `compute` either way.
    compute_range: Tuple[float, float] = (1.0, 1.0)


def corners(workload: Workload, system: System, spread: Uncertainty):
    """(pessimistic, optimistic) workload and system."""
    def shifted(sign):
        factor = spread.compute_range[1 if sign > 0 else 0]
        w = dataclasses.replace(
            workload, micro_seconds=workload.micro_seconds * factor
            * (1 + sign * spread.compute),
            jitter=workload.jitter * spread.jitter_factor ** sign)
        s = dataclasses.replace(
            system, network_efficiency=min(1.0, system.network_efficiency
                                           * (1 - sign * spread.network)))
        return w, s
    return shifted(+1), shifted(-1)


def time_to_target(step: float, global_batch: int, reference_steps: float,
                   reference_batch: int, noise: float) -> float:
    """Seconds to the target a run reached in `reference_steps` steps at
    `reference_batch`: S(B) = S_min (1 + B_noise / B) steps (McCandlish et
    al. 2018), S_min from the reference run."""
    if math.isinf(noise):  # every batch is small: steps fall as 1 / B
        return reference_steps * reference_batch / global_batch * step
    s_min = reference_steps / (1 + noise / reference_batch)
    return s_min * (1 + noise / global_batch) * step


@dataclasses.dataclass(frozen=True)
class Target:
    """A target a run reached: steps at its global batch, and the run's
    noise scale with its interval (high None: unbounded); noise None: not
    measured (only rows at `global_batch` get a time to the target)."""
    steps: float
    global_batch: int
    noise: Optional[float]
    noise_interval: Optional[Tuple[float, Optional[float]]]


def project(workload: Workload, system: System, gpu_counts: Sequence[int],
            plan: Plan = Plan(), target_efficiency: float = 0.9,
            target: Optional[Target] = None,
            spread: Uncertainty = Uncertainty(),
            hold_batch: bool = True) -> List[dict]:
    """One row per GPU count: the split, throughput (with its band), weak
    and strong efficiency, the network the target efficiency needs, the
    dominant term, and the time to `target` (with its band): at the
    target's own global batch where it splits into whole examples on the
    row's GPUs (`hold_batch`: fewer micro-batches, then smaller ones, no
    noise scale needed), else at the row's batch through the noise
    scale."""
    (low_w, low_s), (high_w, high_s) = corners(workload, system, spread)
    reference = dataclasses.replace(
        plan, framework=frameworks.PRESETS[frameworks.REFERENCE])
    single = step_seconds(workload, system, 1, plan)
    first = gpu_counts[0]
    strong_batch = first * workload.examples_per_gpu
    strong_base = throughput(workload, system, first, plan)
    rows = []
    for gpus in gpu_counts:
        split = step_split(workload, system, gpus, plan)
        step = sum(split.values())
        strong = strong_workload(workload, strong_batch, gpus)
        band = [throughput(low_w, low_s, gpus, plan),
                throughput(high_w, high_s, gpus, plan)]
        if not plan.framework.measured_on_gpus:
            # No GPU run stands behind it: the band reaches a framework's
            # that has one (`frameworks.REFERENCE`).
            band[0] = min(band[0], throughput(low_w, low_s, gpus, reference))
        row = {"gpus": gpus, "nodes": nodes_for(system, gpus),
               "global_batch": gpus * workload.examples_per_gpu,
               "step_seconds": step, "split": split,
               "throughput": throughput(workload, system, gpus, plan),
               "throughput_band": band,
               "weak_efficiency": single / step,
               "strong_efficiency": (
                   None if strong is None else
                   throughput(strong, system, gpus, plan)
                   / (strong_base * gpus / first)),
               "dominant": max(split, key=split.get),
               "dominant_overhead": max(
                   (t for t in TERMS if t != "compute"), key=split.get),
               "needed_nic_bandwidth": needed_network(
                   workload, system, gpus, target_efficiency, plan)}
        held = (strong_workload(workload, target.global_batch, gpus)
                if target is not None and hold_batch else None)
        if held is not None:
            row.update(_held_times(held, system, gpus, plan, spread, target))
        elif target is not None:
            row.update(_target_times(row, target, step,
                                     step_seconds(low_w, low_s, gpus, plan),
                                     step_seconds(high_w, high_s, gpus,
                                                  plan)))
        rows.append(row)
    return rows


def _held_times(held: Workload, system: System, gpus: int, plan: Plan,
                spread: Uncertainty, target: Target) -> dict:
    """The time to `target` at its own global batch on `gpus` GPUs (the
    `held` workload: `strong_workload`): its steps, no noise scale."""
    (low_w, low_s), (high_w, high_s) = corners(held, system, spread)
    band = sorted(target.steps * step_seconds(w, s, gpus, plan)
                  for w, s in ((low_w, low_s), (high_w, high_s)))
    return {"time_to_target": target.steps * step_seconds(held, system,
                                                          gpus, plan),
            "time_to_target_band": band,
            "target_split": (f"batch {target.global_batch} = "
                             f"{held.micro_batch} x {held.accumulation} a "
                             "GPU")}


def _target_times(row, target: Target, step, slow, fast) -> dict:
    batch = row["global_batch"]
    if target.noise is None:
        # No noise scale: only the target's own batch has a step count.
        if batch != target.global_batch:
            return {"time_to_target": None, "time_to_target_band": None}
        return {"time_to_target": target.steps * step,
                "time_to_target_band": sorted(
                    [target.steps * slow, target.steps * fast])}
    low_noise, high_noise = target.noise_interval
    high_noise = math.inf if high_noise is None else high_noise
    times = [time_to_target(s, batch, target.steps, target.global_batch, b)
             for s, b in itertools.product(
                 (slow, fast), (low_noise, high_noise))]
    return {"time_to_target": time_to_target(
                step, batch, target.steps, target.global_batch, target.noise),
            "time_to_target_band": [min(times), max(times)]}
