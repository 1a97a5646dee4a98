"""`model.fit` as a correct multi-worker citizen: `enable_multi_worker_fit()`.

Keras 3's `fit` under MultiWorkerMirroredStrategy (MWMS) fails outright
(docs/facts.md, facts 1 and 6) and, once it runs, still treats every worker as if
it were alone. After `tfscale.enable_multi_worker_fit()`, a `fit` under MWMS:

  * writes files on the chief only: `ModelCheckpoint`, `TensorBoard`,
    `CSVLogger` and `BackupAndRestore` write into a private temporary
    directory on the other workers (removed at the end), and every worker
    restores from the chief's `BackupAndRestore` backup, so all resume from
    the same weights and epoch;
  * stops all workers when a callback sets `model.stop_training` on any
    worker (one tiny all-reduce after each batch and epoch; a worker that
    stopped alone would leave the others waiting in a collective);
  * is preemptible (`fit_preemption.py`, on one worker too): SIGTERM,
    SIGUSR1 or Ctrl-C -> every worker at the same batch -> the
    BackupAndRestore backup written there -> exit 143 (130), "nothing
    saved" and exit 3 without one; the rerun resumes mid-epoch;
  * clips (`clipnorm`, `global_clipnorm`, `clipvalue`) after the all-reduce
    (with several replicas on one worker too),
    and decides a `LossScaleOptimizer`'s finite check on the reduced
    gradients, the same on every worker (Keras clips each replica's partial
    gradients, fact 8, and a worker whose local gradients overflow would
    skip an all-reduce the others enter);
  * commits `BackupAndRestore`'s backups atomically and durably
    (`_compat_callbacks.atomic_backup`; with one replica too);
  * prints progress on the chief only;
  * refuses, in one line, a strategy whose replicas or variables are not
    on the GPUs the worker sees (`tfscale/cluster/placement.py`; any
    replica count);
  * makes an uncaught error on one worker end the job at once
    (`fail_fast.py`), instead of leaving its peers in a collective.

What it cannot make correct fails before training with one line that points
to `tfscale.Trainer`: Keras's `gradient_accumulation_steps` (its
accumulate-or-apply `cond` holds the all-reduce). With one replica, `fit` is
left as Keras has it but for the atomic backups, the placement line and
preemption.
"""

import inspect
import shutil
import sys
import tempfile

import keras
import tensorflow as tf

from tfscale import _compat
from tfscale.keras import callback_files, fit_preemption
from tfscale.cluster import all_reduce_impl, fail_fast, placement
from tfscale.cluster import environment
from tfscale.cluster.environment import ClusterConfig
from tfscale.cluster.strategies import (chief_and_worker_count,
                                        say_startup_order, worker_index)


def enable_multi_worker_fit() -> None:
    """Makes `model.fit` work, and work correctly, under MWMS.

    Call once before `fit` (idempotent). See the module docstring for what
    changes; nothing changes for a single worker.

    Raises:
        RuntimeError: Keras is not a version the workarounds were verified
            against.
    """
    _compat.fix_keras_multi_worker_bugs()
    _compat.wrap_keras_fit(_multi_worker_fit)
    # A strategy built after a dataset fails in TensorFlow's words: said in
    # one line instead (the docs' script once did so on 2 workers).
    try:
        info = environment.resolve_cluster()
    except environment.ClusterError:
        return
    if info.num_workers > 1:
        say_startup_order(f"worker {info.worker_index}")
        # The strategy the script builds next finds the coordination
        # service set up, with tfscale's heartbeat timeout, not
        # TensorFlow's 10 s (`strategies.start_coordination`).
        if not _compat.runtime_started():
            _compat.configure_coordination(
                info.cluster, ClusterConfig().heartbeat_timeout_seconds)


def _on_terminal() -> bool:
    """Whether this process's stdout is a terminal (a progress bar shows
    as one)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def _multi_worker_fit(fit, model, *args, **kwargs):
    """Runs Keras's `fit` with the additions above (on one worker: the
    atomic backups, the placement line, preemption)."""
    strategy = model.distribute_strategy
    arguments = inspect.signature(fit).bind(model, *args, **kwargs).arguments
    arguments.pop("self", None)
    callbacks = list(arguments.get("callbacks") or [])
    # Any replica count: a backup killed mid-write never breaks a restart.
    callback_files.make_backups_atomic(callbacks)
    # Any strategy: a worker that sees a GPU trains on it, or stops here in
    # one line (a strategy built on a resolver without num_accelerators
    # would train on the CPU: `placement.py`).
    where = placement.check(strategy, model.trainable_variables,
                            worker=f"worker {worker_index(strategy)}")
    # Every worker says where it trains, once (quiet: verbose=0).
    if (arguments.get("verbose", "auto") != 0
            and not getattr(model, "_tfscale_placement_said", False)):
        print(f"tfscale: {where.describe()}", flush=True)
        print("tfscale: " + all_reduce_impl.numerics_words(
            strategy, keras.mixed_precision.global_policy().name,
            getattr(model, "jit_compile", False)), flush=True)
        model._tfscale_placement_said = True
    if arguments.get("verbose", "auto") == "auto" and not _on_terminal():
        # A progress bar's carriage returns and escape codes, piped to a
        # launcher or a log file, read as one run-on line: an epoch a line.
        arguments["verbose"] = 2
    is_chief, num_workers = True, 1
    if strategy.num_replicas_in_sync > 1:
        # Several replicas, on one worker or many: the gradient math.
        _check_supported(model)
        reduce_before_apply(model.optimizer)
        is_chief, num_workers = chief_and_worker_count(strategy)
    worker_dir = None
    if num_workers > 1:
        # Several workers: failures, files, output. An uncaught error on
        # this worker ends the job at once (fail_fast.py).
        fail_fast.install(f"worker {worker_index(strategy)}")
        if not is_chief:
            worker_dir = tempfile.mkdtemp(prefix="tfscale-worker-")
            callback_files.route_writes(callbacks, worker_dir)
            _route_backup_after_restore(callbacks, worker_dir)
            arguments["verbose"] = 0

    def tidy():
        for callback in callbacks:
            callback.__dict__.pop("on_train_begin", None)
        if worker_dir:
            shutil.rmtree(worker_dir, ignore_errors=True)

    def before_exit():  # a preemption leaves from inside the fit
        callback_files.close_writers(callbacks)
        tidy()

    # Stopping together, preemption, a mid-epoch resume (fit_preemption.py).
    agreement = fit_preemption.FitAgreement(
        strategy if num_workers > 1 else None, callbacks, before_exit)
    arguments["callbacks"] = [agreement.opener()] + callbacks + [agreement]
    try:
        with fit_preemption.signal_watch() as watch:
            agreement.watch = watch
            return fit(model, **arguments)
    finally:
        tidy()


def _check_supported(model) -> None:
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    for opt in (optimizer, inner):
        steps = getattr(opt, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                f"gradient_accumulation_steps={steps} is not supported by "
                "model.fit under MultiWorkerMirroredStrategy (Keras puts the "
                "all-reduce inside its accumulate-or-apply cond); use "
                "tfscale.Trainer with TrainConfig(num_accumulation_steps="
                f"{steps})")


def _route_backup_after_restore(callbacks, worker_dir: str) -> None:
    """On a non-chief worker, BackupAndRestore reads the chief's backup in
    `on_train_begin`, then writes into `worker_dir`."""
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            restore = callback.on_train_begin

            def on_train_begin(logs=None, callback=callback, restore=restore):
                restore(logs)
                callback_files.route_backup_writes([callback], worker_dir)
            callback.on_train_begin = on_train_begin


def reduce_before_apply(optimizer) -> None:
    """Makes `optimizer.apply` all-reduce the gradients first, when what it
    does before its own all-reduce (clipping, a loss-scale finite check)
    would otherwise see one replica's partial gradients. Idempotent."""
    if getattr(optimizer, "_tfscale_reduces_first", False):
        return
    clips = any(getattr(optimizer, name, None) for name in
                ("clipnorm", "global_clipnorm", "clipvalue"))
    wrapped = hasattr(optimizer, "inner_optimizer")
    if not (clips or wrapped):
        return
    _compat.disable_gradient_aggregation(optimizer)
    apply = optimizer.apply

    def apply_reduced(grads, trainable_variables=None):
        context = tf.distribute.get_replica_context()
        if context is not None:
            present = [i for i, g in enumerate(grads) if g is not None]
            reduced = context.all_reduce(
                tf.distribute.ReduceOp.SUM,
                [tf.convert_to_tensor(grads[i]) for i in present])
            grads = list(grads)
            for i, g in zip(present, reduced):
                grads[i] = g
        return apply(grads, trainable_variables)

    optimizer.apply = apply_reduced
    optimizer._tfscale_reduces_first = True
