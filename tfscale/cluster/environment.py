"""Cluster resolution: where this process sits.

This is the only module that reads `TF_CONFIG` or SLURM's environment. It turns
the environment into a `ClusterInfo` (pure, testable without TensorFlow);
`strategies.py` turns a `ClusterInfo` plus a `ClusterConfig` into a
`tf.distribute` strategy.

Sources, in order of precedence:
  1. `TF_CONFIG` (Kubernetes operators, `launch.local`, hand-written configs).
  2. SLURM (`srun python run_pretraining.py ...`): one worker per task.
  3. Neither: a single worker.
With the MPI backend the ranks come from the MPI launcher instead (`mpirun`,
`launch.local --backend mpi`, `srun --mpi=pmix`), which also connects them.
"""

import dataclasses
import json
import os
import sys
from typing import Mapping, Optional, Sequence

from tfscale.cluster import contract
from tfscale.errors import ConfigError

_CHIEF = "chief"
_WORKER = "worker"
_ALL_REDUCE_ALGS = ("auto", "ring", "nccl")
_BACKENDS = ("mwms", "mpi")


class ClusterError(ValueError):
    """The environment describes an invalid cluster.

    Attributes:
        restartable: Whether another attempt may succeed (a port still
            held by a worker that just exited); False for what a restart
            would meet again (a malformed TF_CONFIG, MPI ranks started
            without --backend=mpi).
    """

    def __init__(self, message: str, *, restartable: bool = False):
        super().__init__(message)
        self.restartable = restartable


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """How workers talk to each other.

    Attributes:
        backend: "mwms" (default): MultiWorkerMirroredStrategy's collectives
            (ring over gRPC on CPUs, NCCL on GPUs), workers from TF_CONFIG or
            SLURM. "mpi": one single-replica process per MPI rank, gradients
            summed with MPI.Allreduce (see `tfscale/cluster/mpi.py`).
        all_reduce_alg: Collective implementation: "auto" (NCCL where each
            replica has a GPU of its own, else the gRPC ring:
            `all_reduce_impl.choose`), "ring" or "nccl".
        bytes_per_pack: Gradients are packed into chunks of about this many
            bytes per all-reduce; 0 lets TensorFlow choose (one pack).
        collective_timeout_seconds: A collective that does not complete in
            this time fails instead of hanging. None waits forever.
        connect_timeout_seconds: Start-up (all workers reachable and the
            first collective done) must finish in this time, or the worker
            is killed after naming the peers it could not reach.
        heartbeat_timeout_seconds: MultiWorkerMirroredStrategy: a worker
            whose heartbeats to TensorFlow's coordination service stop this
            long (a host lost, a process stopped, a link cut) fails every
            worker's next collective, naming it. TensorFlow's own default
            is 10 s, which a healthy worker on a loaded host has missed.
        slurm_port_base: First port on each node when the cluster comes from
            SLURM; task i on a node listens on port base + i.
    """

    backend: str = "mwms"
    all_reduce_alg: str = "auto"
    bytes_per_pack: int = 0
    collective_timeout_seconds: Optional[float] = 300.0
    connect_timeout_seconds: float = 120.0
    heartbeat_timeout_seconds: float = 30.0
    slurm_port_base: int = 8888

    def __post_init__(self):
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got "
                             f"{self.backend!r}")
        if self.all_reduce_alg not in _ALL_REDUCE_ALGS:
            raise ValueError(
                f"all_reduce_alg must be one of {_ALL_REDUCE_ALGS}, "
                f"got {self.all_reduce_alg!r}")
        if self.bytes_per_pack < 0:
            raise ValueError(
                f"bytes_per_pack must be >= 0, got {self.bytes_per_pack}")
        for field in ("collective_timeout_seconds",
                      "connect_timeout_seconds",
                      "heartbeat_timeout_seconds"):
            problem = contract.seconds_problem(field, getattr(self, field))
            if problem:
                raise ConfigError(field, problem)


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """Where this process sits in the job.

    Attributes:
        cluster: `{"chief": [...], "worker": [...]}` address lists, empty for
            a single worker.
        task_type: "chief" or "worker" (TF_CONFIG's words).
        task_index: Index within `task_type`.
        source: "tf_config", "slurm", "mpi" or "single".
        world_size: "mpi": the number of ranks (MPI connects them: no
            addresses in `cluster`); `task_index` is the rank.
        visible_devices: This process's `CUDA_VISIBLE_DEVICES` (None:
            unset), which names the GPUs behind TensorFlow's GPU:0, ...
        shares_gpus: The launcher says the host's workers share its GPUs
            (`contract.SHARED_GPUS_ENV`, `launch.local --share_gpus`).
        gpus_bound: The launcher gave this process its own GPUs
            (`contract.GPUS_BOUND_ENV`): it keeps every GPU it sees.
        local_rank: This process's index on its host (`contract.local_rank`).
        local_workers: How many processes share its host, when a launcher
            says so (`contract.local_workers`), else None.
        library_path: Its LD_LIBRARY_PATH (where NCCL is looked for first,
            `all_reduce_impl.load_nccl`).
    """

    cluster: Mapping[str, Sequence[str]]
    task_type: str
    task_index: int
    source: str
    world_size: Optional[int] = None
    visible_devices: Optional[str] = None
    shares_gpus: bool = False
    gpus_bound: bool = False
    local_rank: int = 0
    local_workers: Optional[int] = None
    library_path: str = ""

    @property
    def num_workers(self) -> int:
        """Number of worker processes, chief included."""
        if self.world_size is not None:
            return self.world_size
        return max(1, len(self.cluster.get(_CHIEF, ())) +
                   len(self.cluster.get(_WORKER, ())))

    @property
    def worker_index(self) -> int:
        """Global index of this process in [0, num_workers); chief is 0."""
        if self.world_size is not None:
            return self.task_index
        if self.task_type == _CHIEF:
            return 0
        return len(self.cluster.get(_CHIEF, ())) + self.task_index

    @property
    def is_chief(self) -> bool:
        """True for the one worker that writes checkpoints and logs."""
        return self.worker_index == 0

    @property
    def address(self) -> Optional[str]:
        if not self.cluster:
            return None
        return self.cluster[self.task_type][self.task_index]

    @property
    def peer_addresses(self) -> list:
        """Addresses of every other worker."""
        own = self.address
        return [a for t in (_CHIEF, _WORKER) for a in self.cluster.get(t, ())
                if a != own]


def resolve_cluster(environ: Mapping[str, str] = None,
                    slurm_port_base: int = 8888,
                    backend: str = "mwms") -> ClusterInfo:
    """Reads the cluster from the environment.

    Args:
        environ: The environment; `os.environ` when None.
        slurm_port_base: Port of the first task on each SLURM node.
        backend: "mwms" or "mpi" (see `ClusterConfig`).

    Returns:
        A `ClusterInfo`.

    Raises:
        ClusterError: TF_CONFIG or the SLURM variables are malformed; the
            message names the variable and what is wrong with it.
    """
    environ = os.environ if environ is None else environ
    return dataclasses.replace(
        _where(environ, slurm_port_base, backend),
        visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
        shares_gpus=environ.get(contract.SHARED_GPUS_ENV) == "1",
        gpus_bound=environ.get(contract.GPUS_BOUND_ENV) == "1",
        local_rank=contract.local_rank(environ),
        local_workers=contract.local_workers(environ),
        library_path=environ.get("LD_LIBRARY_PATH", ""))


def _where(environ: Mapping[str, str], slurm_port_base: int,
           backend: str) -> ClusterInfo:
    """`resolve_cluster`'s cluster and task, from the first source that
    names one."""
    if backend == "mpi":
        return _from_mpi(environ)
    if environ.get("TF_CONFIG", "").strip():
        return _from_tf_config(environ["TF_CONFIG"])
    if "SLURM_PROCID" in environ and _slurm_num_tasks(environ) > 1:
        return _from_slurm(environ, slurm_port_base)
    for variable in _MPI_SIZE_VARIABLES:
        size = environ.get(variable, "1").strip()
        if size.isdigit() and int(size) > 1:
            # N copies that each believed they were alone would all train,
            # and write the same files, as the chief.
            raise ClusterError(
                f"started as one of {size} MPI processes ({variable}) "
                "without --backend=mpi: pass --backend=mpi (Python: "
                "ClusterConfig(backend='mpi')), or start MultiWorkerMirrored"
                "Strategy workers with `python -m launch.local --num_workers "
                "N -- ...`, `srun`, or Kubernetes")
    return ClusterInfo(cluster={}, task_type=_WORKER, task_index=0,
                       source="single")


# What mpirun / horovodrun (Open MPI, MPICH, Intel MPI) set in each process.
_MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
# (rank, size) variables: Open MPI's mpirun; MPICH / Intel MPI (and srun
# --mpi=pmi2); PMIx under srun --mpi=pmix, where SLURM gives the size.
_MPI_WORLD_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",)),
    ("PMI_RANK", ("PMI_SIZE",)),
    ("PMIX_RANK", ("PMIX_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")),
)


def pypi_open_mpi_environment(environ: Mapping[str, str],
                              prefix: str) -> dict:
    """What Open MPI's PyPI wheel needs when a process is started by srun
    rather than by the wheel's own mpirun (which sets it up itself): its
    install prefix (help texts, components), and under srun --mpi=pmix the
    PMIx security mode the wheel has (SLURM's server offers munge, which the
    wheel's PMIx lacks, beside native). Nothing for another MPI, or what the
    environment already sets."""
    if not os.path.isdir(os.path.join(prefix, "share", "openmpi")):
        return {}
    extra = {}
    if "OPAL_PREFIX" not in environ:
        extra["OPAL_PREFIX"] = prefix
    if "PMIX_RANK" in environ and "PMIX_MCA_psec" not in environ:
        extra["PMIX_MCA_psec"] = "native"
    return extra


def environment_seconds(name: str,
                        environ: Mapping[str, str] = None) -> Optional[float]:
    """A duration in seconds from the environment variable `name` (unset,
    empty or 0: None).

    Raises:
        ClusterError: Not a number, or negative.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ClusterError(f"{name} is not a number of seconds: "
                           f"{text!r}") from None
    if not 0 <= value <= 7 * contract.DAY_SECONDS:  # (nan and inf too)
        raise ClusterError(f"{name} must be between 0 and "
                           f"{7 * contract.DAY_SECONDS:g} seconds (0: none), "
                           f"got {text}")
    return value or None


def heartbeat_file(environ: Mapping[str, str] = None) -> Optional[str]:
    """Where this worker writes its heartbeat: the launcher's folder
    (`contract.HEARTBEAT_DIR_ENV`) and this worker's index
    (`TFSCALE_WORKER_INDEX`, or an MPI rank's: Open MPI's, PMIx's); None
    when no launcher asked for one."""
    environ = os.environ if environ is None else environ
    folder = environ.get(contract.HEARTBEAT_DIR_ENV, "").strip()
    index = next((environ[name].strip() for name in (
        "TFSCALE_WORKER_INDEX", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
        if environ.get(name, "").strip()), "")
    if not folder or not index.isdigit():
        return None
    return contract.heartbeat_path(folder, int(index))


def environment_choice(name: str, choices: Sequence[str], default: str,
                       environ: Mapping[str, str] = None) -> str:
    """The value of the environment variable `name`, one of `choices`
    (unset or empty: `default`).

    Raises:
        ClusterError: Another value.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(name, "").strip() or default
    if text not in choices:
        raise ClusterError(f"{name} must be one of {', '.join(choices)}, got "
                           f"{text!r}")
    return text


def prepare_mpi_environment() -> None:
    """Sets `pypi_open_mpi_environment` in this process (before MPI starts)."""
    os.environ.update(pypi_open_mpi_environment(os.environ, sys.prefix))


def _from_mpi(environ) -> ClusterInfo:
    """The rank and size the MPI launcher set (none: one process)."""
    for rank_variable, size_variables in _MPI_WORLD_VARIABLES:
        if rank_variable not in environ:
            continue
        size_variable = next((v for v in size_variables if v in environ),
                             None)
        if size_variable is None:
            raise ClusterError(f"{rank_variable} is set but none of "
                               f"{', '.join(size_variables)} is")
        values = {}
        for name in (rank_variable, size_variable):
            try:
                values[name] = int(environ[name])
            except ValueError:
                raise ClusterError(f"{name} is not an integer: "
                                   f"{environ[name]!r}") from None
        rank, size = values[rank_variable], values[size_variable]
        if not 0 <= rank < size:
            raise ClusterError(f"{rank_variable}={rank} is out of range for "
                               f"{size_variable}={size}")
        return ClusterInfo(cluster={}, task_type=_WORKER, task_index=rank,
                           source="mpi", world_size=size)
    if "SLURM_PROCID" in environ and _slurm_num_tasks(environ) > 1:
        raise ClusterError(
            "--backend=mpi under srun needs MPI's process manager: run "
            "`srun --mpi=pmix ...` (or --mpi=pmi2); plain srun starts "
            f"{_slurm_num_tasks(environ)} unconnected processes")
    if environ.get("TF_CONFIG", "").strip():
        raise ClusterError(
            "TF_CONFIG is set but --backend=mpi takes its ranks from MPI: "
            "start with `python -m launch.local --backend mpi`, `mpirun` or "
            "`srun --mpi=pmix`, or drop --backend=mpi")
    return ClusterInfo(cluster={}, task_type=_WORKER, task_index=0,
                       source="mpi", world_size=1)


def _from_tf_config(text: str) -> ClusterInfo:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterError(f"TF_CONFIG is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ClusterError("TF_CONFIG must be a JSON object with 'cluster' "
                           "and 'task'")
    cluster = config.get("cluster")
    task = config.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterError("TF_CONFIG has no 'cluster' object")
    if not isinstance(task, dict):
        raise ClusterError("TF_CONFIG has no 'task' object")
    unknown = sorted(set(cluster) - {_CHIEF, _WORKER, "evaluator"})
    if unknown:
        raise ClusterError(f"TF_CONFIG cluster has task types {unknown}; "
                           "multi-worker training takes 'chief' and 'worker'")
    for task_type, addresses in cluster.items():
        if (not isinstance(addresses, list) or not addresses or not all(
                isinstance(a, str) and _valid_address(a) for a in addresses)):
            raise ClusterError(
                f"TF_CONFIG cluster['{task_type}'] must be a non-empty list "
                f"of 'host:port' strings, got {addresses!r}")
    if len(cluster.get(_CHIEF, ())) > 1:
        raise ClusterError("TF_CONFIG cluster has more than one 'chief'")
    task_type = task.get("type")
    if task_type is None:
        raise ClusterError("TF_CONFIG task has no 'type'")
    if task_type not in cluster:
        raise ClusterError(f"TF_CONFIG task type {task_type!r} is not in the "
                           f"cluster (which has {sorted(cluster)})")
    if task_type == "evaluator":
        raise ClusterError("TF_CONFIG task type 'evaluator' is not supported")
    task_index = task.get("index", 0)
    if not isinstance(task_index, int) or isinstance(task_index, bool):
        raise ClusterError(f"TF_CONFIG task index must be an integer, got "
                           f"{task_index!r}")
    if not 0 <= task_index < len(cluster[task_type]):
        raise ClusterError(
            f"TF_CONFIG task index {task_index} is out of range for "
            f"'{task_type}' with {len(cluster[task_type])} task(s)")
    cluster = {t: list(a) for t, a in cluster.items() if t != "evaluator"}
    return ClusterInfo(cluster=cluster, task_type=task_type,
                       task_index=task_index, source="tf_config")


def _valid_address(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(host) and bool(sep) and port.isdigit()


def _slurm_num_tasks(environ) -> int:
    value = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    if value is None:
        raise ClusterError("SLURM_PROCID is set but neither "
                           "SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is")
    try:
        return int(value)
    except ValueError:
        raise ClusterError(f"SLURM_NTASKS is not an integer: {value!r}") from None


def _from_slurm(environ, port_base: int) -> ClusterInfo:
    # Hostlist and tasks-per-node grammars are SLURM's; TensorFlow's
    # SlurmClusterResolver module already parses both.
    from tfscale._compat import slurm_expand_hostlist, slurm_expand_tasks_per_node
    num_tasks = _slurm_num_tasks(environ)
    try:
        rank = int(environ["SLURM_PROCID"])
    except ValueError:
        raise ClusterError(
            f"SLURM_PROCID is not an integer: {environ['SLURM_PROCID']!r}") from None
    nodelist = (environ.get("SLURM_STEP_NODELIST")
                or environ.get("SLURM_JOB_NODELIST"))
    if not nodelist:
        raise ClusterError("SLURM job has no SLURM_STEP_NODELIST or "
                           "SLURM_JOB_NODELIST")
    hosts = slurm_expand_hostlist(nodelist)
    tasks_spec = (environ.get("SLURM_STEP_TASKS_PER_NODE")
                  or environ.get("SLURM_TASKS_PER_NODE"))
    if tasks_spec:
        per_node = slurm_expand_tasks_per_node(tasks_spec)
    else:
        per_node = [num_tasks // len(hosts)] * len(hosts)
    if len(per_node) != len(hosts) or sum(per_node) != num_tasks:
        raise ClusterError(
            f"SLURM tasks per node {per_node} on hosts {hosts} do not add up "
            f"to {num_tasks} tasks")
    if not 0 <= rank < num_tasks:
        raise ClusterError(f"SLURM_PROCID {rank} is out of range for "
                           f"{num_tasks} tasks")
    # SLURM's block distribution numbers tasks node by node.
    workers = [f"{host}:{port_base + local}"
               for host, count in zip(hosts, per_node)
               for local in range(count)]
    return ClusterInfo(cluster={_WORKER: workers}, task_type=_WORKER,
                       task_index=rank, source="slurm")
