"""What one step does on one GPU, the inputs a projection holds fixed as
the GPU count grows, and how to read them from a run's summary.json."""

import dataclasses
import json
import math
from typing import Optional, Tuple

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class Workload:
    """Per-GPU work of one optimizer step.

    Attributes:
        parameters: Trainable parameters (the gradient's length).
        gradient_bytes: Bytes per gradient element on the wire.
        micro_batch: Examples per GPU per micro-batch.
        accumulation: Micro-batches per optimizer step.
        micro_seconds: Forward and backward of one micro-batch.
        update_seconds: The optimizer's update of every weight (one GPU's
            whole update; ZeRO-1 divides it among the ranks); None: from the
            framework's passes over the weights at the GPU's memory
            bandwidth (`frameworks.py`).
        fixed_seconds: Per-step time that neither grows nor shrinks with
            the GPU count (input the prefetch does not hide, launches).
        jitter: Coefficient of variation of one micro-batch's time: each
            step waits for the slowest of N workers.
        overlap: Share of the last backward pass the gradient sync can hide
            behind (0: the sync starts after the step's compute, as in
            tfscale's step and NVIDIA's accumulation; Horovod overlaps);
            None: the framework's.
        backward_share: Backward's share of a micro-batch's time.
        tensors: Gradient tensors a step reduces (the framework may pay a
            cost per tensor); 0: unknown, no such cost.
    """
    parameters: float
    micro_batch: int
    accumulation: int
    micro_seconds: float
    gradient_bytes: int = 4
    update_seconds: Optional[float] = None
    fixed_seconds: float = 0.0
    jitter: float = 0.0
    overlap: Optional[float] = None
    backward_share: float = 2 / 3
    tensors: int = 0

    def __post_init__(self):
        if self.parameters <= 0:
            raise ValueError(f"parameters must be > 0, got {self.parameters}")
        if self.micro_batch < 1 or self.accumulation < 1:
            raise ValueError("micro_batch and accumulation must be >= 1, got "
                             f"{self.micro_batch} and {self.accumulation}")
        if self.micro_seconds <= 0:
            raise ValueError("the micro-batch's seconds must be > 0, got "
                             f"{self.micro_seconds}")
        if self.overlap is not None and not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")
        for name in ("update_seconds", "fixed_seconds", "jitter"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.tensors < 0:
            raise ValueError(f"tensors must be >= 0, got {self.tensors}")
        if self.gradient_bytes not in (1, 2, 4, 8):
            raise ValueError("gradient_bytes must be 1, 2, 4 or 8, got "
                             f"{self.gradient_bytes}")

    @property
    def gradient_size(self) -> float:
        """Bytes of one gradient all-reduce."""
        return self.parameters * self.gradient_bytes

    @property
    def examples_per_gpu(self) -> int:
        return self.micro_batch * self.accumulation

    def with_accumulation(self, accumulation: int) -> "Workload":
        return dataclasses.replace(self, accumulation=accumulation)


def update_estimate(parameters: float, memory_bandwidth: float,
                    passes: int = 10, efficiency: float = 0.5) -> float:
    """Seconds of an element-wise optimizer update bound by memory: LAMB or
    Adam read the weight, gradient and two moments and write three (plus
    the norms' passes): about 10 float32 passes over the parameters."""
    return parameters * 4 * passes / (memory_bandwidth * efficiency)


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What a finished run says beyond its workload."""
    workload: Workload
    replicas: int
    sync_seconds: float
    global_batch: int
    steps: int
    noise_scale: Optional[float]
    noise_interval: Optional[Tuple[float, Optional[float]]]
    backend: str
    device: str = "?"  # "cpu" or "gpu": what the run computed on
    # (1-minute load average, cores) of the run's host at its end, or None
    host_load: Optional[Tuple[float, int]] = None

    @property
    def loaded(self) -> bool:
        """The host ran more than it had cores for: its timings hold other
        work."""
        return bool(self.host_load) and self.host_load[0] > self.host_load[1]


def from_summary(path: str) -> RunFacts:
    """A run's workload from its summary.json (`run_pretraining.py`, the
    image job): the steady log intervals' phases, scaled so that they add
    up to the untimed step; the jitter from the spread of the intervals'
    step times (summary.json keeps no single step's time)."""
    with open(path) as f:
        summary = json.load(f)
    missing = [k for k in ("parameters", "num_accumulation_steps",
                           "intervals", "global_batch_size", "replicas")
               if k not in summary]
    if missing:
        raise ValueError(f"{path}: no {missing}: a summary.json of "
                         "run_pretraining.py or train_image_classifier.py "
                         "from this version holds them")
    rows = [r for r in summary["intervals"] if not r.get("first")]
    if not rows:
        raise ValueError(f"{path}: no steady log interval (the first holds "
                         "compilation): run more steps than --log_steps")
    phases = {name: _mean(rows, name) for name in
              ("compute", "sync", "update", "input_wait", "step_time",
               "timed_step_time")}
    scale = phases["step_time"] / max(phases["timed_step_time"], 1e-12)
    k = summary["num_accumulation_steps"]
    replicas = summary["replicas"]
    micro_batch = summary["global_batch_size"] // (replicas * k)
    times = [r["step_time"] for r in rows]
    jitter = 0.0
    if len(times) > 1:
        mean = sum(times) / len(times)
        std = math.sqrt(sum((t - mean) ** 2 for t in times) / (len(times) - 1))
        # The spread of the intervals' means, taken as one step's: a floor
        # for independent steps (an interval's mean varies less than a
        # step), about right for the slow drift a shared host shows. One
        # micro-batch varies sqrt(k) less than a step.
        jitter = std / mean / math.sqrt(k)
    workload = Workload(
        parameters=summary["parameters"], micro_batch=micro_batch,
        accumulation=k, micro_seconds=phases["compute"] * scale / k,
        gradient_bytes=4, update_seconds=phases["update"] * scale,
        fixed_seconds=phases["input_wait"] * scale, jitter=jitter,
        tensors=summary.get("gradient_tensors", 0))
    noise = summary.get("noise_scale") or {}
    interval = noise.get("b_simple_interval")
    return RunFacts(workload, replicas, phases["sync"] * scale,
                    summary["global_batch_size"], summary["steps"],
                    noise.get("b_simple"),
                    tuple(interval) if interval else None,
                    summary.get("backend", "?"),
                    (summary.get("device") or {}).get("kind", "?"),
                    _host_load(summary.get("host")))


def _host_load(host) -> Optional[Tuple[float, int]]:
    if not host or host.get("load_average") is None:
        return None
    return float(host["load_average"]), int(host.get("cores") or 1)


def _mean(rows, name):
    steps = sum(r["steps"] for r in rows)
    return sum(r[name] * r["steps"] for r in rows) / steps
