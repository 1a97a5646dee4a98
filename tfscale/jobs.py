"""The steps every training job takes on each worker, whatever it trains.

    info, strategy = start_worker(cluster_config, ...)   # before any TF op
    ... build the model and optimizer under strategy.scope() ...
    trainer = make_trainer(...)
    intervals = fit(trainer, dataset_fn, steps, output_dir, log_steps)
    results = run_results(trainer, info, ...); print(done_summary(...))

`models/tasks/pretraining.py` (BERT) and `image_classification.py` (ResNet-50) are
these steps around their own records and model. Errors the user can fix
are `JobError`s: one line, naming the setting (which is also the flag).
"""

import contextlib
import os
from typing import Optional, Tuple

import keras
import tensorflow as tf

from tfscale import checkpointing
from tfscale import cluster as cluster_lib
from tfscale import strategies
from tfscale import collectives
from tfscale import noise_scale
from tfscale import precision as precision_lib
from tfscale.cluster import ClusterConfig
from tfscale.timing import IntervalLog
from tfscale.train_config import TrainConfig
from tfscale.trainer import Trainer


class JobError(Exception):
    """A problem the user can fix, in one line.

    Attributes:
        setting: The config field (and flag) at fault, or None.
    """

    def __init__(self, setting: Optional[str], message: str):
        self.setting = setting
        super().__init__(f"--{setting}: {message}" if setting else message)


def check_job_config(*, output_dir: str, train: TrainConfig, do_train: bool,
                     evaluates: bool) -> None:
    """What every job config needs: somewhere to write and something to do.

    Raises:
        ValueError: "<field> ..." (the entry points turn it into the flag).
    """
    if not output_dir:
        raise ValueError("output_dir is required")
    if not train.checkpoint_dir:
        raise ValueError("train.checkpoint_dir is required")
    if not (do_train or evaluates):
        raise ValueError("do_train and do_eval are both False: nothing to do")


@contextlib.contextmanager
def blame(setting: str, *errors):
    """Turns `errors` raised inside the block into a `JobError` naming
    `setting` (their message is already the one line the user reads)."""
    try:
        yield
    except errors as e:
        raise JobError(setting, str(e)) from None


def start_worker(cluster: ClusterConfig, *, output_dir: str, precision: str,
                 seed: int, deterministic: bool) -> Tuple[object, object]:
    """This worker's place in the cluster and its strategy, with seeds,
    determinism and the dtype policy set (before the first TF op).

    Raises:
        JobError: The cluster setup is wrong (named by `ClusterError`).
    """
    try:
        info = cluster_lib.resolve_cluster(
            slurm_port_base=cluster.slurm_port_base, backend=cluster.backend)
        tf.io.gfile.makedirs(output_dir)  # also when only evaluating
        if deterministic:
            tf.config.experimental.enable_op_determinism()
        keras.utils.set_random_seed(seed)
        precision_lib.set_precision(precision)
        return info, strategies.make_strategy(info, cluster)
    except cluster_lib.ClusterError as e:
        raise JobError(None, str(e)) from None


def make_trainer(*, model, optimizer, loss_fn, strategy, metrics,
                 cluster: ClusterConfig, train: TrainConfig) -> Trainer:
    """The Trainer over the cluster's backend.

    Raises:
        JobError: The backend is not installed (--backend), the batch
            does not divide (--train_batch_size), the noise scale's mode
            does not fit the optimizer (--noise_scale), or AdaScale cannot
            measure its gain (--lr_scaling).
    """
    try:
        backend = collectives.make(cluster.backend, strategy,
                                   cluster.collective_timeout_seconds)
    except ImportError as e:
        raise JobError("backend", str(e)) from None
    try:
        return Trainer(model=model, optimizer=optimizer, loss_fn=loss_fn,
                       strategy=strategy, config=train, metrics=metrics,
                       backend=backend)
    except ValueError as e:
        setting = ("lr_scaling" if str(e).startswith("AdaScale") else
                   "noise_scale" if "noise scale" in str(e)
                   else "train_batch_size")
        raise JobError(setting, str(e)) from None


def fit(trainer: Trainer, dataset_fn, steps: int, output_dir: str,
        profile_steps: Optional[Tuple[int, int]] = None) -> IntervalLog:
    """Trains to `steps` (resuming from the latest checkpoint) with the
    interval log, TerminateOnNaN and TensorBoard in `output_dir`.

    Raises:
        JobError: The checkpoint in output_dir does not fit (--output_dir).
        InputPipelineError: The records failed (callers name the record).
    """
    intervals = IntervalLog()
    callbacks = [intervals, keras.callbacks.TerminateOnNaN(),
                 keras.callbacks.TensorBoard(
                     os.path.join(output_dir, "tensorboard"),
                     update_freq=trainer.config.log_steps,
                     profile_batch=profile_steps or 0)]
    try:
        trainer.fit(dataset_fn, steps_per_epoch=steps, epochs=1,
                    callbacks=callbacks)
    except checkpointing.RestoreError as e:
        raise JobError("output_dir", str(e)) from None
    return intervals


def run_results(trainer: Trainer, info, backend: str, wall_seconds: float,
                intervals: IntervalLog) -> dict:
    """What summary.json holds about the training part of a run."""
    return {"steps": int(trainer.step.numpy()),
            "global_batch_size": trainer.config.global_batch_size,
            "num_workers": info.num_workers,
            "replicas": trainer.collectives.num_replicas,
            "backend": backend,
            "wall_seconds": wall_seconds,
            "examples_per_second": intervals.mean_examples_per_second(),
            "intervals": intervals.rows,
            "checkpoint": trainer.checkpoint_path,
            "noise_scale": (trainer.noise_scale.summary()
                            if trainer.noise_scale else None)}


def workers_line(info, trainer: Trainer) -> str:
    """"workers 2 (tf_config), replicas 2, global batch 64 = ..."."""
    train = trainer.config
    replicas = trainer.collectives.num_replicas
    return (f"  workers {info.num_workers} ({info.source}), replicas "
            f"{replicas}, global batch {train.global_batch_size} = "
            f"{trainer.per_replica_batch_size} per replica x {replicas} x "
            f"{train.num_accumulation_steps} accumulation")


def numerics_line(train: TrainConfig, cluster: ClusterConfig) -> str:
    return (f"  precision {train.precision}, XLA "
            f"{'on' if train.jit_compile else 'off'}, all-reduce "
            + ("MPI.Allreduce" if cluster.backend == "mpi" else
               cluster.all_reduce_alg))


def done_summary(title: str, results: dict, unit: str = "examples") -> str:
    """The lines a run prints at its end (loss, throughput, checkpoint,
    evaluation)."""
    rows = results["intervals"]
    first = rows[0]["interval_loss"] if rows else float("nan")
    last = rows[-1]["interval_loss"] if rows else float("nan")
    lines = [f"{title} done",
             f"  steps {results['steps']}, "
             f"{results['examples_per_second']:.1f} {unit}/s (mean of log "
             f"intervals), {results['wall_seconds']:.1f} s",
             f"  loss {first:.4f} (first interval) -> {last:.4f} (last)",
             f"  checkpoint {results['checkpoint']}"]
    sentence = noise_scale.closing_sentence(results.get("noise_scale"),
                                            results["steps"])
    if sentence:
        lines.append(sentence)
    if "export" in results:
        lines.append(f"  export {results['export']}")
    if "eval" in results:
        lines.append("  eval " + ", ".join(
            f"{k} {v:.4f}" for k, v in results["eval"].items()))
    return "\n".join(lines)
