"""The one process-wide Horovod state: who this rank is, and its communicators.

Horovod's API is module functions (`hvd.init()`, `hvd.rank()`, ...) over one
state per process, so this module holds it; nothing else in tfscale has a
process-wide state. `init()` reads the ranks from the MPI launcher
(`tfscale-run`, `mpirun`, `srun --mpi=pmix`); a script started without one is
size 1 and never starts MPI, as under Horovod.
"""

import contextlib
import dataclasses
import threading
from typing import Optional

from tfscale import _compat
from tfscale.cluster import environment as cluster
from tfscale.cluster import fail_fast
from tfscale.cluster import strategies

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."
CHECKS = ("every", "first")


@dataclasses.dataclass
class State:
    """This rank and its communicators (`comm` None: size 1 without MPI)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool
    comm: object = None        # mpi4py communicator of all ranks
    mpi: object = None         # the mpi4py.MPI module
    watchdog: object = None    # aborts a collective that waits too long
    sequence: int = 0          # collectives issued so far (the same on all)
    # "every": every collective agrees on its arguments first; "first": only
    # the first FIRST_CHECKS calls of each name (TFSCALE_HOROVOD_CHECK).
    check: str = "every"
    checked: dict = dataclasses.field(default_factory=dict)
    joined_at: Optional[int] = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_state: Optional[State] = None


def init(comm=None, process_sets=None) -> None:
    """Starts Horovod on this rank (again: no effect).

    Args:
        comm: None (all ranks) or an mpi4py communicator to run on.
        process_sets: Not offered (raises): tfscale.horovod runs every
            collective on all ranks.

    Raises:
        NotImplementedError: `process_sets` or a list of ranks as `comm`.
        tfscale.cluster.environment.ClusterError: The launcher's environment is
            malformed (e.g. plain `srun` without `--mpi=pmix`).
        ImportError: Started by an MPI launcher but mpi4py is missing.
    """
    global _state
    if process_sets:
        raise NotImplementedError(
            "tfscale.horovod has no process sets: every collective runs on "
            "all ranks (start separate jobs for separate groups)")
    if comm is not None and not hasattr(comm, "Allreduce"):
        raise NotImplementedError(
            "tfscale.horovod.init(comm=...) takes an mpi4py communicator, "
            f"not {type(comm).__name__} (a list of ranks is a process set, "
            "which tfscale.horovod does not offer)")
    # Horovod's TF2 examples call `opt.variables()` on optimizers they
    # never hand to Horovod: from init() on, Keras 3's list answers a call.
    _compat.allow_calling_optimizer_variables()
    if _state is not None:
        return
    info = cluster.resolve_cluster(backend="mpi")
    if comm is None and info.world_size == 1:
        _state = State(rank=0, size=1, local_rank=0, local_size=1,
                       cross_rank=0, cross_size=1, homogeneous=True)
        return
    from tfscale.cluster import mpi as mpi_lib
    timeout = cluster.environment_seconds("HOROVOD_START_TIMEOUT")
    # MPI_Init itself waits for every rank (holding the GIL): a watchdog
    # process ends this rank with one line if they are not all there in
    # time (tfscale-run --start-timeout).
    with (strategies.StartupWatchdog(info, timeout, who="rank") if timeout
          else contextlib.nullcontext()):
        MPI = mpi_lib.import_mpi()
        comm = comm if comm is not None else MPI.COMM_WORLD
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        cross = comm.Split(color=local.rank, key=comm.rank)
        local_sizes = comm.allgather(local.size)
    state = State(rank=comm.rank, size=comm.size, local_rank=local.rank,
                  local_size=local.size, cross_rank=cross.rank,
                  cross_size=cross.size,
                  homogeneous=len(set(local_sizes)) == 1, comm=comm, mpi=MPI,
                  check=cluster.environment_choice(
                      "TFSCALE_HOROVOD_CHECK", CHECKS, "every"))
    local.Free()
    cross.Free()
    stall = cluster.environment_seconds("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    if stall and state.size > 1:
        state.watchdog = mpi_lib.Watchdog(comm, stall)
    if state.size > 1:
        # A rank that dies of an exception aborts the job, as a Horovod
        # rank's failure fails the others (otherwise MPI_Finalize at exit
        # would make the other ranks wait for it in their next collective).
        fail_fast.install(f"rank {comm.rank}", comm.Abort)
    _state = state


def shutdown() -> None:
    """Ends Horovod on this rank (MPI itself ends at exit)."""
    global _state
    _state = None


def is_initialized() -> bool:
    return _state is not None


def get() -> State:
    """The state, or Horovod's error when `init()` was not called.

    Raises:
        ValueError: Not initialized.
    """
    if _state is None:
        raise ValueError(NOT_INITIALIZED)
    return _state


def size() -> int:
    """The number of ranks."""
    return get().size


def rank() -> int:
    """This rank's index, 0 .. size() - 1."""
    return get().rank


def local_size() -> int:
    """The number of ranks on this host."""
    return get().local_size


def local_rank() -> int:
    """This rank's index among the ranks on its host."""
    return get().local_rank


def cross_size() -> int:
    """The number of hosts with a rank of this local rank."""
    return get().cross_size


def cross_rank() -> int:
    """This host's index among the hosts (for this local rank)."""
    return get().cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return get().homogeneous


def mpi_threads_supported() -> bool:
    state = get()
    if state.mpi is None:
        return False
    return state.mpi.Query_thread() == state.mpi.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return get().mpi is not None


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return False
