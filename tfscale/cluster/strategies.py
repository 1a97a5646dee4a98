"""The strategy for a resolved cluster, and what a strategy says about it.

`cluster/environment.py` reads where this process sits (TF_CONFIG, SLURM, MPI) into a
`ClusterInfo`; this module turns that into a `tf.distribute` strategy (or
the MPI backend's single-replica one, `mpi.py`) and reads a strategy's
chief, worker count and index back.
"""

import os
import signal
import socket
import subprocess
import sys
from typing import Optional

from tfscale.cluster import (all_reduce_impl, gpu_binding, mpi, placement,
                             watchdog)
from tfscale.cluster.contract import (CONFIG_ERROR_EXIT_CODE,
                                      STARTUP_TIMEOUT_EXIT_CODE)
from tfscale.cluster.devices import visible_gpus
from tfscale.cluster.environment import ClusterConfig, ClusterError, ClusterInfo
from tfscale.errors import ConfigError, chain_excepthook


# What a worker says when TensorFlow's runtime started before its strategy
# (TensorFlow's own words: "Collective ops must be configured at program
# startup", and a traceback).
STARTUP_ORDER = (
    "TensorFlow started before the strategy (a dataset, a tensor or a model "
    "came first), and on several workers MultiWorkerMirroredStrategy must "
    "configure it at program startup: build the strategy "
    "(tfscale.make_strategy, tf.distribute.MultiWorkerMirroredStrategy()) "
    "before any dataset or tensor")
_STARTUP_MARK = "_tfscale_startup_order"


def is_startup_order_error(value) -> bool:
    """Whether `value` is TensorFlow's or tfscale's refusal of a strategy
    built after the runtime started."""
    text = str(value)
    return ("Collective ops must be configured at program startup" in text
            or STARTUP_ORDER in text)


def say_startup_order(who: str) -> None:
    """From now on an uncaught strategy-order error ends this process in
    one line naming `who`, exit 2 (a restart would meet it again), not a
    TensorFlow traceback."""
    from tfscale.cluster import fail_fast

    def make_hook(previous):
        def hook(kind, value, traceback):
            if not is_startup_order_error(value):
                return previous(kind, value, traceback)
            sys.stderr.write(f"tfscale: {who}: {STARTUP_ORDER}\n")
            fail_fast.end(CONFIG_ERROR_EXIT_CODE)
        return hook
    chain_excepthook(_STARTUP_MARK, make_hook)


def make_strategy(info: ClusterInfo, config: ClusterConfig, devices=None):
    """Builds the strategy for this process, its replicas on the GPUs it
    sees (`devices.visible_gpus`), checked there (`placement.check`).

    Args:
        info: Where this process sits (from `resolve_cluster`).
        config: Communication settings.
        devices: Single-worker only: devices to mirror over (default: every
            GPU this process sees, else the CPU).

    Returns:
        Backend "mpi": this rank's single-replica strategy (a GPU it sees,
        by its local rank, or the CPU). Otherwise a
        `MultiWorkerMirroredStrategy` when there is more than one worker
        (each worker's replicas on every GPU it sees), else a
        `MirroredStrategy` over the local devices.

    Raises:
        ClusterError: This worker's port is already in use; MPI's rank or
            size disagrees with the environment.
        placement.PlacementError: The worker sees a GPU and its replicas
            are not on one.
    """
    import tensorflow as tf

    who = (f"rank {info.worker_index}" if config.backend == "mpi" else
           f"worker {info.worker_index}")
    # Before anything starts TensorFlow's runtime: this process keeps its
    # own GPUs only (gpu_binding.py).
    binding = gpu_binding.bind(info, one_per_process=config.backend == "mpi",
                               worker=who)
    gpus = visible_gpus()
    if config.backend == "mpi":
        comm = mpi.import_mpi().COMM_WORLD
        if (comm.rank, comm.size) != (info.worker_index, info.num_workers):
            raise ClusterError(
                f"MPI says rank {comm.rank} of {comm.size}, the environment "
                f"rank {info.worker_index} of {info.num_workers}: is mpi4py "
                "built against the MPI that started this process?")
        strategy = mpi.make_strategy(gpus)
        placement.check(strategy, worker=f"rank {info.worker_index}",
                        gpus=gpus)
        return strategy
    if info.num_workers == 1:
        strategy = tf.distribute.MirroredStrategy(
            list(devices or gpus or ["/cpu:0"]))
        placement.check(strategy, worker="worker 0", gpus=gpus)
        return strategy

    check_own_port(info)
    worker = f"worker {info.worker_index}"
    ids = all_reduce_impl.gpu_ids(info.visible_devices, socket.gethostname())
    choice = all_reduce_impl.choose(config.all_reduce_alg, ids,
                                    info.shares_gpus or binding.shared,
                                    worker)
    if choice.implementation == all_reduce_impl.NCCL:
        # Named here, not at the first collective (or as a start-up wait
        # blamed on the peers).
        all_reduce_impl.load_nccl(worker, info.library_path)
    options = communication_options(config, choice.implementation)
    from tfscale import _compat
    start_coordination(info, config, worker)
    with StartupWatchdog(info, config.connect_timeout_seconds):
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=multi_worker_resolver(info, gpus),
            communication_options=options)
        # Before any collective: a worker on the wrong devices says so
        # (its peers, waiting in the first collective, end with it).
        placement.check(strategy, worker=worker, gpus=gpus)
        service = _compat.coordination_service()
        if choice.implementation == all_reduce_impl.NCCL and service:
            all_reduce_impl.check_not_shared(
                service, info.worker_index, info.num_workers,
                all_reduce_impl.gpu_uuids(info.visible_devices, len(ids)),
                config.connect_timeout_seconds)
        # The first collective proves every peer is up and reachable.
        tf.function(lambda: strategy.reduce(
            tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)),
            axis=None), autograph=False)()
    return strategy


def start_coordination(info: ClusterInfo, config: ClusterConfig,
                       worker: str) -> None:
    """TensorFlow's coordination service, with `heartbeat_timeout_seconds`,
    before MultiWorkerMirroredStrategy would start it with its own; a
    runtime already started (a dataset or tensor made first) refused in one
    line (`STARTUP_ORDER`)."""
    from tfscale import _compat
    if _compat.runtime_started():
        say_startup_order(worker)
        raise ConfigError("strategy", f"{worker}: {STARTUP_ORDER}")
    _compat.configure_coordination(info.cluster,
                                   config.heartbeat_timeout_seconds)


def multi_worker_resolver(info: ClusterInfo, gpus):
    """The cluster resolver of a MultiWorkerMirroredStrategy worker that sees
    `gpus`: TensorFlow puts its replicas on `num_accelerators()` GPUs, and
    on the CPU where that is empty, as a resolver built without it is
    (`placement.py`)."""
    import tensorflow as tf
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(dict(info.cluster)), task_type=info.task_type,
        task_id=info.task_index, rpc_layer="grpc",
        num_accelerators=placement.num_accelerators(gpus))


def check_own_port(info: ClusterInfo) -> None:
    """Raises ClusterError if this worker's port is taken.

    TensorFlow only says "Could not start gRPC server" in a traceback.
    """
    host, _, port = info.address.rpartition(":")
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Ports in TIME_WAIT (a restarted worker) are fine; a listener is not.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("" if host not in ("127.0.0.1", "localhost") else host,
                    int(port)))
    except OSError as e:
        raise ClusterError(
            f"worker {info.worker_index}: cannot listen on {info.address} "
            f"({e.strerror or e})", restartable=True) from None
    finally:
        probe.close()


def communication_options(config: ClusterConfig,
                          implementation: Optional[str] = None):
    """The `CommunicationOptions` for the Trainer's gradient all-reduce:
    `implementation` ("nccl", "ring"; `all_reduce_impl.choose`), else
    the flag's."""
    import tensorflow as tf
    implementation = getattr(
        tf.distribute.experimental.CommunicationImplementation,
        (implementation or config.all_reduce_alg).upper())
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=config.bytes_per_pack,
        timeout_seconds=config.collective_timeout_seconds,
        implementation=implementation)


class StartupWatchdog:
    """Kills this process if cluster start-up takes longer than a limit.

    TensorFlow waits forever for a peer that never comes up, holding the GIL
    (so no Python thread or signal handler of ours can act) and ignoring
    SIGTERM. A small watchdog process (`watchdog.py`) waits on a pipe,
    saying every so often which peers do not answer; if the `with` block
    has not ended within `timeout` seconds, it names them and ends this
    process with `STARTUP_TIMEOUT_EXIT_CODE` (a signal whose handler is the
    C library's `_exit`; SIGKILL where that cannot be set).
    """

    def __init__(self, info: ClusterInfo, timeout: float,
                 who: str = "worker"):
        self._info = info
        self._timeout = timeout
        self._who = who
        self._process = None
        self._signal = None

    def __enter__(self):
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "watchdog.py")
        code = STARTUP_TIMEOUT_EXIT_CODE
        self._signal = (code if watchdog.exit_on_signal(code)
                        else int(signal.SIGKILL))
        self._process = subprocess.Popen(
            [sys.executable, script, str(os.getpid()), str(self._timeout),
             str(self._signal), f"{self._who} {self._info.worker_index}",
             *self._info.peer_addresses],
            stdin=subprocess.PIPE)
        return self

    def __exit__(self, *exc):
        self._process.stdin.close()
        self._process.wait()
        if self._signal != signal.SIGKILL:
            signal.signal(self._signal, signal.SIG_DFL)


def chief_and_worker_count(strategy) -> tuple:
    """(is_chief, num_workers) of this process under `strategy`."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not spec:
        return True, 1
    num_workers = len(spec.get("chief", ())) + len(spec.get("worker", ()))
    if "chief" in spec:
        return resolver.task_type == "chief", num_workers
    return resolver.task_type == "worker" and resolver.task_id == 0, num_workers


def worker_index(strategy) -> int:
    """This process's index in [0, num_workers) under `strategy` (chief 0)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not spec:
        return 0
    chiefs = len(spec.get("chief", ()))
    if resolver.task_type == "chief":
        return 0
    return chiefs + int(resolver.task_id)
