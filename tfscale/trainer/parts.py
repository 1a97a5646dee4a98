"""The Trainer's parts, built in the one order that works (`assemble`).

Each part needs some before it: the collectives (how workers sum) give the
replica count the batch is checked against; the optimizer is unwrapped
from fp16's `LossScaleOptimizer` and built (or sharded, `zero/optimizer.py`) before
the step is traced; the step's noise groups define the noise scale; the
noise scale is what AdaScale follows; the checkpoint holds all of them;
the resume restores it (`resume/start.py`). The Trainer (`trainer/loop.py`) then runs
the loop over them.
"""

import contextlib
import dataclasses
from typing import Any, Callable, Optional

from tfscale import _compat
from tfscale.cluster import collectives as collectives_lib
from tfscale.cluster import devices, environment, placement
from tfscale.errors import ConfigError
from tfscale.trainer import evaluation
from tfscale.cluster import fail_fast
from tfscale.noise import scale as noise_lib
from tfscale import precision as precision_lib
from tfscale.resume import start as resume_lib
from tfscale.zero import optimizer as zero
from tfscale.optim.adascale import find_adascale
from tfscale.resume.position import RunPosition
from tfscale.step.train_step import TrainStep
from tfscale.train_config import TrainConfig, check_fits, resolve_replicas


NOISE_NOT_MEASURED = ("gradient noise scale not measured: it needs at least 2 "
                      "micro-batches per step (replicas x accumulation "
                      "steps; here 1)")


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a Trainer is made of (see `assemble`)."""

    config: TrainConfig  # the Trainer's, its accumulation for its replicas
    collectives: Any
    optimizer: Any  # the one updated with (a LossScaleOptimizer's inner)
    loss_scale: Optional[precision_lib.DynamicLossScale]
    sharded: Optional[zero.ShardedOptimizer]
    per_replica_batch_size: int
    position: RunPosition
    train_step: TrainStep
    noise_scale: Optional[noise_lib.NoiseScale]
    adascale: Any  # the optimizer's AdaScale schedule, or None
    eval_step: evaluation.EvalStep
    fit_start: resume_lib.FitStart
    noise_notice: Optional[str]  # what the first fit says, or None
    saver: resume_lib.Saver
    placement: placement.Placement  # where replicas and variables are


@contextlib.contextmanager
def borrowed(model, optimizer):
    """The user's model and optimizer as the Trainer's step needs them, for
    one `fit` or `evaluate`, and as found again afterwards (also after an
    error): the optimizer's own cross-replica sum switched off (the step
    all-reduces once itself; read when the step is traced, so a later
    `model.fit` traces Keras's own again), and `model.optimizer` the one
    the Trainer updates with (Keras's callbacks look for it there; with
    fp16, the `LossScaleOptimizer`'s inner one)."""
    previous = getattr(model, "optimizer", None)
    saved = _compat.disable_gradient_aggregation(optimizer)
    model.optimizer = optimizer
    try:
        yield
    finally:
        model.optimizer = previous
        _compat.restore_gradient_aggregation(saved)


def _optimizer(model, optimizer, strategy, config: TrainConfig,
               collectives):
    """(the optimizer updated with, fp16's loss scale or None, the sharded
    update or None). A LossScaleOptimizer gives its inner optimizer: the
    Trainer scales the loss itself, after the all-reduce. Not built when
    sharded (its sharded update keeps the slots: `zero/optimizer.py`)."""
    shards = config.shard_optimizer_state and collectives.num_replicas > 1
    optimizer, scaled = precision_lib.unwrap_loss_scaling(model, optimizer)
    with strategy.scope():
        if not shards:
            optimizer.build(model.trainable_variables)
        loss_scale = (precision_lib.loss_scale(config.initial_loss_scale,
                                               config.dynamic_loss_scale)
                      if scaled else None)
    sharded = (zero.sharded_optimizer(
        optimizer, model.trainable_variables, collectives, strategy,
        jit_compile=config.jit_compile or config.compile_update,
        noise_mode=config.noise_scale.mode) if shards else None)
    return optimizer, loss_scale, sharded


def _check_every_variable(strategy, model, optimizer, sharded, who: str):
    """Once the optimizer's slots exist: every variable of the run (the
    model's others, the slots, the sharded update's) where the replicas
    are (`placement.check`)."""
    return placement.check(
        strategy, [*model.variables, *optimizer.variables,
                   *(sharded.slots.values() if sharded is not None else ())],
        worker=who)


def check_default_strategy(strategy, backend) -> None:
    """A model built and compiled outside any `strategy.scope()` trains on
    TensorFlow's default strategy, as Keras's `fit` does: one replica, on
    this process alone. Raises ConfigError when this process is one of
    several workers (TF_CONFIG, SLURM, MPI), which would each train alone."""
    if backend != "mwms" or not devices.is_default_strategy(strategy):
        return
    try:
        info = environment.resolve_cluster()
    except environment.ClusterError:
        return  # said by whatever builds the cluster
    if info.num_workers > 1:
        raise ConfigError(
            "strategy", f"this process is worker {info.worker_index} of "
            f"{info.num_workers} ({info.source}), but the model was built "
            "outside any strategy's scope, so each worker would train "
            "alone: build and compile it under `with strategy.scope():` "
            "(strategy = tfscale.make_strategy(tfscale.resolve_cluster(), "
            "tfscale.ClusterConfig()))")


def _who(collectives) -> str:
    """"worker 1" (or "rank 1" on MPI): how lines name this process."""
    kind = "rank" if collectives.name == "mpi" else "worker"
    return f"{kind} {collectives.worker_index}"


def assemble(*, model, optimizer, loss_fn: Callable, strategy,
             config: TrainConfig, metrics: list, backend,
             take_batches: Callable) -> Parts:
    """The Trainer's parts (its constructor's arguments; `take_batches` is the
    step's `fn(iterator, k)`, reading the current fit's input).

    Raises:
        ConfigError: What the config asks that the parts cannot do.
        placement.PlacementError: This worker sees a GPU and the replicas
            or the model's variables are not on one.
        ValueError: The global batch does not divide into replicas x
            accumulation steps, or the model is not built.
    """
    check_default_strategy(strategy, backend)
    collectives = (collectives_lib.make(backend, strategy)
                   if isinstance(backend, str) else backend)
    # Before anything is traced: a run on the wrong devices stops here, in
    # one line (never a silent CPU run on a GPU host).
    placement.check(strategy, model.trainable_variables,
                    worker=_who(collectives))
    replicas = collectives.num_replicas
    config = resolve_replicas(config, replicas)
    check_fits(model, config, replicas)
    optimizer, loss_scale, sharded = _optimizer(model, optimizer, strategy,
                                                config, collectives)
    position = RunPosition(config.global_batch_size)
    train_step = TrainStep(
        model=model, optimizer=optimizer, loss_fn=loss_fn, metrics=metrics,
        strategy=strategy, collectives=collectives, config=config,
        take_batches=take_batches, loss_scale=loss_scale, sharded=sharded)
    # The gradient noise scale's running estimates (noise/scale.py).
    noise_scale = (
        noise_lib.NoiseScale(config.noise_scale, train_step.noise_groups,
                             config.global_batch_size,
                             optimizer=type(optimizer).__name__.lower())
        if train_step.measures_noise else None)
    adascale = find_adascale(optimizer, noise_scale, config.noise_scale.mode,
                             train_step.micro_batches_per_step)
    # Checkpoints hold the slots whole, in the unsharded layout.
    keeper = (resume_lib.make_keeper(
        config, model,
        sharded.checkpoint_view() if sharded is not None else optimizer,
        position, collectives, loss_scale=loss_scale, metrics=metrics,
        noise_scale=noise_scale, adascale=adascale)
        if config.checkpoint_dir else None)
    per_replica = (config.global_batch_size
                   // (replicas * config.num_accumulation_steps))
    fit_start = resume_lib.FitStart(
        model=model, optimizer=optimizer, metrics=metrics,
        collectives=collectives, position=position, keeper=keeper,
        noise_scale=noise_scale, strategy=strategy,
        per_replica_batch_size=per_replica, batch_words=(
            f"global batch {config.global_batch_size} over {replicas} "
            f"replica(s) x {config.num_accumulation_steps} accumulation "
            "step(s)"))
    if collectives.num_workers > 1 and config.fail_fast:
        # An uncaught exception on this worker ends the job at once (not
        # after a collective timeout): see fail_fast.py.
        fail_fast.install(f"worker {collectives.worker_index}",
                          collectives.abort)
    return Parts(
        config=config, collectives=collectives, optimizer=optimizer, loss_scale=loss_scale,
        sharded=sharded, per_replica_batch_size=per_replica,
        position=position, train_step=train_step, noise_scale=noise_scale,
        adascale=adascale, eval_step=evaluation.EvalStep(
            model=model, loss_fn=loss_fn, metrics=metrics, strategy=strategy,
            collectives=collectives), fit_start=fit_start,
        noise_notice=(NOISE_NOT_MEASURED if config.noise_scale.enabled
                      and not train_step.measures_noise else None),
        saver=resume_lib.Saver(keeper, position, noise_scale=noise_scale,
                               sharded=sharded),
        placement=_check_every_variable(strategy, model, optimizer, sharded,
                                        _who(collectives)))
