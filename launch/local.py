"""Start N workers on this host, like `horovodrun -np N` for tf.distribute.

    python -m launch.local --num_workers 2 [--port 20000] [--max_restarts 1] \
        -- python run_pretraining.py --input_file=... --output_dir=...
    python -m launch.local --backend mpi --num_workers 2 \
        -- python run_pretraining.py --backend=mpi ...

With `--backend mpi` the workers are the ranks of one `mpirun` (Open MPI's
or MPICH's, found next to this Python or on PATH, or `--mpirun`), which
connects them; the same guarantees hold: prefixed output, signals passed on
to every rank (which then save a preemption checkpoint), a dead rank ends the
attempt with its rank named, restarts from the last checkpoint.

Each worker gets a TF_CONFIG naming every worker on 127.0.0.1 (free ports are
found, not assumed) and its share of the cores as TensorFlow thread counts,
since one process per device is the rule and N processes with all-core
thread pools would oversubscribe the host. Output lines are prefixed with the
worker index. When a worker fails, the others are stopped at once (not after
a collective timeout) and, if restarts remain, all are started again: the
Trainer resumes from the latest checkpoint. Ctrl-C stops every worker.

This module never imports TensorFlow: it only builds commands and
environments (`worker_specs` is a pure function) and runs processes
(`workers.ProcessGroup`, or `mpi_ranks.MpiGroup` for `--backend mpi`).
"""

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from typing import List, Mapping, Optional, Sequence

from launch import children, gpus, hangs, mpi_ranks, outcome, ports, workers
from launch.elastic import slot_indexes
from tfscale.cluster.contract import (CONFIG_ERROR_EXIT_CODE,
                                      HEARTBEAT_DIR_ENV, HUNG_EXIT_CODE,
                                      PREEMPTED_EXIT_CODE,
                                      PREEMPTED_UNSAVED_EXIT_CODE,
                                      GPUS_BOUND_ENV, SHARED_GPUS_ENV,
                                      seconds_problem)


def worker_specs(command: Sequence[str], num_workers: int,
                 ports: Sequence[int], base_env: Mapping[str, str],
                 host: str = "127.0.0.1",
                 threads_per_worker: Optional[int] = None,
                 gpu_sets: Optional[Sequence[str]] = None
                 ) -> List[workers.WorkerSpec]:
    """The command and environment of each of `num_workers` workers.

    Args:
        command: The training command, the same for every worker.
        num_workers: How many workers.
        ports: One port per worker.
        base_env: The launcher's environment (copied, not changed).
        host: Address the workers listen on.
        threads_per_worker: TensorFlow intra-op threads per worker (None: no
            limit set).
        gpu_sets: Each worker's `CUDA_VISIBLE_DEVICES` (`gpus.worker_gpus`);
            None: left as the launcher's.

    Returns:
        A `workers.WorkerSpec` per worker.
    """
    if num_workers < 1:
        raise ValueError(f"--num_workers must be >= 1, got {num_workers}")
    if len(ports) != num_workers or len(set(ports)) != num_workers:
        raise ValueError(f"need {num_workers} distinct ports, got {list(ports)}")
    if not command:
        raise ValueError("no command to run: put it after '--'")
    addresses = [f"{host}:{port}" for port in ports]
    specs = []
    for index in range(num_workers):
        env = dict(base_env)
        env.pop("TF_CONFIG", None)
        if num_workers > 1:
            env["TF_CONFIG"] = json.dumps({
                "cluster": {"worker": addresses},
                "task": {"type": "worker", "index": index}})
        env.update(workers.thread_env(threads_per_worker))
        env["TFSCALE_WORKER_INDEX"] = str(index)
        # Every worker is on this host: its local rank is its index (what
        # a worker that sees several GPUs binds itself by,
        # tfscale/cluster/gpu_binding.py).
        env["TFSCALE_LOCAL_INDEX"] = str(index)
        env["TFSCALE_LOCAL_WORKERS"] = str(num_workers)
        if gpu_sets is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu_sets[index]
            env[GPUS_BOUND_ENV] = "1"
        # TensorFlow's C++ INFO lines (one per collective, per server start)
        # off; warnings and errors stay. A value of one's own wins.
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        env["PYTHONUNBUFFERED"] = "1"
        specs.append(workers.WorkerSpec(index, list(command), env))
    return specs


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How `run` starts and supervises the workers (checked once, here).

    Raises:
        ValueError: A setting out of range, naming its flag.
    """

    num_workers: int
    port: Optional[int] = None
    max_restarts: int = 0
    host: str = "127.0.0.1"
    threads_per_worker: Optional[int] = None
    grace_seconds: float = 30.0
    backend: str = "mwms"
    mpirun: Optional[str] = None
    mpirun_args: tuple = ()
    data_service_workers: int = 0
    data_service_dir: Optional[str] = None
    gpus_per_worker: Optional[int] = None
    bind_gpus: bool = True
    share_gpus: bool = False
    failure_grace_seconds: float = 5.0
    restart_backoff_seconds: float = 1.0
    max_backoff_seconds: float = 60.0
    hang_floor_seconds: float = 180.0
    hang_ceiling_seconds: float = 1800.0
    hang_factor: float = 10.0
    # Elastic on one host: a worker slot that failed twice is left out, the
    # job restarted on the others while at least this many (None: no).
    min_workers: Optional[int] = None
    # Every worker on this host writes to the launcher's heartbeat folder
    # (False: ranks on other hosts, which cannot; then no hang watch).
    watch_heartbeats: bool = True

    def __post_init__(self):
        for name, least in (("num_workers", 1), ("max_restarts", 0),
                            ("data_service_workers", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"--{name} must be >= {least}, got "
                                 f"{getattr(self, name)}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"--gpus_per_worker must be >= 0, got "
                             f"{self.gpus_per_worker}")
        if self.min_workers is not None and not (
                1 <= self.min_workers <= self.num_workers):
            raise ValueError(f"--min_workers must be between 1 and "
                             f"--num_workers ({self.num_workers}), got "
                             f"{self.min_workers}")
        if self.min_workers is not None and self.backend != "mwms":
            raise ValueError("--min_workers: MultiWorkerMirroredStrategy's "
                             "workers only (MPI ranks: tfscale-run --min-np)")
        if not 1 <= self.hang_factor <= 1000:
            raise ValueError(f"--hang_factor must be between 1 and 1000, got "
                             f"{self.hang_factor}")
        if self.backend not in ("mwms", "mpi"):
            raise ValueError(f"--backend must be mwms or mpi, got "
                             f"{self.backend!r}")
        for name in ("grace_seconds", "failure_grace_seconds",
                     "restart_backoff_seconds", "max_backoff_seconds",
                     "hang_floor_seconds", "hang_ceiling_seconds"):
            problem = seconds_problem(name, getattr(self, name), f"--{name}")
            if problem:
                raise ValueError(problem)


def run(command: Sequence[str], num_workers: int, *,
        base_env: Optional[Mapping[str, str]] = None, out=None,
        elastic=None, **settings) -> int:
    """Runs `command` as `num_workers` workers until all succeed.

    `backend="mwms"` starts the processes with a TF_CONFIG each; "mpi" starts
    them as the ranks of one `mpirun` (`mpirun` and `mpirun_args` choose it
    and add options).

    GPUs (`launch/gpus.py`): worker i sees GPUs i*K..i*K+K-1 of the host
    (K = `gpus_per_worker`; default 1 when the host has GPUs, 0 for none);
    with "mpi", each rank binds itself by its local rank through
    `python -m launch.gpus` (ranks may be on other hosts). `bind_gpus=False`
    leaves `CUDA_VISIBLE_DEVICES` alone unless `gpus_per_worker` is given
    (scripts that pick their GPU by local rank themselves, as Horovod's do).

    `data_service_workers` > 0 also starts a tf.data service (a
    fault-tolerant dispatcher journaling to `data_service_dir`, and that
    many workers; `launch.data_service`, `input_pipelines.service`) for the
    whole run, replaces any of its processes that dies, and gives the workers its address
    (TFSCALE_DATA_SERVICE, which the entry points read).

    A worker that fails (crash, kill -9, or exit 143 after saving a
    preemption checkpoint) stops the attempt; while restarts remain, all
    workers start again and resume from the latest checkpoint. A worker
    that exits 2 (a setting it cannot run with, `CONFIG_ERROR_EXIT_CODE`)
    ends the job: another attempt would fail alike. SIGTERM to the
    launcher is passed on to the workers (they save a checkpoint and exit
    within `grace_seconds`), SIGINT too; a worker still running when the
    grace runs out is SIGKILLed, and the launcher says so.

    `elastic` (an `elastic.Elastic`, "mpi" only: tfscale-run's --min-np,
    --max-np, --host-discovery-script) makes each attempt one mpirun over
    the hosts its discovery finds then; a change of hosts while training
    stops the ranks at a checkpoint and starts them on the new set
    (`launch/elastic.py`).

    Returns:
        0 if every worker exited 0; else the shell status of the first
        worker that failed in the last attempt; 128 + N after signal N
        reached the launcher (130 for Ctrl-C, 143 for SIGTERM) and every
        worker left within the grace; 137 (SIGKILL's) when one had to be
        killed: no preemption checkpoint can be assumed.

    Raises:
        ValueError: `max_restarts` < 0 or another bad argument.
    """
    config = LaunchConfig(num_workers, **dict(
        settings, mpirun_args=tuple(settings.get("mpirun_args", ()))))
    out = out or sys.stdout
    base_env = dict(os.environ if base_env is None else base_env)
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    # The ports are held until the launcher leaves (`launch/ports.py`);
    # every attempt's workers listen on the same ones.
    if elastic is None and config.min_workers is not None:
        from launch.elastic import local_slots
        elastic = local_slots(config.num_workers, config.min_workers)
    held = contextlib.ExitStack()
    previous = {s: signal.signal(s, on_signal)
                for s in (signal.SIGINT, signal.SIGTERM)}
    service = None
    try:
        watch = None
        if config.watch_heartbeats and (elastic is None
                                        or elastic.mpirun_args is None):
            folder = held.enter_context(tempfile.TemporaryDirectory(
                prefix="tfscale-heartbeats-"))
            base_env[HEARTBEAT_DIR_ENV] = folder
            watch = hangs.HangWatch(folder, config.num_workers, hangs.HangLimits(
                config.hang_floor_seconds, config.hang_ceiling_seconds,
                config.hang_factor))
        start = _starter(
            config, command, base_env, out, _worker_ports(config, held),
            lambda n, host: held.enter_context(ports.lease(n, host)).ports,
            elastic)
        if config.data_service_workers:
            service = _start_service(
                config.data_service_workers, config.data_service_dir,
                held.enter_context(ports.lease(1, config.host)).ports[0],
                base_env, out)
        return _supervise(config, start, interrupted, out, watch, elastic)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if service is not None:
            service.stop()
        held.close()


def _worker_ports(config: LaunchConfig, held: contextlib.ExitStack
                  ) -> Optional[List[int]]:
    """One port per worker ("mwms"): `--port` and the next ones, else
    free ports leased for the launcher's life; None for "mpi" (mpirun
    connects the ranks)."""
    if config.backend == "mpi":
        return None
    if config.port:
        return list(range(config.port, config.port + config.num_workers))
    return held.enter_context(ports.lease(config.num_workers,
                                          config.host)).ports


def _starter(config: LaunchConfig, command, base_env, out, worker_ports,
             lease, elastic=None):
    """`start()` -> a running group of the workers: the processes with a
    TF_CONFIG each ("mwms"), or the ranks of one mpirun ("mpi"); GPUs bound
    per worker (`launch/gpus.py`)."""
    if config.share_gpus:
        if config.gpus_per_worker is not None:
            raise ValueError("--share_gpus and --gpus_per_worker exclude "
                             "each other")
        # Every worker sees every GPU of the host, each taking memory as
        # it needs it (several processes on one GPU: a test of a
        # multi-worker layout on a one-GPU machine).
        base_env = dict(base_env, TF_FORCE_GPU_ALLOW_GROWTH="true",
                        **{SHARED_GPUS_ENV: "1"})
    bind = not config.share_gpus and (
        config.bind_gpus or config.gpus_per_worker is not None)
    host_gpus = gpus.host_gpus(base_env) if bind else []
    if config.backend == "mpi":
        if bind and (host_gpus or config.gpus_per_worker is not None):
            # Each rank binds itself: mpirun's ranks may be on other hosts.
            k = [] if config.gpus_per_worker is None else [
                "--gpus_per_worker", str(config.gpus_per_worker)]
            command = [sys.executable, "-m", "launch.gpus", *k, "--",
                       *command]
        mpirun = mpi_ranks.find_mpirun(config.mpirun)

        def start_ranks():
            # Elastic: as many ranks as the hosts found for this attempt.
            hosts = elastic.membership.hosts if elastic else None
            mpi_command = mpi_ranks.mpirun_command(
                command, elastic.membership.num_workers if elastic else
                config.num_workers, mpirun,
                as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
                extra_args=(elastic.mpirun_args(hosts) if elastic else
                            config.mpirun_args))
            return mpi_ranks.MpiGroup(
                mpi_command,
                mpi_ranks.mpi_env(base_env, config.threads_per_worker), out)
        return start_ranks
    gpu_sets = (gpus.worker_gpus(host_gpus, config.num_workers,
                                 config.gpus_per_worker) if bind else None)
    if gpu_sets is not None and any(gpu_sets):
        _say(out, "GPUs: " + ", ".join(
            f"worker {i} CUDA_VISIBLE_DEVICES={g}"
            for i, g in enumerate(gpu_sets)))

    def start():
        worker_ports[:] = usable_ports(config, worker_ports, out, lease)
        # Elastic on one host: the slots left, each its port and GPUs.
        slots = (slot_indexes(elastic.membership.hosts) if elastic else
                 range(config.num_workers))
        return workers.ProcessGroup(
            worker_specs(command, len(slots), [worker_ports[i] for i in slots],
                         base_env, config.host, config.threads_per_worker,
                         gpu_sets and [gpu_sets[i] for i in slots]),
            out)
    return start


def usable_ports(config: LaunchConfig, worker_ports: List[int], out,
                 lease) -> List[int]:
    """The ports for the next attempt: `worker_ports` while no other
    program listens on them. One that another program took (before the
    start, or between two attempts) ends the launch when the user chose
    it (`--port`: a restart would fail alike); else other free ones are
    leased (`lease(count, host)` -> ports held while the launcher runs, as
    the first were).

    Raises:
        ValueError: A port of `--port`'s range is in use (one line; the
            launcher exits 2).
    """
    busy = ports.taken(worker_ports, config.host)
    if not busy:
        return worker_ports
    if config.port:
        raise ValueError(
            f"port {busy[0]} on {config.host} is in use by another program "
            f"(--port {config.port} gives workers ports {config.port}-"
            f"{config.port + config.num_workers - 1}): choose other ports "
            "or leave --port out (free ones are found)")
    fresh = lease(config.num_workers, config.host)
    _say(out, f"port(s) {', '.join(map(str, busy))} taken by another "
              f"program: the workers listen on {', '.join(map(str, fresh))}")
    return fresh


def _supervise(config: LaunchConfig, start, interrupted, out,
               watch=None, elastic=None) -> int:
    """Attempts until every worker exits 0, a signal reaches the launcher
    or the restarts run out; the exit code `run` returns, said in the
    launcher's last line (`_close`). `watch`: the workers' heartbeats
    (`hangs.HangWatch`), or None; `elastic`: an `elastic.Elastic`, or
    None. A move to another host set (elastic) is not a restart."""
    # The code the job ends with when too few hosts are left: the last
    # attempt's (a failure's, or 143 after a move that saved); before any
    # attempt, CONFIG_ERROR_EXIT_CODE (no worker ran: nothing to resume).
    restarts, code = 0, CONFIG_ERROR_EXIT_CODE
    while True:
        if elastic is not None and not _elastic_hosts(elastic, interrupted,
                                                      out):
            if interrupted:
                return _close(out, 128 + int(interrupted[0]), (
                    f"{signal.Signals(interrupted[0]).name} while waiting "
                    "for hosts: no worker was running; the latest "
                    "checkpoint stands"))
            return _close(out, code, elastic.membership.too_few())
        if watch is not None:
            watch.reset()
        try:
            group = start()
        except ValueError as e:  # a port of --port's taken: not restarted
            return _close(out, CONFIG_ERROR_EXIT_CODE, str(e))
        failure = _wait_for_outcome(group, interrupted, watch, elastic)
        if interrupted:
            return _pass_on(config, group, interrupted, out)
        if failure is None:
            group.stop(config.grace_seconds)
            return _close(out, 0, "every worker finished")
        if isinstance(failure, str):  # the hosts changed
            ended = _move(config, group, failure, out)
            if ended is not None:
                return _close(out, *ended)
            code = (PREEMPTED_EXIT_CODE if workers.reported_checkpoint(group)
                    else children.shell_code(_last_code(group)))
            continue
        code, verdict, again = _attempt_outcome(config, group, failure, out)
        if elastic is not None and again:
            note = elastic.membership.failed(
            failure[0], getattr(group, "lost_peer", {}))
            if note:
                _say(out, f"elastic: {note}")
        if not again or restarts == config.max_restarts:
            if again and config.max_restarts:
                verdict += (f", in the last of {config.max_restarts + 1} "
                            "attempts")
            return _close(out, children.shell_code(code), verdict)
        if not _restart_wait(config, restarts, failure, code, interrupted,
                             out, elastic):
            return _close(out, 128 + int(interrupted[0]),
                          f"{signal.Signals(interrupted[0]).name} before "
                          "the restart: no worker was running; the latest "
                          "checkpoint stands")
        restarts += 1


def _last_code(group) -> int:
    """The highest exit code of a stopped attempt's workers (SLURM's rule
    for a step), 1 when none said one."""
    codes = ([p.returncode for p in group.procs] if hasattr(group, "procs")
             else [group.proc.returncode])
    return max((c for c in codes if c), default=1, key=abs)


def _restart_wait(config: LaunchConfig, restarts: int, failure, code: int,
                  interrupted: list, out, elastic) -> bool:
    """Says the restart and waits its backoff; False when a signal came."""
    wait = backoff_seconds(config, restarts)
    who = "an MPI rank" if failure[0] is None else f"worker {failure[0]}"
    cause = (f"{who} hung" if code == HUNG_EXIT_CODE else
             f"{who} {children.describe_exit(code)}")
    many = "s" if config.num_workers > 1 else ""
    workers_again = ("the workers the hosts hold" if elastic is not None else
                     f"{config.num_workers} worker{many}")
    _say(out, f"restart {restarts + 1}/{config.max_restarts}: starting "
              f"{workers_again} again in {wait:g} s (cause: {cause})")
    return _wait_unless(wait, interrupted)


def _elastic_hosts(elastic, interrupted: list, out) -> bool:
    """The next attempt's hosts found (said in one line), or False after
    the elastic timeout."""
    membership = elastic.membership
    before = list(membership.hosts)
    hosts = membership.next_hosts(interrupted)
    if hosts is None:
        return False
    if hosts != before:
        from launch.elastic import words
        many = "s" if membership.num_workers > 1 else ""
        changed = membership.changes(before)
        _say(out, f"elastic: {membership.num_workers} worker{many} on "
                  f"{words(hosts)}" + (f" ({changed})" if changed else "") +
                  ": from the last whole checkpoint, at the job's global "
                  "batch (its banner says the split)")
    return True


def _move(config: LaunchConfig, group, reason: str, out):
    """The hosts changed while training: every worker saves the agreed
    step and leaves, then the caller starts the new set. None to go on,
    or (code, verdict) when the job cannot."""
    _say(out, f"elastic: {reason}: every worker saves at its next step "
              "and leaves, then the job restarts on the hosts found")
    killed = group.stop(config.grace_seconds, sig=signal.SIGTERM)
    saved = workers.reported_checkpoint(group)
    codes = ([p.returncode for p in group.procs] if hasattr(group, "procs")
             else [group.proc.returncode])
    if PREEMPTED_UNSAVED_EXIT_CODE in codes:
        return PREEMPTED_UNSAVED_EXIT_CODE, (
            "nothing saved: an elastic job needs a checkpoint folder (the "
            "jobs' --output_dir, the Trainer's checkpoint_dir) to move "
            "between host sets")
    _say(out, f"elastic: {os.path.basename(saved)} complete on disk "
              f"({saved}): the restart resumes there" if saved else
              "elastic: no worker reported a checkpoint" +
              (" (killed after the grace)" if killed else "") +
              ": the restart resumes from the latest whole one")
    return None


def _wait_for_outcome(group, interrupted: list, watch, elastic=None):
    """Polls the attempt until a worker fails (index, code), one hangs
    (index, HUNG_EXIT_CODE; why in `group.hung`), the hosts change (why,
    a string: elastic), every worker is done or a signal came (None)."""
    while not interrupted:
        failure = group.first_failure()
        if failure or group.all_done():
            return failure
        hung = watch.check() if watch is not None else None
        if hung is not None:
            group.hung[hung[0]] = hung[1]
            return hung[0], HUNG_EXIT_CODE
        change = elastic.membership.change() if elastic else None
        if change:
            return change
        time.sleep(workers.POLL_SECONDS)
    return None


def backoff_seconds(config: LaunchConfig, attempt: int) -> float:
    """The wait before restart `attempt + 1`: `restart_backoff_seconds`,
    doubled at each restart, at most `max_backoff_seconds`."""
    return min(config.restart_backoff_seconds * 2 ** attempt,
               config.max_backoff_seconds)


def _wait_unless(seconds: float, interrupted: list) -> bool:
    """Sleeps `seconds`; False as soon as a signal reached the launcher."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if interrupted:
            return False
        time.sleep(min(workers.POLL_SECONDS, end - time.monotonic()))
    return not interrupted


def _attempt_outcome(config: LaunchConfig, group, failure, out):
    """(code, verdict, whether a restart may help) after `failure` =
    (worker index, its code) ended an attempt; the others are stopped."""
    index, code = failure
    who = "an MPI rank" if index is None else f"worker {index}"
    if code == CONFIG_ERROR_EXIT_CODE:
        _say(out, f"{who} stopped on an error a restart would repeat "
                  f"(exit {code}){workers.last_words(group, index, code)}"
                  "; stopping the other workers, no restart")
        group.mute()
        group.stop(config.failure_grace_seconds, sig=signal.SIGTERM)
        _say_held_back(out, group)
        return code, (f"{who} stopped on a setting, its data or its disk "
                      "(named above): fix it and rerun"), False
    if code == HUNG_EXIT_CODE and index in getattr(group, "hung", {}):
        why = group.hung[index]
        _say(out, f"{who} hung: {why}; stopping the workers")
        group.mute()
        group.stop(config.failure_grace_seconds, sig=signal.SIGTERM)
        _say_held_back(out, group)
        return code, f"{who} hung ({why.split(';')[0]})", True
    if code == PREEMPTED_UNSAVED_EXIT_CODE:
        _say(out, f"{who} was preempted with no checkpoint directory "
                  f"(exit {code}); stopping the other workers, no restart")
        group.stop(config.grace_seconds, sig=None)
        return code, ("nothing saved: a restart would start over; give the "
                      "Trainer a checkpoint_dir (the jobs' --output_dir), "
                      "model.fit a keras.callbacks.BackupAndRestore"), False
    if code == PREEMPTED_EXIT_CODE:
        # The others are saving the same checkpoint: let them finish.
        _say(out, f"{who} was preempted (exit {code}); waiting for the "
                  "others")
        killed = group.stop(config.grace_seconds, sig=None)
        if killed and not _said_complete(out, group, killed,
                                         config.grace_seconds):
            return (-int(signal.SIGKILL), f"{who} preempted, the others "
                    "killed before a checkpoint was whole", True)
        saved = workers.reported_checkpoint(group)  # not what 143 suggests
        return code, (_preempted_line(saved) if saved else
                      f"{who} exited {code} but no worker reported a "
                      "checkpoint: nothing new was saved (the latest "
                      "checkpoint, if any, stands)"), True
    # The others cannot finish a step without it; SIGTERM first lets a
    # write in progress (a backup, a checkpoint) end before the SIGKILL
    # `failure_grace_seconds` later.
    _say(out, f"{who} failed ({children.describe_exit(code)})"
              f"{workers.last_words(group, index, code)}; "
              "stopping the other workers")
    group.mute()
    group.stop(config.failure_grace_seconds, sig=signal.SIGTERM)
    _say_held_back(out, group)
    link = getattr(group, "link", None)
    if link is not None and link[0] == index:
        return code, (f"the network between worker {link[0]} and worker "
                      f"{link[1]} failed ({link[2]})"), True
    return code, f"{who} failed ({children.describe_exit(code)})", True


def _preempted_line(saved: str) -> str:
    return f"preempted: {_saved_line(saved)}"


def _saved_line(saved: str) -> str:
    return (f"{os.path.basename(saved)} complete on disk ({saved}); rerun "
            "the same command to resume")


def _close(out, code: int, verdict: str) -> int:
    """The launcher's last line: what happened and its exit code, which
    it returns (a SLURM script requeues on 143 only: docs/launching.md)."""
    _say(out, f"exit {code}: {verdict}")
    return code


def _say_held_back(out, group) -> None:
    """One line for what the other workers printed while they stopped
    (their errors about the peer they lost), held back by `mute`."""
    held = group.held_back
    if not held:
        return
    who = sorted({i for i, _ in held if i is not None})
    names = ", ".join(f"worker {i}" for i in who) or "the other ranks"
    _say(out, f"{len(held)} line(s) {names} printed while stopping held "
              f"back (their side of the failure); the last: "
              f"{held[-1][1].strip()[:200]}")


def _pass_on(config: LaunchConfig, group, interrupted: list, out) -> int:
    """A signal reached the launcher: every worker gets it and the grace;
    a second one SIGKILLs them at once. The launcher's exit code, said in
    its last line."""
    sig = interrupted[0]
    name = signal.Signals(sig).name
    _say(out, f"{name}: passing it to all workers "
              f"(grace {config.grace_seconds:g} s; a second one stops them "
              "at once)")
    killed = group.stop(config.grace_seconds, sig=sig,
                        hurry=lambda: len(interrupted) > 1)
    if killed and len(interrupted) > 1:
        return _close(out, 128 + int(sig), (
            f"a second {signal.Signals(interrupted[1]).name}: SIGKILLed "
            "every worker at once; what they saved is not known"))
    if killed and not _said_complete(out, group, killed,
                                     config.grace_seconds):
        return _close(out, 128 + int(signal.SIGKILL),
                      "killed after the grace: a checkpoint may be missing")
    saved = workers.reported_checkpoint(group)
    if killed:
        return _close(out, 128 + int(sig), _preempted_line(saved))
    if sig != signal.SIGTERM:  # Ctrl-C: a person's stop, 130
        return _close(out, 128 + int(sig), (
            f"stopped by {name}: " + (_saved_line(saved) if saved else
                                     "no checkpoint was reported")))
    # A preemption every worker answered by itself: their codes and what
    # they reported decide (a SLURM script requeues on 143 only).
    codes = ([p.returncode for p in group.procs] if hasattr(group, "procs")
             else [group.proc.returncode])
    return _close(out, *outcome.after_signal(codes, saved, 128 + int(sig)))


def _said_complete(out, group, killed, grace_seconds: float) -> bool:
    """After the grace ran out on `killed`: whether a worker said its
    preemption checkpoint was complete and its files are whole on disk
    (`workers.reported_checkpoint`): then the run is resumable and the
    line says so; else the line says it may be missing."""
    saved = workers.reported_checkpoint(group)
    who = ("the MPI ranks" if killed == [None] else
           ", ".join(f"worker {i}" for i in killed))
    if saved is None:
        _say_killed(out, killed, grace_seconds)
        return False
    _say(out, f"the grace of {grace_seconds:g} s ran out: SIGKILLed {who} "
              f"on its way out; the checkpoint {saved} is complete on disk "
              "(every file of it is there): resumable")
    return True


def _say_killed(out, killed, grace_seconds: float) -> None:
    """One line: the grace ran out and these workers were SIGKILLed."""
    who = ("the MPI ranks" if killed == [None] else
           ", ".join(f"worker {i}" for i in killed))
    _say(out, f"the grace of {grace_seconds:g} s ran out: SIGKILLed {who} "
              "before it finished (a preemption checkpoint may be missing). "
              "Raise --grace_seconds to hold a step and a save (the jobs and "
              "the Trainer also bound a step: --max_call_seconds, "
              "TrainConfig.max_call_seconds)")


def _start_service(num_workers, work_dir, port, base_env, out):
    """A tf.data service for the run (its dispatcher on `port`); its
    address goes into `base_env`."""
    from launch.data_service import ADDRESS_ENV, Service
    service = Service(num_workers, port, out,
                      work_dir=work_dir, env=base_env)
    base_env[ADDRESS_ENV] = service.address
    _say(out, f"tf.data service: dispatcher {service.address} and "
              f"{num_workers} worker(s) for the training workers "
              f"(${ADDRESS_ENV})")
    return service


def _say(out, message: str):
    out.write(f"[launcher] {message}\n")
    out.flush()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfscale-launch", description=__doc__.split("\n\n")[0],
        usage="%(prog)s --num_workers N [options] -- command ...",
        epilog="Everything after '--' is the command each worker runs.")
    parser.add_argument("--num_workers", type=int, required=True,
                        help="workers (processes) to start on this host "
                             "(required)")
    parser.add_argument("--backend", choices=["mwms", "mpi"], default="mwms",
                        help="mwms: one process per worker with a TF_CONFIG "
                             "(MultiWorkerMirroredStrategy); mpi: the ranks "
                             "of one mpirun (run the command with "
                             "--backend=mpi) (default: mwms)")
    parser.add_argument("--port", type=int, default=None,
                        help="first of N consecutive ports (default: free "
                             "ports)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address every worker's TF_CONFIG names "
                             "(default: 127.0.0.1)")
    parser.add_argument("--min_workers", type=int, default=None,
                        help="elastic on this host: a worker slot (its "
                        "port, its GPUs) whose worker failed twice is left "
                        "out and the job restarts on the others, from the "
                        "last checkpoint at its global batch (the jobs' "
                        "--micro_batch_size), while at least this many are "
                        "left (default: none left out)")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="times to start all workers again after one "
                             "fails; the Trainer resumes from the latest "
                             "checkpoint (default: 0)")
    parser.add_argument("--threads_per_worker", type=int, default=None,
                        help="TF intra-op threads per worker "
                             "(default: cores / num_workers)")
    parser.add_argument("--grace_seconds", type=float, default=30.0,
                        help="seconds workers get to exit (and save a "
                             "checkpoint) after a signal before SIGKILL; "
                             "the launcher says when it ran out and exits "
                             "137. It must hold the workers' worst case: "
                             "--max_call_seconds (2 by default), one step "
                             "and the save (default: 30)")
    parser.add_argument("--failure_grace_seconds", type=float, default=5.0,
                        help="after a worker fails, seconds the others get "
                             "between SIGTERM and SIGKILL (a file being "
                             "written is finished) (default: 5)")
    parser.add_argument("--restart_backoff_seconds", type=float, default=1.0,
                        help="wait before the first restart, doubled at "
                             "each one after (default: 1)")
    parser.add_argument("--max_backoff_seconds", type=float, default=60.0,
                        help="the longest wait between two attempts "
                             "(default: 60)")
    _add_hang_options(parser.add_argument_group("hangs"))
    _add_mpi_options(parser.add_argument_group("--backend mpi"))
    _add_gpu_options(parser.add_argument_group("GPUs"))
    _add_data_service_options(
        parser.add_argument_group("tf.data service"))
    return parser


def _add_hang_options(group) -> None:
    """When a worker that writes heartbeats (the Trainer, model.fit after
    enable_multi_worker_fit) counts as hung."""
    group.add_argument("--hang_factor", type=float, default=10.0,
                       help="a worker silent for this many times the "
                            "longest its phase (step, checkpoint, "
                            "evaluation) has taken in this run is hung: "
                            "named, the job stopped and restarted "
                            "(default: 10)")
    group.add_argument("--hang_floor_seconds", type=float, default=180.0,
                       help="the shortest silence that counts as a hang "
                            "(default: 180)")
    group.add_argument("--hang_ceiling_seconds", type=float, default=1800.0,
                       help="the longest silence allowed, and the limit of "
                            "a phase no earlier time bounds (the first "
                            "compile, checkpoint, evaluation) (default: "
                            "1800)")


def _add_mpi_options(group) -> None:
    """The options of the MPI backend."""
    group.add_argument("--mpirun", default=None,
                       help="--backend mpi: the mpirun to use (default: "
                            "beside this Python, else on PATH)")
    group.add_argument("--mpirun_args", default="",
                       help="--backend mpi: extra mpirun options, e.g. "
                            "\"--mca btl tcp,self\" (default: none)")


def _add_gpu_options(group) -> None:
    """How the host's GPUs are shared among the workers."""
    group.add_argument("--gpus_per_worker", type=int, default=None,
                       help="GPUs each worker sees (CUDA_VISIBLE_DEVICES: "
                            "worker i gets GPUs i*K..i*K+K-1 of the host); "
                            "0: none (default: 1 when the host has GPUs, "
                            "nvidia-smi -L or CUDA_VISIBLE_DEVICES)")
    group.add_argument("--share_gpus", action="store_true",
                       help="every worker sees every GPU of the host, with "
                            "TF_FORCE_GPU_ALLOW_GROWTH=true and "
                            f"{SHARED_GPUS_ENV}=1 (several workers on one "
                            "GPU, e.g. to try a multi-worker layout on a "
                            "one-GPU machine; their all-reduce takes the "
                            "gRPC ring under --all_reduce_alg=auto: NCCL "
                            "refuses two ranks on one GPU) (default: off)")


def _add_data_service_options(group) -> None:
    """A tf.data service beside the workers."""
    group.add_argument("--data_service_workers", type=int, default=0,
                       help="also start a tf.data service with this many "
                            "workers on this host; the training workers "
                            "decode on it (entry points read "
                            "$TFSCALE_DATA_SERVICE) (default: 0, none)")
    group.add_argument("--data_service_dir", default=None,
                       help="the service dispatcher's journal (default: "
                            "a temporary directory)")


def parse_args(argv: Sequence[str]):
    parser = _parser()
    argv = list(argv)
    options = argv[:argv.index("--")] if "--" in argv else argv
    if "-h" in options or "--help" in options:
        parser.parse_args(["--help"])  # prints the help, exits 0
    if "--" not in argv:
        parser.error("put the training command after '--'")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    args.command = argv[split + 1:]
    if not args.command:
        parser.error("no command after '--'")
    try:
        args.config = LaunchConfig(
            args.num_workers, port=args.port, max_restarts=args.max_restarts,
            host=args.host,
            threads_per_worker=(args.threads_per_worker or
                                workers.default_threads(
                                    max(1, args.num_workers))),
            grace_seconds=args.grace_seconds, backend=args.backend,
            mpirun=args.mpirun,
            mpirun_args=tuple(shlex.split(args.mpirun_args)),
            data_service_workers=args.data_service_workers,
            data_service_dir=args.data_service_dir,
            gpus_per_worker=args.gpus_per_worker,
            share_gpus=args.share_gpus,
            failure_grace_seconds=args.failure_grace_seconds,
            restart_backoff_seconds=args.restart_backoff_seconds,
            max_backoff_seconds=args.max_backoff_seconds,
            hang_floor_seconds=args.hang_floor_seconds,
            hang_ceiling_seconds=args.hang_ceiling_seconds,
            hang_factor=args.hang_factor, min_workers=args.min_workers)
    except ValueError as e:
        parser.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args.command, **{
            f.name: getattr(args.config, f.name)
            for f in dataclasses.fields(LaunchConfig)})
    except ValueError as e:
        print(f"tfscale-launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
