"""TrainConfig: how the Trainer trains (batch, accumulation, XLA, precision,
checkpoints, logging). Frozen and validated on construction."""

import dataclasses
from typing import Optional

from tfscale.cluster import contract, devices
from tfscale import precision as precision_lib
from tfscale import xla_flags
from tfscale.errors import ConfigError
from tfscale.noise.scale import NoiseScaleConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train.

    Attributes:
        global_batch_size: Examples per optimizer step, over all replicas and
            accumulation micro-batches.
        num_accumulation_steps: Micro-batches per optimizer step.
        micro_batch_size: The batch one replica computes at once; when set,
            the accumulation steps follow from the replica count
            (global batch / (replicas x micro batch), `resolve_replicas`):
            a job restarted on another worker count (an elastic launcher)
            keeps its global batch and its micro-batches. None: the
            per-replica batch follows from `num_accumulation_steps`.
        jit_compile: XLA-compile the forward/backward (with one replica per
            worker, the whole step: `step/train_step.py`). None: auto, on where the
            strategy's devices are all GPUs (`resolve_auto`).
        compile_update: XLA-compile, also without `jit_compile`, what
            holds no matmul: the work after the all-reduce (loss-scale
            removal, the finite check, the noise scale's norms, clipping)
            and, where the worker holds one replica, the optimizer update
            of all variables (one kernel launch instead of several per
            variable). None: auto, on where the strategy's devices are all
            GPUs (where each launch costs), off on CPUs (XLA's CPU
            reductions run about 3x slower than TensorFlow's: a 2-worker
            CNN step took 15 ms longer with it). False: TensorFlow's
            op-by-op kernels, as Keras runs them.
        xla_gemm: With `jit_compile` on a GPU, where XLA sends GEMMs:
            "cublas" (the default) or "triton" (`tfscale/xla_flags.py`;
            `jobs.run` composes XLA_FLAGS from it).
        clip_global_norm: Clip reduced gradients to this global norm.
        precision: "float32" (the default: whatever the model's policy is),
            "mixed_bfloat16" or "mixed_float16": must then be the dtype
            policy the model was built with (`precision.set_precision`
            before building). Loss scaling follows the model's policy.
        initial_loss_scale: fp16's first loss scale (None: 2**15).
        dynamic_loss_scale: The scale halves on non-finite gradients and
            doubles after 2,000 finite steps; False: it stays at
            `initial_loss_scale` (a step with non-finite gradients is
            still skipped).
        checkpoint_dir: Where the chief keeps checkpoints; None: none.
        save_checkpoints_steps: Save every this many steps (0: only at the
            end of `fit`).
        max_checkpoints_to_keep: How many checkpoints to keep.
        log_steps: Report throughput and the time split every this many steps.
        steps_per_execution: The most optimizer steps one call of the
            compiled step runs (Keras's `steps_per_execution`, Google's
            `iterations_per_loop`): the host reads the device once per call,
            not once per step. A call ends at the next log or checkpoint
            boundary and within about `max_call_seconds`; batch callbacks
            run once per call, as in Keras; a preemption signal is acted on
            at the end of the call in flight.
        steps_per_launch: K > 1: K optimizer steps in one XLA program (a
            loop of static trip count K over K steps' batches, taken,
            checked and stacked before the launch): the host launches
            once per K steps, not once per step. Needs the step to be one
            XLA program (one replica alone, `jit_compile`, the update
            compiled). A call runs whole launches (flags, the call bound
            and batch checks hold per launch; logs, the noise scale and
            checkpoints see every step); steps left over before a log or
            checkpoint boundary run one at a time. 1: one step a launch.
        max_call_seconds: The bound on one call's wall time, so that a
            signal (SIGTERM, SIGUSR1) or `stop_training` is acted on within
            about this many seconds plus a step and the save at any
            `steps_per_execution` (`step/pace.py`): the steps per call are
            sized from the measured step time, agreed by all workers. None
            or 0: no bound (a call runs `steps_per_execution` steps).
        timed_steps_per_log: Steps per log interval run part by part to
            measure the time split (each part followed by a host wait): the
            interval's last ones (`step/plan.py`), and step 2, untimed,
            when the first epoch reaches one (the programs they call are
            traced there); the others run `steps_per_execution` at a
            time. 0: none.
        straggler_threshold: With several workers, the chief names a
            worker whose own work a step (input wait and compute, from the
            timed steps) is more than this fraction above the other
            workers' median, over the last 3 log intervals
            (`trainer/peers.py`); every worker's numbers go to `intervals`
            and TensorBoard either way. 0: never named.
        verbose: 0 silent, 1 progress bar, 2 one line per log interval (the
            chief only in every case).
        shard_optimizer_state: ZeRO stage 1 (`zero/optimizer.py`): each of N workers
            keeps the optimizer slots of 1/N of the weights; gradients are
            reduce-scattered and the new weights all-gathered (no more
            bytes than the all-reduce). SGD, Adam/AdamW and LAMB; one
            replica per worker; a no-op with one. Checkpoints keep the
            unsharded layout (resume on any worker count, either way).
        noise_scale: How the gradient noise scale (the critical batch
            estimate) is measured in the step; `NoiseScaleConfig(mode="off")`
            switches it off. See `noise/scale.py`.
        fail_fast: With several workers, an uncaught exception ends this
            worker at once (`fail_fast.install`, a `sys.excepthook` for the
            rest of the process), so its peers fail at once too. False:
            the process's hook stays the user's.
        say_placement: Every worker says where it trains (its `placement:`
            line: replicas, variables, the GPUs it sees) once, when its
            Trainer is built, unless `verbose` is 0. The jobs turn it off:
            their start banner has the line.
    """

    global_batch_size: int
    num_accumulation_steps: int = 1
    micro_batch_size: Optional[int] = None
    jit_compile: Optional[bool] = False
    xla_gemm: str = "cublas"
    compile_update: Optional[bool] = None
    clip_global_norm: Optional[float] = None
    precision: str = "float32"
    initial_loss_scale: Optional[float] = None
    dynamic_loss_scale: bool = True
    checkpoint_dir: Optional[str] = None
    save_checkpoints_steps: int = 0
    max_checkpoints_to_keep: int = 5
    log_steps: int = 100
    steps_per_execution: int = 1
    steps_per_launch: int = 1
    max_call_seconds: Optional[float] = 2.0
    timed_steps_per_log: int = 4
    straggler_threshold: float = 0.2
    verbose: int = 2
    shard_optimizer_state: bool = False
    noise_scale: NoiseScaleConfig = NoiseScaleConfig()
    fail_fast: bool = True
    say_placement: bool = True

    def __post_init__(self):
        if self.global_batch_size <= 0:
            raise ValueError(
                f"global_batch_size must be > 0, got {self.global_batch_size}")
        if self.micro_batch_size is not None and (
                self.micro_batch_size < 1 or self.num_accumulation_steps != 1):
            raise ConfigError(
                "micro_batch_size", "micro_batch_size must be >= 1 and "
                "excludes num_accumulation_steps (it sets them), got "
                f"{self.micro_batch_size} with {self.num_accumulation_steps}")
        if self.num_accumulation_steps < 1:
            raise ValueError("num_accumulation_steps must be >= 1, got "
                             f"{self.num_accumulation_steps}")
        if self.xla_gemm not in ("cublas", "triton"):
            raise ValueError("xla_gemm must be 'cublas' or 'triton', got "
                             f"{self.xla_gemm!r}")
        if self.precision not in precision_lib.PRECISIONS:
            raise ValueError(f"precision must be one of "
                             f"{precision_lib.PRECISIONS}, got {self.precision!r}")
        if self.initial_loss_scale is not None and not (
                self.initial_loss_scale >= 1):
            raise ValueError("initial_loss_scale must be >= 1, got "
                             f"{self.initial_loss_scale}")
        if self.save_checkpoints_steps < 0:
            raise ValueError("save_checkpoints_steps must be >= 0, got "
                             f"{self.save_checkpoints_steps}")
        if self.log_steps < 1:
            raise ValueError(f"log_steps must be >= 1, got {self.log_steps}")
        if self.steps_per_execution < 1:
            raise ValueError("steps_per_execution must be >= 1, got "
                             f"{self.steps_per_execution}")
        if self.steps_per_launch < 1:
            raise ConfigError("steps_per_launch", "steps_per_launch must be "
                              f">= 1, got {self.steps_per_launch}")
        problem = contract.seconds_problem("max_call_seconds",
                                           self.max_call_seconds)
        if problem:
            raise ConfigError("max_call_seconds", problem)
        if not 0 <= self.straggler_threshold < 100:
            raise ValueError("straggler_threshold must be in [0, 100), got "
                             f"{self.straggler_threshold}")
        if self.timed_steps_per_log < 0:
            raise ValueError("timed_steps_per_log must be >= 0")


def resolve_auto(config: TrainConfig, strategy) -> TrainConfig:
    """`config` with its auto fields (`jit_compile=None`,
    `compile_update=None`) decided for `strategy`: on where its devices are
    all GPUs (`xla_flags.choose`), off on CPUs; the update also compiled
    with `steps_per_launch` > 1."""
    if config.jit_compile is not None and config.compile_update is not None:
        return config
    replica_devices = devices.worker_devices(strategy)
    on_gpus = all("GPU" in device.upper() for device in replica_devices)
    # Several steps a launch are one program with their updates: auto
    # compiles the update for them, on any device.
    return dataclasses.replace(
        config,
        jit_compile=xla_flags.choose(config.jit_compile, on_gpus)[0],
        compile_update=xla_flags.choose(
            config.compile_update,
            on_gpus or config.steps_per_launch > 1)[0])


def resolve_replicas(config: TrainConfig, replicas: int) -> TrainConfig:
    """`config` with its accumulation steps for `replicas` when it gives
    `micro_batch_size` (ConfigError naming the three numbers when they do
    not divide); else `config`."""
    micro = config.micro_batch_size
    if micro is None:
        return config
    if config.global_batch_size % (replicas * micro):
        raise ConfigError(
            "micro_batch_size", f"global batch {config.global_batch_size} "
            f"is not {replicas} replica(s) x micro-batch {micro} x a whole "
            "number of accumulation steps: give a micro-batch or a "
            "worker count that divides it")
    return dataclasses.replace(
        config, micro_batch_size=None,
        num_accumulation_steps=config.global_batch_size // (replicas * micro))


def check_fits(model, config: TrainConfig, replicas: int) -> None:
    """Raises ConfigError (global_batch_size) when the batch does not divide
    into replicas x accumulation steps, ValueError when the model is not
    built or its dtype policy is not `config.precision`."""
    divisor = replicas * config.num_accumulation_steps
    if config.global_batch_size % divisor:
        raise ConfigError(
            "global_batch_size", f"global batch size "
            f"{config.global_batch_size} is not divisible by replicas "
            f"({replicas}) x accumulation steps "
            f"({config.num_accumulation_steps})")
    if not model.built:
        raise ValueError("build the model (call it on a batch or build it "
                         "with shapes) under strategy.scope() first")
    policy = model.dtype_policy.name
    if config.precision != "float32" and config.precision != policy:
        raise ValueError(
            f"TrainConfig.precision is {config.precision!r} but the model "
            f"was built with dtype policy {policy!r}: call "
            "tfscale.precision.set_precision before building the model")
