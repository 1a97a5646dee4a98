"""What a job (`jobs.run`) prints: the lines before training (workers,
numerics, model, optimizer) and after it (loss, throughput, checkpoint,
the noise scale's advice, AdaScale, evaluation)."""

import os

from tfscale.cluster import all_reduce_impl
from tfscale.noise import advice as noise_advice
from tfscale.cluster.environment import ClusterConfig
from tfscale.train_config import TrainConfig


def before(task, info, trainer, built, xla=None, xla_why="") -> str:
    """The lines the chief prints before training: workers, numerics (with
    why XLA is on or off, `xla_why`, and the XLA flags composed, `xla`: an
    `xla_flags.XlaSetup`), the step's layout, the task's model and data,
    the optimizer (`jobs.Task`, `jobs.Built`)."""
    optim = task.config.optim
    if built.optimizer is not None:
        optimizer = (f"optimizer {type(built.optimizer).__name__} (the "
                     f"task's own), {optim.total_steps} steps")
    else:
        scaling = optim.scaling_rule
        if scaling != "none" and optim.reference_batch_size:
            scaling += f" from batch {optim.reference_batch_size}"
        optimizer = (f"optimizer {optim.optimizer}, lr "
                     f"{optim.learning_rate:g} ({optim.schedule}, warmup "
                     f"{optim.warmup_steps}, scaling {scaling}), "
                     f"{optim.total_steps} steps")
    return "\n".join([
        task.title, *("  " + note for note in task.config.notes),
        workers_line(info, trainer),
        f"  {trainer.placement.describe()}",
        numerics_line(trainer.config, task.config.cluster, xla_why,
                      all_reduce_impl.describe(trainer.strategy,
                                               task.config.cluster)),
        f"  step: {trainer.step_layout}",
        calls_line(trainer.config),
        *([f"  XLA on a GPU: {xla.description}"] if xla else []),
        *("  " + line for line in task.describe(built.model)),
        "  " + optimizer + _sharding(trainer)])


def calls_line(train: TrainConfig) -> str:
    """"  calls: up to 100 steps and about 2 s each (a signal is acted on
    within that, a step and the save); log every 100 steps"."""
    bound = (f" and about {train.max_call_seconds:g} s each (a signal is "
             "acted on within that, a step and the save)"
             if train.max_call_seconds else
             " each, no time bound (a signal waits for the call in flight)")
    launches = (f" in launches of {train.steps_per_launch}"
                if train.steps_per_launch > 1 else "")
    return (f"  calls: up to {train.steps_per_execution} steps{launches}"
            f"{bound}; log every {train.log_steps} steps")


def _sharding(trainer) -> str:
    """", optimizer state sharded over 2 workers (2.3 MB each)" or ""."""
    if not trainer.config.shard_optimizer_state:
        return ""
    if trainer.collectives.num_replicas == 1:
        return ", optimizer state whole (one replica: nothing to shard)"
    return (f", optimizer state sharded over "
            f"{trainer.collectives.num_replicas} workers "
            f"({trainer.optimizer_state_bytes / 1e6:.1f} MB each)")


def workers_line(info, trainer) -> str:
    """"workers 2 (tf_config), replicas 2, global batch 64 = ..."."""
    train = trainer.config
    replicas = trainer.collectives.num_replicas
    return (f"  workers {info.num_workers} ({info.source}), replicas "
            f"{replicas}, global batch {train.global_batch_size} = "
            f"{trainer.per_replica_batch_size} per replica x {replicas} x "
            f"{train.num_accumulation_steps} accumulation")


def numerics_line(train: TrainConfig, cluster: ClusterConfig,
                  xla_why: str = "", all_reduce: str = "") -> str:
    """Precision, XLA and the all-reduce (`all_reduce`, as
    `all_reduce_impl.describe` says; default: the flag's)."""
    why = f" ({xla_why})" if xla_why else ""
    return (f"  precision {train.precision}, XLA "
            f"{'on' if train.jit_compile else 'off'}{why}, all-reduce "
            + ("MPI.Allreduce" if cluster.backend == "mpi" else
               all_reduce or cluster.all_reduce_alg))


def after(title: str, results: dict, unit: str = "examples",
          output_dir: str = None) -> str:
    """The lines a run prints at its end (loss, throughput, checkpoint,
    evaluation, and where its numbers are: summary.json and TensorBoard in
    `output_dir`)."""
    rows = results["intervals"]
    first = rows[0]["interval_loss"] if rows else float("nan")
    last = rows[-1]["interval_loss"] if rows else float("nan")
    lines = [f"{title} done",
             f"  steps {results['steps']}, "
             f"{results['examples_per_second']:.1f} {unit}/s (the first "
             f"interval, with compilation, apart: "
             f"{results.get('first_interval_examples_per_second', 0):.1f}), "
             f"{results['wall_seconds']:.1f} s",
             f"  loss {first:.4f} (first interval) -> {last:.4f} (last)",
             f"  checkpoint {results['checkpoint']}"]
    sentence = noise_advice.closing_sentence(results.get("noise_scale"),
                                             results["steps"])
    if sentence:
        lines.append(sentence)
    adascale = results.get("adascale")
    if adascale:
        of = (f" of the reference run's {adascale['reference_steps']}"
              if adascale["reference_steps"] else "")
        lines.append(
            f"  AdaScale: {adascale['steps']} steps at mean gain "
            f"{adascale['mean_gain'] or 0:.3g} walked "
            f"{adascale['progress']:.0f}{of} reference steps "
            f"({adascale['examples']:,} examples)")
    if "export" in results:
        lines.append(f"  export {results['export']}")
    if "eval" in results:
        lines.append("  eval " + ", ".join(
            f"{k} {v:.4f}" for k, v in results["eval"].items()))
    if output_dir:
        lines.append(
            f"  numbers: {os.path.join(output_dir, 'summary.json')} (every "
            "log interval, each worker's time split); curves: tensorboard "
            f"--logdir {os.path.join(output_dir, 'tensorboard')}")
    return "\n".join(lines)
