"""Each process on its own GPUs, chosen before TensorFlow's runtime starts.

TensorFlow initialises every GPU a process sees and, without memory
growth, maps nearly all of each one's memory. A process that sees more GPUs
than are its own therefore takes its neighbours' memory (out of memory at
start on an 8-GPU node), and a MultiWorkerMirroredStrategy worker puts one
replica on each GPU it sees (8 workers x 8 GPUs: 64 replicas). That happens
wherever nothing bound the GPUs: MPI ranks (`mpirun`, `tfscale-run` without
`--gpus_per_worker`), SLURM tasks of a `--gres=gpu:8` step without
`--gpus-per-task`, `launch.local`'s workers on a host whose `nvidia-smi`
is missing (a container without the driver's utility capability: the
launcher sees no GPU and binds none).

`decide` answers, from what the process can read (how many GPUs it sees,
its local rank, how many processes share its host, whether a launcher
bound or shared the GPUs), which GPUs it keeps; `bind` applies that with
`tf.config.set_visible_devices` (and memory growth where GPUs are shared)
and says so in one line. Where the runtime has already started, nothing
can be changed: one line naming the worker, what it sees and the flag that
binds it (`ConfigError`, exit 2).

    an MPI rank (one replica a process)   the GPU of its local rank
    a worker on a host of L workers,      GPUs r*K .. r*K+K-1, K = G // L
      seeing G >= L GPUs, none bound
    fewer GPUs than processes             shared: memory growth, and the
                                          all-reduce on the ring
    a launcher bound or shared them       left as they are
"""

import dataclasses
from typing import Optional, Tuple

from tfscale.errors import ConfigError

_BIND_HOW = ("launch.local --gpus_per_worker K, tfscale-run "
             "--gpus_per_worker 1, srun --gpus-per-task, or "
             "CUDA_VISIBLE_DEVICES per process")


@dataclasses.dataclass(frozen=True)
class Binding:
    """Which of the GPUs a process sees it keeps.

    Attributes:
        keep: Positions among the GPUs it sees (TensorFlow's GPU:0, ...) to
            keep visible; None keeps them all.
        memory_growth: Allocate GPU memory as needed (GPUs shared with
            other processes).
        shared: Its GPUs are shared with other workers of the host (the
            all-reduce then takes the ring: NCCL refuses two ranks on one
            GPU).
        line: What it says of the choice, or None when nothing changed.
    """

    keep: Optional[Tuple[int, ...]] = None
    memory_growth: bool = False
    shared: bool = False
    line: Optional[str] = None


def _gpus(positions) -> str:
    positions = list(positions)
    if len(positions) == 1:
        return f"GPU:{positions[0]}"
    return f"GPU:{positions[0]}-{positions[-1]}"


def decide(seen: int, *, one_per_process: bool, local_rank: int,
           local_workers: Optional[int], bound: bool = False,
           shared_by_launcher: bool = False,
           worker: str = "worker 0") -> Binding:
    """The GPUs a process keeps.

    Args:
        seen: How many GPUs it sees (after `CUDA_VISIBLE_DEVICES`).
        one_per_process: It runs one replica (an MPI rank); otherwise it
            uses every GPU it keeps (a MultiWorkerMirroredStrategy worker).
        local_rank: Its index on its host.
        local_workers: Processes on its host, when a launcher says (None:
            unknown, taken as 1).
        bound: A launcher gave it its own GPUs (`contract.GPUS_BOUND_ENV`).
        shared_by_launcher: A launcher shares the host's GPUs among its
            workers on purpose (`launch.local --share_gpus`).
        worker: Who it is, for the line ("worker 1", "rank 3").
    """
    if seen == 0:
        return Binding()
    if shared_by_launcher:
        return Binding(memory_growth=True, shared=True)
    others = max((local_workers or 1) - 1, 0)
    if one_per_process:
        if seen == 1:
            if bound or not others:
                return Binding()
            return Binding(memory_growth=True, shared=True, line=(
                f"{worker}: {others + 1} ranks on this host see 1 GPU: they "
                "share it (memory growth on); to give each its own: "
                + _BIND_HOW))
        position = local_rank % seen
        shared = others + 1 > seen
        return Binding(keep=(position,), memory_growth=shared, shared=shared,
                       line=(
            f"{worker} sees {seen} GPUs and runs one replica: it keeps "
            f"{_gpus([position])} (local rank {local_rank})"
            + (f", shared with other ranks ({others + 1} on {seen} GPUs; "
               "memory growth on; to give each its own: " + _BIND_HOW + ")"
               if shared else " and leaves the others to their processes")))
    if bound or not others:
        return Binding()
    if seen >= others + 1:
        per_worker = seen // (others + 1)
        start = (local_rank % (others + 1)) * per_worker
        keep = tuple(range(start, start + per_worker))
        return Binding(keep=keep, line=(
            f"{worker} sees {seen} GPUs, none bound to it, and {others} other "
            f"worker(s) on this host: it keeps {_gpus(keep)} by its local "
            f"rank {local_rank} ({per_worker} a worker); to choose yourself: "
            + _BIND_HOW))
    return Binding(memory_growth=True, shared=True, line=(
        f"{worker}: {others + 1} workers on this host see {seen} GPU"
        f"{'s' if seen != 1 else ''}: they share "
        f"{'it' if seen == 1 else 'them'} (memory growth on, the all-reduce "
        "on the gRPC ring); to give each its own: " + _BIND_HOW))


def bind(info, *, one_per_process: bool, worker: str) -> Binding:
    """Applies `decide` to this process (`info`: its `ClusterInfo`) before
    TensorFlow's runtime starts, and logs its line.

    Raises:
        ConfigError: The runtime has started (a tensor, a dataset or a
            device listing came first) and the process sees GPUs that are
            not its own.
    """
    import tensorflow as tf
    from absl import logging
    physical = tf.config.get_visible_devices("GPU")
    binding = decide(len(physical), one_per_process=one_per_process,
                     local_rank=info.local_rank,
                     local_workers=info.local_workers,
                     bound=info.gpus_bound,
                     shared_by_launcher=info.shares_gpus, worker=worker)
    kept = (physical if binding.keep is None
            else [physical[i] for i in binding.keep])
    try:
        if binding.keep is not None:
            tf.config.set_visible_devices(kept, "GPU")
    except RuntimeError:
        raise ConfigError(
            "gpus", f"{worker} sees {len(physical)} GPUs that are not all "
            "its own, and TensorFlow's runtime started before tfscale could "
            f"keep its own ({binding.line}): bind them before the process "
            f"starts ({_BIND_HOW}), or build the strategy before any tensor "
            "or dataset") from None
    if binding.memory_growth:
        for gpu in kept:
            try:
                tf.config.experimental.set_memory_growth(gpu, True)
            except (RuntimeError, ValueError):
                pass  # started, or split into logical devices: as it is
    if binding.line:
        logging.warning(binding.line)
    return binding
