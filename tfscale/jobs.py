"""One skeleton for every training job, whatever it trains.

    flags -> config -> cluster -> data -> model -> Trainer -> results -> leave

    class MyTask(jobs.Task):            # what is trained: model, data, loss
        title = "my_job"
        def build(self): return jobs.Built(model, loss_fn, metrics)
        def dataset_fn(self, per_replica_batch, training): ...
    results = jobs.run(MyTask(jobs.JobConfig(optim=..., cluster=...,
                                             train=..., output_dir=...)))

`run` does the rest on each worker: it joins the cluster (TF_CONFIG, SLURM
or MPI) before TensorFlow's first op, builds the model and optimizer under
the strategy, trains with the Trainer (resuming from the latest checkpoint),
evaluates, and writes `summary.json` (what it prints: `job_lines.py`).
The BERT job (`models/tasks/pretraining.py`), the image job
(`models/tasks/image_classification.py`) and the time-to-accuracy study
(`benchmarks/time_to_accuracy/study.py`) are `Task`s. An entry point turns its
flags into the config through `tfscale.cli.entry_point`, whose
`run_job` turns a `JobError` into one line and a non-zero exit.
"""

import contextlib
import dataclasses
import json
import os
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tfscale.resume import checkpoints as checkpointing
from tfscale.cluster import environment as cluster_lib
from tfscale.cluster import strategies
from tfscale.cluster import collectives
from tfscale.cluster import devices, placement
from tfscale import job_lines
from tfscale import xla_flags
from tfscale import precision as precision_lib
from tfscale.cluster.environment import ClusterConfig
from tfscale.errors import FLAG_OF_FIELD, ConfigError
from tfscale.optim import OptimConfig, make_optimizer
from tfscale.trainer.timing import IntervalHistory
from tfscale.train_config import TrainConfig
from tfscale.trainer.loop import Trainer
from tfscale.cluster.signal_watch import SignalWatch


class JobError(Exception):
    """A problem the user can fix, in one line.

    Attributes:
        setting: The config field (and flag) at fault, or None.
        restartable: Whether another attempt may succeed (a peer or a
            service not up yet, a port still held); False: the entry point
            exits `CONFIG_ERROR_EXIT_CODE` and launchers do not restart.
    """

    def __init__(self, setting: Optional[str], message: str, *,
                 restartable: bool = False):
        self.setting = setting
        self.message = message
        self.restartable = restartable
        super().__init__(f"--{setting}: {message}" if setting else message)

    def line(self, flag_names=None) -> str:
        """The error with its setting spelled as the command line spelled
        it (`flag_names`: {setting: the alias it used})."""
        if not self.setting:
            return self.message
        name = (flag_names or {}).get(self.setting, self.setting)
        return f"--{name}: {self.message}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
    """What every job needs besides its model and data (subclasses add
    those: `PretrainingConfig`, `ImageClassificationConfig`).

    Attributes:
        optim: Optimizer and schedule; `total_steps` is the run's length.
        cluster: Collective settings and timeouts.
        train: The Trainer's settings; `checkpoint_dir` must be set.
        output_dir: Checkpoints, TensorBoard, summary.json (and what the
            task writes).
        do_train: Train (else only evaluate the latest checkpoint).
        eval_batch_size: Global evaluation batch.
        max_eval_steps: Evaluation batches at most (None: all).
        profile_steps: (first, last) steps to profile into TensorBoard.
        seed: Seed of weights, dropout, shuffling and augmentation.
        deterministic: Deterministic ops and input order.
        notes: Lines the entry point adds to the start banner (how it read
            its command line).
        flag_names: {setting: the flag the command line named it by}, where
            it used an alias (NVIDIA's `--input_files` for `--input_file`):
            errors name the flag the user typed.

    Raises:
        ValueError: "<field> ..." (entry points turn the field into its
            flag).
    """

    optim: OptimConfig
    cluster: ClusterConfig
    train: TrainConfig
    output_dir: str
    do_train: bool = True
    eval_batch_size: int = 32
    max_eval_steps: Optional[int] = None
    profile_steps: Optional[Tuple[int, int]] = None
    seed: int = 12345
    deterministic: bool = False
    notes: Tuple[str, ...] = ()
    flag_names: Dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def evaluates(self) -> bool:
        """Whether the job evaluates at its end (subclasses with evaluation
        data say so)."""
        return False

    def __post_init__(self):
        if not self.output_dir:
            raise ValueError("output_dir is required")
        if not self.train.checkpoint_dir:
            raise ValueError("train.checkpoint_dir is required")
        if not (self.do_train or self.evaluates):
            raise ValueError("do_train and do_eval are both False: nothing "
                             "to do")
        if self.optim.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got "
                             f"{self.optim.total_steps}")
        if self.eval_batch_size < 1:
            raise ValueError("eval_batch_size must be >= 1")
        if self.max_eval_steps is not None and self.max_eval_steps < 1:
            raise ValueError("max_eval_steps must be >= 1")
        if self.profile_steps and not (
                1 <= self.profile_steps[0] <= self.profile_steps[1]):
            raise ValueError(f"profile_steps must be 'first,last' with "
                             f"1 <= first <= last, got {self.profile_steps}")


class Built(NamedTuple):
    """What `Task.build` returns (under the strategy's scope).

    Attributes:
        model: The Keras model.
        loss_fn: `fn(labels, outputs) -> per-example loss`.
        metrics: Keras metrics on (labels, outputs).
        optimizer: None: made from the config's `optim` (the usual case);
            else the task's own (`optim` then gives only the run's length,
            `total_steps`).
    """

    model: keras.Model
    loss_fn: Callable
    metrics: Sequence = ()
    optimizer: Optional[keras.optimizers.Optimizer] = None


class Task:
    """What a job trains; `run` calls these in order. Override `build` and
    `dataset_fn`, and whichever others the job needs.

    Attributes:
        config: The job's `JobConfig` (a subclass carries the task's own
            settings).
        title: The program's name in the summary lines.
        unit: What `examples_per_second` counts ("images").
        eval_weights: What evaluating only (do_train False) restores from,
            for its error line.
    """

    title = "tfscale job"
    unit = "examples"
    eval_weights = "a checkpoint in --output_dir"

    def __init__(self, config: JobConfig):
        self.config = config

    def check_files(self) -> None:
        """Before the cluster starts (no TensorFlow op yet): the inputs
        exist. Raises `JobError`."""

    def check_inputs(self) -> None:
        """After the cluster starts, before the model: the first record
        fits. Raises `JobError`."""

    def build(self) -> Built:
        """The model, loss and metrics (called under the strategy's
        scope)."""
        raise NotImplementedError

    def dataset_fn(self, per_replica_batch: int, training: bool):
        """`fn(tf.distribute.InputContext) -> tf.data.Dataset` of
        (features, labels) batches of `per_replica_batch`: the training
        data (endless) or the evaluation data."""
        raise NotImplementedError

    def reading(self, training: bool):
        """A context around reading the data that turns the pipeline's
        errors into a `JobError` naming the input."""
        return contextlib.nullcontext()

    def initial_weights(self, model) -> Optional[str]:
        """Loads weights other than the latest checkpoint (BERT's
        --init_checkpoint) and returns where from, or None."""
        return None

    def callbacks(self, trainer: Trainer) -> List[keras.callbacks.Callback]:
        """Keras callbacks of this job, beside the interval log,
        TerminateOnNaN and TensorBoard."""
        return []

    def describe(self, model) -> List[str]:
        """Summary lines about the model and the data."""
        return [f"model {model.name}: {millions_of_parameters(model):.2f}M "
                "parameters"]

    def finish(self, results: dict, model) -> None:
        """On the chief, after training and evaluation: files of the task
        (an export, Google's eval_results.txt); may add to `results`."""


def _xla_decided(config: JobConfig) -> Tuple[JobConfig, str]:
    """(`config` with --xla's auto decided for this worker's devices, why:
    for the start banner)."""
    on_gpus = bool(devices.visible_gpus())
    jit, why = xla_flags.choose(config.train.jit_compile, on_gpus)
    return dataclasses.replace(
        config, train=dataclasses.replace(config.train,
                                          jit_compile=jit)), why


def millions_of_parameters(model) -> float:
    return sum(int(v.numpy().size) for v in model.trainable_variables) / 1e6


def run(task: Task) -> dict:
    """Runs `task`'s whole job on this worker (every worker calls it).

    Returns:
        The results also written to `summary.json`: steps, wall time, log
        intervals, checkpoint, noise scale, evaluation metrics.

    Raises:
        JobError: Bad inputs, files, checkpoint or cluster setup, in one
            line naming the setting.
        Preempted: SIGTERM (or SIGUSR1) in any phase: the agreed step is
            on disk (exit code 143).
    """
    task.check_files()
    task.config, xla_why = _xla_decided(task.config)
    config = task.config
    # Before XLA's first compilation in this process (it reads XLA_FLAGS
    # once, then).
    xla = (xla_flags.apply(config.train.xla_gemm, config.output_dir)
           if config.train.jit_compile else None)
    info, strategy = start_worker(
        config.cluster, output_dir=config.output_dir,
        precision=config.train.precision, seed=config.seed,
        deterministic=config.deterministic)
    task.check_inputs()
    with strategy.scope():
        built = task.build()
        optimizer = built.optimizer or make_optimizer(
            config.optim, config.train.global_batch_size,
            built.model.trainable_variables)
    trainer = make_trainer(
        model=built.model, optimizer=optimizer, loss_fn=built.loss_fn,
        strategy=strategy, metrics=list(built.metrics),
        cluster=config.cluster, train=config.train)
    # Compared on a resume (`resume/position.py`): a resumed run with
    # another rate or schedule length says so.
    if built.optimizer is None:
        trainer.position.settings["learning rate"] = config.optim.learning_rate
    trainer.position.settings["schedule steps"] = config.optim.total_steps
    speaks = info.is_chief and config.train.verbose > 0
    if speaks:
        print(job_lines.before(task, info, trainer, built, xla, xla_why),
              flush=True)
    elif config.train.verbose > 0:  # every worker says where it trains
        print(f"  {trainer.placement.describe()}", flush=True)

    # A signal in any phase (training, evaluation, before the exports) is
    # acted on at the next point every worker agrees on (`preemption.py`).
    with SignalWatch() as watch:
        results = _train_and_evaluate(task, trainer, info, built.model,
                                      speaks)
        # The run's end is on disk: a signal by now leaves the exports to
        # the restart, which trains nothing more.
        trainer.leave_if_preempted(watch)
        if info.is_chief:
            task.finish(results, built.model)
            write_atomically(os.path.join(config.output_dir, "summary.json"),
                             json.dumps(results, indent=2))
            if speaks:
                print(job_lines.after(task.title, results, task.unit,
                                      config.output_dir), flush=True)
        # Exit together, once the chief's files are written.
        trainer.leave_together()
    return results


def _train_and_evaluate(task: Task, trainer: Trainer, info, model,
                        speaks: bool) -> dict:
    """The job's training (from its initial weights or latest checkpoint)
    and evaluation: the results summary.json holds."""
    config = task.config
    start = time.perf_counter()
    initial = _initial_weights(task, trainer, model)
    if initial and speaks:
        print(f"tfscale: model weights from {initial}", flush=True)
    intervals = IntervalHistory()
    if config.do_train:
        with task.reading(training=True):
            intervals = fit(
                trainer, task.dataset_fn(trainer.per_replica_batch_size, True),
                config.optim.total_steps, config.output_dir,
                config.profile_steps, task.callbacks(trainer))
    results = run_results(trainer, info, config.cluster.backend,
                          time.perf_counter() - start, intervals)
    results["checkpoint"] = trainer.checkpoint_path or initial
    if config.evaluates:
        replicas = trainer.collectives.num_replicas
        with task.reading(training=False):
            results["eval"] = trainer.evaluate(
                task.dataset_fn(max(1, config.eval_batch_size // replicas),
                                False), steps=config.max_eval_steps)
    return results


def write_atomically(path: str, text: str) -> None:
    """`path` holds `text` whole, or what it held before: a kill never
    leaves half a file (written beside it, then renamed over it)."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)


def _initial_weights(task: Task, trainer: Trainer, model) -> Optional[str]:
    """The task's initial weights; evaluating only, else the latest
    checkpoint, whose step becomes the trainer's."""
    initial = task.initial_weights(model)
    if task.config.do_train:
        return initial
    if initial is None:
        try:
            initial = checkpointing.restore_model(
                model, task.config.train.checkpoint_dir)
        except checkpointing.RestoreError as e:
            raise JobError("do_train", f"evaluating only needs "
                           f"{task.eval_weights}: {e}") from None
    trainer.step.assign(checkpointing.checkpoint_step(initial))
    return initial


@contextlib.contextmanager
def blame(setting: str, *errors, restartable: bool = False):
    """Turns `errors` raised inside the block into a `JobError` naming
    `setting` (their message is already the one line the user reads)."""
    try:
        yield
    except errors as e:
        raise JobError(setting, str(e), restartable=restartable) from None


def start_worker(cluster: ClusterConfig, *, output_dir: str, precision: str,
                 seed: int, deterministic: bool) -> Tuple[object, object]:
    """This worker's place in the cluster and its strategy, with seeds,
    determinism and the dtype policy set (before the first TF op).

    Raises:
        JobError: The cluster setup is wrong (named by `ClusterError`;
            restartable when it says so), the strategy's replicas are not on the GPUs
            the worker sees (`placement.PlacementError`; not restartable), or
            NCCL cannot run on them (`ConfigError`; not restartable).
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
        # A port still held may be free at the next attempt; a malformed
        # cluster (TF_CONFIG, MPI ranks without --backend=mpi) is not.
        raise JobError(None, str(e), restartable=e.restartable) from None
    except placement.PlacementError as e:  # another attempt would repeat it
        raise JobError(None, str(e)) from None
    except ConfigError as e:  # --all_reduce_alg=nccl on a shared GPU
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
        # (Every worker's placement line is the job's: in the banner.)
        return Trainer(model=model, optimizer=optimizer, loss_fn=loss_fn,
                       strategy=strategy, metrics=metrics, backend=backend,
                       config=dataclasses.replace(train, say_placement=False))
    except ConfigError as e:
        raise JobError(FLAG_OF_FIELD.get(e.field, e.field), str(e)) from None
    except ValueError as e:  # no field to name
        raise JobError(None, str(e)) from None


class ProfileSteps(keras.callbacks.Callback):
    """TensorFlow's profiler over the calls of the compiled step that run
    steps `first`..`last` (a call of several steps is profiled whole),
    written where TensorBoard's profile plugin reads it."""

    def __init__(self, trainer: Trainer, first: int, last: int, logdir: str):
        super().__init__()
        self._trainer, self._first, self._last = trainer, first, last
        self._logdir, self._on = logdir, False

    def on_train_batch_begin(self, batch, logs=None):
        step = int(self._trainer.step.numpy()) + 1  # the call's first step
        most = self._trainer.config.steps_per_execution  # its last, at most
        if not self._on and step <= self._last and (
                step + most - 1 >= self._first):
            tf.profiler.experimental.start(self._logdir)
            self._on = True

    def on_train_batch_end(self, batch, logs=None):
        if self._on and int(self._trainer.step.numpy()) >= self._last:
            tf.profiler.experimental.stop()
            self._on = False

    def on_train_end(self, logs=None):
        if self._on:
            tf.profiler.experimental.stop()
            self._on = False


def fit(trainer: Trainer, dataset_fn, steps: int, output_dir: str,
        profile_steps: Optional[Tuple[int, int]] = None,
        callbacks: Sequence[keras.callbacks.Callback] = ()) -> IntervalHistory:
    """Trains to `steps` (resuming from the latest checkpoint) with the
    interval log, TerminateOnNaN and TensorBoard in `output_dir`, then
    `callbacks`.

    Raises:
        JobError: The checkpoint in output_dir does not fit (--output_dir).
        InputPipelineError: The records failed (callers name the record).
    """
    intervals = IntervalHistory()
    board = os.path.join(output_dir, "tensorboard")
    callbacks = [intervals, keras.callbacks.TerminateOnNaN(),
                 keras.callbacks.TensorBoard(
                     board, update_freq=trainer.config.log_steps),
                 *([ProfileSteps(trainer, *profile_steps,
                                 os.path.join(board, "train"))]
                   if profile_steps else []), *callbacks]
    try:
        trainer.fit(dataset_fn, steps_per_epoch=steps, epochs=1,
                    callbacks=callbacks)
    except checkpointing.RestoreError as e:
        raise JobError("output_dir", str(e)) from None
    return intervals


def device_kind(strategy) -> dict:
    """{"kind": "gpu" or "cpu", "name": the device's} of this worker's
    replicas (tfscale-plan warns when a CPU run is projected onto GPUs)."""
    first = devices.worker_devices(strategy)[0]
    if "GPU" not in first.upper():
        import platform
        return {"kind": "cpu", "name": platform.machine()}
    gpus = tf.config.list_physical_devices("GPU")
    details = tf.config.experimental.get_device_details(gpus[0]) if gpus \
        else {}
    return {"kind": "gpu", "name": details.get("device_name", "GPU")}


def run_results(trainer: Trainer, info, backend: str, wall_seconds: float,
                intervals: IntervalHistory) -> dict:
    """What summary.json holds about the training part of a run."""
    return {"steps": int(trainer.step.numpy()),
            "device": device_kind(trainer.strategy),
            # Timings from a loaded host carry its other work (tfscale-plan
            # says so).
            "host": {"load_average": os.getloadavg()[0],
                     "cores": os.cpu_count()},
            "gradient_tensors": len(trainer.model.trainable_variables),
            "global_batch_size": trainer.config.global_batch_size,
            "num_accumulation_steps": trainer.config.num_accumulation_steps,
            "num_workers": info.num_workers,
            "replicas": trainer.collectives.num_replicas,
            "backend": backend,
            "wall_seconds": wall_seconds,
            "examples_per_second": 0.0,
            **intervals.examples_per_second(),
            "intervals": intervals.rows,
            "noise_scale": (trainer.noise_scale.summary()
                            if trainer.noise_scale else None),
            "adascale": trainer.adascale_summary(),
            **trainer.memory_summary()}
