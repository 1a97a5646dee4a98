"""Where the record writers' tasks run: here, on a local Dask cluster, or on
a Dask scheduler that is already running (SLURM, Kubernetes, a workstation).

    results = engine.run(tasks, fn, config=EngineConfig(
        scheduler_file="sched.json"), work=..., work_per_process=...,
        describe=...)

One task writes one output shard (`shard_writer.write_shard`: under a
temporary name of its own, renamed into place when complete, indexed last),
so a task run twice, after its worker died or as two attempts at once,
leaves the same bytes. Dask reschedules the tasks of a worker that dies
(at most `distributed.scheduler.allowed-failures` times per task); an error
raised by a task (a bad input file or image) is not retried: it ends the
job naming the input and the worker. The job's other tasks are then told to
stop (a `distributed.Event` they check at most once a second, when they
report progress) and the job waits for them, so when `run` raises no
attempt is still writing and the caller can remove every temporary file.
A task that kills its worker again and again (memory) ends the job with one
line naming the task, its input and the workers' memory limit.

Without a scheduler, `processes` writer processes (the tools' rule: one per
core, but none that would not pay back its TensorFlow import) run on a
`LocalCluster`; one process runs the tasks here, with no Dask at all.
Remote workers need this repository on their PYTHONPATH (they import the
writers' module) and the output folder on a shared file system.
"""

import dataclasses
import os
import sys
import time
import uuid
from typing import Callable, List, Optional, Sequence

from input_pipelines.extras import require


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Where tasks run.

    Attributes:
        scheduler: A running Dask scheduler, "tcp://HOST:PORT".
        scheduler_file: Or the scheduler's `--scheduler-file`.
        processes: Without a scheduler: writer processes (0: the tool's
            rule; 1: this process, no Dask).
        worker_memory: Without a scheduler: each local process's memory
            limit, in Dask's words ("2GB", "auto": the machine's memory
            shared out); past 95% of it the process is restarted.
    """

    scheduler: Optional[str] = None
    scheduler_file: Optional[str] = None
    processes: int = 0
    worker_memory: str = "auto"

    def __post_init__(self):
        if self.scheduler and self.scheduler_file:
            raise ValueError("--scheduler and --scheduler_file: give one, "
                             "not both")
        if self.processes < 0:
            raise ValueError(f"--num_processes must be >= 0, got "
                             f"{self.processes}")
        if self.worker_memory != "auto":
            from dask.utils import parse_bytes
            try:
                parse_bytes(self.worker_memory)
            except (ValueError, TypeError):
                raise ValueError(
                    f"--worker_memory={self.worker_memory}: not a size "
                    "(e.g. 2GB, 512MiB) or auto") from None

    @property
    def remote(self) -> bool:
        return bool(self.scheduler or self.scheduler_file)


def processes_for(requested: int, tasks: int, work: int,
                  work_per_process: int) -> int:
    """Writer processes: `requested`, or for 0 one per core but no more
    than one per `work_per_process` units of work (each process imports
    TensorFlow, a few seconds); never more than tasks."""
    if requested:
        return max(1, min(requested, tasks))
    wanted = os.cpu_count() or 1
    return max(1, min(wanted, tasks, -(-work // work_per_process)))


def define_flags(flags) -> None:
    """A writer's flags for where its tasks run (with its own
    --num_processes)."""
    flags.DEFINE_string(
        "scheduler", None, "A running Dask scheduler, tcp://HOST:PORT: its "
        "workers run the tasks (they need this repository on their "
        "PYTHONPATH and the folders on a shared file system). Default: "
        "--num_processes local processes.")
    flags.DEFINE_string(
        "scheduler_file", None, "Or the scheduler's --scheduler-file "
        "(SLURM: launch/slurm_prepare.sbatch).")
    flags.DEFINE_string(
        "worker_memory", "auto", "Without --scheduler: each local writer "
        "process's memory limit (2GB, 512MiB; auto: the machine's memory "
        "shared out). A process past 95% of it is restarted.")


def config_from_flags(flags_values, processes: int) -> EngineConfig:
    """The engine's config from a writer's parsed flags."""
    return EngineConfig(flags_values.scheduler, flags_values.scheduler_file,
                        processes, flags_values.worker_memory)


class TaskError(RuntimeError):
    """A task failed; the message names its shard, the input and the
    worker."""


class TaskStopped(Exception):
    """Raised inside a task when another task of its job failed: the task
    stops (removing its temporary files on the way out)."""


# How often a running task asks whether its job has stopped, and how long a
# failing job waits for its running tasks to stop.
STOP_CHECK_SECONDS = 1.0
STOP_WAIT_SECONDS = 120
# How often the client looks at the scheduler while it waits, and how long
# it lets the scheduler go without a worker before it gives up.
WATCH_SECONDS = 5.0
NO_WORKERS_SECONDS = 60.0


def still_running(error: BaseException) -> bool:
    """Whether `run` raised `error` with tasks still writing (then their
    temporary files must be left alone)."""
    return bool(getattr(error, "still_running", False))


def run(tasks: Sequence, fn: Callable, *, config: EngineConfig,
        work: Sequence[int], work_per_process: int, describe: Callable,
        unit: str = "record", initial: int = 0,
        show_progress: bool = False) -> List:
    """`[fn(task, progress) for task in tasks]` where `config` says (one
    `Session` for these tasks).

    Args:
        tasks: Picklable tasks.
        fn: A module-level `fn(task, progress) -> result`; `progress(n)`
            counts units done (in this process; on Dask the bar counts a
            task's units when it finishes).
        config: Where to run them.
        work: Units of work per task (records, images, documents): the
            progress bar's and the process rule's measure.
        work_per_process: Units a writer process must have to pay back its
            start (the local rule).
        describe: `describe(task) -> str` naming a task in errors.
        unit: The progress bar's unit.
        initial: Units done before (shards an earlier run kept).
        show_progress: A progress bar on stderr (one for the job: units
            done, rate, ETA).

    Raises:
        The task's own error (its type kept) with the worker named, or
        `TaskError` when its type cannot carry the message.
    """
    processes = processes_for(config.processes, len(tasks), sum(work),
                              work_per_process)
    with Session(config, processes) as session:
        return session.run(tasks, fn, work=work, describe=describe,
                           unit=unit, initial=initial,
                           show_progress=show_progress)


class Session:
    """Where several stages of tasks run: one local cluster (or client of
    a remote scheduler) for all of them, so its processes start once.

    Args:
        config: Where tasks run.
        processes: Local processes (without a scheduler; 1: here, no Dask).
    """

    def __init__(self, config: EngineConfig, processes: int):
        self._config = config
        self._processes = processes
        self._context = None
        self._client = None

    def __enter__(self) -> "Session":
        if self._config.remote or self._processes > 1:
            self._context = _client(self._config, self._processes)
            self._client = self._context.__enter__()
        return self

    def __exit__(self, *exc):
        if self._context is not None:
            self._context.__exit__(*exc)

    def run(self, tasks: Sequence, fn: Callable, *, work: Sequence[int],
            describe: Callable, unit: str = "record", initial: int = 0,
            show_progress: bool = False) -> List:
        """As `run` (module level), on this `Session`'s processes."""
        tqdm = require("tqdm", "prepare")  # here: --help needs no extra
        with tqdm.tqdm(total=initial + sum(work), initial=initial,
                       unit=unit, desc=unit + "s",
                       disable=None if show_progress else True,
                       smoothing=0.1, file=sys.stderr,
                       dynamic_ncols=True) as bar:
            if not tasks:
                return []
            if self._client is None:
                return [fn(task, bar.update) for task in tasks]
            return _run_on_dask(self._client, tasks, fn, work, describe, bar,
                                self._memory_setting())

    def _memory_setting(self) -> str:
        """The workers' memory limit, for an error that blames memory."""
        if not self._config.remote:
            return f"--worker_memory={self._config.worker_memory}"
        import dask.utils
        limits = sorted({w.get("memory_limit") or 0 for w in
                         self._client.scheduler_info()["workers"].values()})
        shown = ", ".join(dask.utils.format_bytes(x) if x else "none"
                          for x in limits) or "unknown"
        return (f"the workers' memory limit {shown} (dask worker "
                "--memory-limit)")


def _run_on_dask(client, tasks, fn, work, describe, bar, memory) -> List:
    import distributed
    from distributed.scheduler import KilledWorker
    # The scheduler treats equal keys as one task: a key of another job
    # (another client, the same shard names in another folder) would hand
    # back that job's result and never run this one's function. Each call
    # draws its own prefix; the shard's name keeps the key readable.
    job = uuid.uuid4().hex[:12]
    stop = distributed.Event(f"tfscale-{job}-stop", client=client)
    futures = [client.submit(_call, fn, task, describe(task), stop.name,
                             key=f"tfscale-{job}-{i}-{describe(task)}",
                             pure=False)
               for i, task in enumerate(tasks)]
    units = {f.key: w for f, w in zip(futures, work)}
    names = {f.key: describe(t) for f, t in zip(futures, tasks)}
    try:
        _wait_all(client, futures, units, bar, memory)
        return [f.result() for f in futures]
    except KilledWorker as e:
        error = TaskError(
            f"task {names.get(e.task, e.task)}: the {e.allowed_failures + 1} "
            "workers that ran it died (out of memory, or killed): "
            f"{memory}; give the workers more memory or write smaller "
            "pieces")
        _stop_all(client, stop, futures, names, error)
        raise error from None
    except BaseException as e:
        _stop_all(client, stop, futures, names, e)
        raise


def _wait_all(client, futures, units, bar, memory) -> None:
    """Waits for every future, raising the first task error; a scheduler
    left with no worker for NO_WORKERS_SECONDS (all died: with no nanny
    nothing restarts them) ends the wait with one line, not at the job's
    time limit."""
    import distributed
    pending, alone_since = set(futures), None
    while pending:
        try:
            done, pending = distributed.wait(
                pending, timeout=WATCH_SECONDS, return_when="FIRST_COMPLETED")
        except distributed.TimeoutError:
            done = set()
        for future in done:
            if future.status == "error":
                future.result()  # raises the task's error here
            bar.update(units[future.key])
        if not pending:
            return
        if client.scheduler_info().get("workers"):
            alone_since = None
            continue
        alone_since = alone_since or time.monotonic()
        if time.monotonic() - alone_since >= NO_WORKERS_SECONDS:
            raise TaskError(
                f"the Dask scheduler has had no worker for "
                f"{NO_WORKERS_SECONDS:.0f} s with {len(pending)} task(s) to "
                f"run: its workers died (out of memory? {memory}) or never "
                "came; see the workers' log")


def _stop_all(client, stop, futures, names, error: BaseException) -> None:
    """Tells the job's running tasks to stop and waits until none runs.
    Tasks still running after STOP_WAIT_SECONDS are named on stderr and
    `error` gets `still_running` (`still_running(error)`): their temporary
    files are theirs still, so the caller leaves them for the next run."""
    import distributed
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    try:
        stop.set()
        while time.monotonic() < deadline:
            try:
                distributed.wait(futures, timeout=WATCH_SECONDS)
                break
            except distributed.TimeoutError:
                if not client.scheduler_info().get("workers"):
                    break  # nothing runs them
    except Exception:  # noqa: BLE001 - the first error is the one to report
        pass
    running = [f for f in futures if f.status == "pending"]
    if running:
        try:
            busy = {key for keys in client.processing().values()
                    for key in keys}
            running = [f for f in running if f.key in busy]
        except Exception:  # noqa: BLE001 - unknown: assume they run
            pass
    client.cancel(futures)
    if running:
        print(f"{len(running)} task(s) did not stop within "
              f"{STOP_WAIT_SECONDS} s of the job's failure "
              f"({names.get(running[0].key, running[0].key)}, ...): their "
              "temporary files are left for the next run to remove",
              file=sys.stderr)
        try:
            error.still_running = True
        except AttributeError:
            pass


def _client(config: EngineConfig, processes: int):
    import distributed
    if config.scheduler_file:
        return distributed.Client(scheduler_file=config.scheduler_file,
                                  timeout="60s")
    if config.scheduler:
        return distributed.Client(config.scheduler, timeout="60s")
    cluster = distributed.LocalCluster(
        n_workers=processes, threads_per_worker=1, processes=True,
        dashboard_address=None, host="127.0.0.1",
        memory_limit=config.worker_memory)
    return _ClusterClient(cluster)


class _ClusterClient:
    """A client that also closes its LocalCluster."""

    def __init__(self, cluster):
        import distributed
        self._cluster = cluster
        self._client = distributed.Client(cluster)

    def __enter__(self):
        return self._client

    def __exit__(self, *exc):
        self._client.close()
        self._cluster.close()


class _StopCheck:
    """A task's `progress` on a Dask worker: asks, at most once every
    STOP_CHECK_SECONDS, whether the job has stopped, and then raises
    `TaskStopped` in the task."""

    def __init__(self, event_name: str):
        import distributed
        self._event = distributed.Event(event_name)
        self._last = time.monotonic()
        self.check()

    def check(self) -> None:
        if self._event.is_set():
            raise TaskStopped("another task of this job failed")

    def __call__(self, units: int) -> None:
        del units  # the client's bar counts a task when it finishes
        now = time.monotonic()
        if now - self._last >= STOP_CHECK_SECONDS:
            self._last = now
            self.check()


def _call(fn, task, name, stop_event):
    """Runs on a worker: the task's errors name the shard and the worker."""
    try:
        return fn(task, _StopCheck(stop_event))
    except TaskStopped:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with context
        try:
            import distributed
            worker = distributed.get_worker().address
        except (ImportError, ValueError):
            worker = "this process"
        message = f"{e} (task {name}, on dask worker {worker})"
        try:
            error = type(e)(message)
        except Exception:  # noqa: BLE001 - a type with other arguments
            error = TaskError(f"{type(e).__name__}: {message}")
        raise error from None
