"""Which implementation MultiWorkerMirroredStrategy's all-reduce uses.

TensorFlow 2.21's `CommunicationImplementation.AUTO` does not pick NCCL on
GPUs: a collective runs as NCCL only when its hint says "nccl" or the
session config sets `collective_nccl`, which MultiWorkerMirroredStrategy
sets only outside eager execution (`collective_all_reduce_strategy.py`,
`_update_config_proto`; the C++ resolver's `AssignCollectiveType`). So
under TF2 "auto" is the gRPC ring through host memory, GPUs or not
(docs/facts.md). tfscale decides itself (`choose`):

  - "auto": NCCL when the worker sees GPUs none of which it shares (a
    launcher's `--share_gpus`, or one GPU split into logical devices),
    else the ring;
  - "nccl": NCCL; refused in one line where GPUs are shared (NCCL would
    fail at step 1); the ring where the worker sees no GPU, as TensorFlow
    does (a GPU cluster's command line run on CPUs), said in the banner;
  - "ring": the ring.

NCCL refuses two ranks on one GPU, and a worker cannot see its peers'
GPUs. So before the first collective, the workers that chose NCCL compare
their GPUs' UUIDs (`gpu_uuids`: a CUDA index means different GPUs in two
processes a scheduler confined to different devices, a UUID never does)
through the coordination service's key-value store (`check_not_shared`):
two workers on one GPU stop with one line naming them, not NCCL's
"Duplicate GPU detected" at step 1. A worker whose UUIDs cannot be read
(no `nvidia-smi`) takes no part in the comparison.
"""

import dataclasses
import re
import subprocess
from typing import Dict, Mapping, Optional, Sequence, Tuple

from tfscale.errors import ConfigError

NCCL, RING = "nccl", "ring"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation (`NCCL` or `RING`) and why."""

    implementation: str
    why: str


def gpu_ids(visible: Optional[str], host: str) -> Tuple[str, ...]:
    """`host/cuda:ID` for each logical GPU this process sees: the entry of
    `CUDA_VISIBLE_DEVICES` (`visible`: an index or a UUID; None: unset)
    behind it, or its index when the variable is unset; a GPU split into
    logical devices appears once per logical device."""
    import tensorflow as tf
    entries = (None if visible is None else
               [e.strip() for e in visible.split(",") if e.strip()])
    ids = []
    for gpu in tf.config.get_visible_devices("GPU"):
        index = int(gpu.name.rsplit(":", 1)[1])
        cuda = (entries[index] if entries is not None and
                index < len(entries) else str(index))
        logical = tf.config.get_logical_device_configuration(gpu) or [gpu]
        ids.extend([f"{host}/cuda:{cuda}"] * len(logical))
    return tuple(ids)


def gpu_uuids(visible: Optional[str], count: int,
              nvidia_smi: str = "nvidia-smi") -> Tuple[str, ...]:
    """The UUIDs of the first `count` CUDA devices this process sees: the
    entries of `CUDA_VISIBLE_DEVICES` (`visible`; None: unset) that are
    UUIDs, the others (indices) looked up in `nvidia-smi -L` (which lists
    the GPUs this process may open, as CUDA numbers them when every one is
    visible); () when any cannot be told."""
    entries = ([str(i) for i in range(count)] if visible is None else
               [e.strip() for e in visible.split(",") if e.strip()][:count])
    listed = {}
    if any(not e.startswith(("GPU-", "MIG-")) for e in entries):
        try:
            out = subprocess.run([nvidia_smi, "-L"], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ()
        for line in out.stdout.splitlines() if out.returncode == 0 else []:
            found = _LISTED.match(line.strip())
            if found:
                listed[found.group(1)] = found.group(2)
    uuids = [e if e.startswith(("GPU-", "MIG-")) else listed.get(e)
             for e in entries]
    return tuple(uuids) if len(uuids) == count and all(uuids) else ()


# A line of `nvidia-smi -L`: "GPU 0: NVIDIA H200 (UUID: GPU-5f0e...)".
_LISTED = re.compile(r"^GPU (\d+): .*\(UUID: ([^)]+)\)")


def choose(requested: str, ids: Sequence[str], shared: bool,
           worker: str) -> Choice:
    """The implementation for a worker that sees the GPUs `ids`
    (`gpu_ids`), asked for `requested` ("auto", "ring", "nccl"); `shared`:
    its launcher says the host's workers share its GPUs
    (`ClusterInfo.shares_gpus`).

    Raises:
        ConfigError: "nccl" where it cannot run.
    """
    repeated = len(set(ids)) < len(ids)
    if requested == RING:
        return Choice(RING, "--all_reduce_alg=ring")
    if not ids:  # TensorFlow too runs an NCCL hint on CPUs as the ring
        return Choice(RING, "it sees no GPU")
    problem = ("its launcher shares the host's GPUs among the workers "
               "(launch.local --share_gpus)" if shared else
               f"it holds two replicas on {_first_repeated(ids)}"
               if repeated else None)
    if requested == NCCL:
        if problem:
            raise ConfigError(
                "all_reduce_alg", f"--all_reduce_alg=nccl: {worker}: {problem}; NCCL needs "
                "one GPU of its own a replica: use --all_reduce_alg=ring "
                "(or auto)")
        return Choice(NCCL, "--all_reduce_alg=nccl")
    if problem:
        return Choice(RING, f"auto: {problem}")
    return Choice(NCCL, "auto: each replica its own GPU")


def _first_repeated(ids: Sequence[str]) -> str:
    seen = set()
    for gpu in ids:
        if gpu in seen:
            return gpu
        seen.add(gpu)
    return ""


def shared_gpu(ids_by_worker: Mapping[int, Sequence[str]]
               ) -> Optional[Tuple[str, Tuple[int, ...]]]:
    """(GPU, the workers that use it) for the first GPU two workers use,
    or None."""
    users: Dict[str, list] = {}
    for worker in sorted(ids_by_worker):
        for gpu in dict.fromkeys(ids_by_worker[worker]):
            users.setdefault(gpu, []).append(worker)
    for gpu, workers in users.items():
        if len(workers) > 1:
            return gpu, tuple(workers)
    return None


KEY = "tfscale/nccl_gpus/{}"


def check_not_shared(service, worker_index: int, num_workers: int,
                     ids: Sequence[str], timeout_seconds: float) -> None:
    """Every worker that chose NCCL calls this before its first collective:
    it publishes its GPUs' UUIDs (`gpu_uuids`; () when unknown) and reads
    its peers' (`service`: the eager context,
    `_compat.coordination_service()`).

    Raises:
        ConfigError: Two workers use one GPU (every worker raises it).
    """
    service.set_config_key_value(KEY.format(worker_index), ",".join(ids))
    ids_by_worker = {worker_index: tuple(ids)}
    for index in range(num_workers):
        if index != worker_index:
            theirs = service.get_config_key_value(
                KEY.format(index), int(timeout_seconds * 1000))
            ids_by_worker[index] = tuple(g for g in theirs.split(",") if g)
    found = shared_gpu(ids_by_worker)
    if found:
        # No worker leaves before every worker has read every worker's
        # GPUs (worker 0 holds the coordination service). The barrier's
        # answer itself may be lost when worker 0 leaves first: every
        # worker knows the verdict by then.
        import tensorflow as tf
        try:
            service.wait_at_barrier("tfscale/nccl_gpus",
                                    int(timeout_seconds * 1000))
        except tf.errors.OpError:
            pass
        gpu, workers = found
        names = " and ".join(f"worker {w}" for w in workers)
        raise ConfigError(
            "all_reduce_alg",
            f"all-reduce over NCCL: {names} both use the GPU {gpu}; NCCL "
            "needs one GPU of its own a replica: give each worker its own "
            "(CUDA_VISIBLE_DEVICES, launch.local --gpus_per_worker) or use "
            "--all_reduce_alg=ring (launch.local --share_gpus runs the "
            "workers on one GPU with it)")


def describe(strategy, cluster) -> str:
    """What the banner says of a strategy's all-reduce: "nccl (auto)",
    "ring", or, for one worker, the flag (MirroredStrategy's own choice
    across its GPUs)."""
    from tfscale import _compat
    options = _compat.communication_options(strategy)
    name = getattr(getattr(options, "implementation", None), "name", "AUTO")
    if name == "AUTO":
        return cluster.all_reduce_alg
    chosen = name.lower()
    if cluster.all_reduce_alg == "auto":
        return f"{chosen} (auto)"
    if chosen != cluster.all_reduce_alg:  # nccl asked, no GPU
        return (f"{chosen} (--all_reduce_alg={cluster.all_reduce_alg}: "
                "no GPU here)")
    return chosen
