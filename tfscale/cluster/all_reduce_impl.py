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

And before the first collective on NCCL, `load_nccl` loads the NCCL library
as TensorFlow does (its NCCL stub opens `libnccl.so.2` on first use, found
through LD_LIBRARY_PATH, TensorFlow's RUNPATH, which names the
`nvidia-nccl-cu12` wheel's folder, and the system's libraries): a missing
one is one line naming NCCL, where it was looked for and the fix, exit 2,
not TensorFlow's error at the first collective or a start-up wait blamed on
unreachable peers.
"""

import dataclasses
from typing import Dict, Mapping, Optional, Sequence, Tuple

from tfscale.cluster import contract
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
        found = contract.nvidia_smi_listing(nvidia_smi)
        if found is None:
            return ()
        listed = {index: uuid for index, uuid in found if uuid}
    uuids = [e if e.startswith(("GPU-", "MIG-")) else listed.get(e)
             for e in entries]
    return tuple(uuids) if len(uuids) == count and all(uuids) else ()


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
    problem = ("the host's workers share its GPUs (launch.local "
               "--share_gpus, or more workers than GPUs)" if shared else
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


# The library TensorFlow 2.21's NCCL stub opens (`DsoLoader::
# GetNcclDsoHandle`), and the wheel `tensorflow[and-cuda]` 2.21 requires
# for it.
NCCL_LIBRARY = "libnccl.so.2"
NCCL_REQUIREMENT = "nvidia-nccl-cu12>=2.27.7,<3"


@dataclasses.dataclass(frozen=True)
class NcclLibrary:
    """The NCCL library a process loaded: its path (or the bare name the
    system's loader found) and version ("2.27.7"; "" when it has no
    `ncclGetVersion`)."""

    path: str
    version: str


def nccl_places(tensorflow_dir: str, ld_library_path: str) -> list:
    """Where TensorFlow's loader finds `NCCL_LIBRARY`, in its order: the
    folders of LD_LIBRARY_PATH, then TensorFlow's RUNPATH (the
    `nvidia-nccl-cu12` wheel's `site-packages/nvidia/nccl/lib`, seen from
    `tensorflow_dir`), then the bare name (the system's cache and default
    folders)."""
    import os
    places = [os.path.join(folder, NCCL_LIBRARY) for folder in
              (ld_library_path or "").split(os.pathsep) if folder]
    for up in ("..", os.path.join("..", "..")):
        places.append(os.path.normpath(os.path.join(
            tensorflow_dir, up, "nvidia", "nccl", "lib", NCCL_LIBRARY)))
    places.append(NCCL_LIBRARY)
    return list(dict.fromkeys(places))


def nccl_version(code: int) -> str:
    """NCCL's version code (`ncclGetVersion`: major x 10,000 + minor x 100
    + patch since 2.9; major x 1,000 + minor x 100 + patch before) as
    "2.27.7"."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def load_nccl(worker: str, ld_library_path: str = "",
              tensorflow_dir: Optional[str] = None,
              loader=None) -> NcclLibrary:
    """Loads NCCL where TensorFlow would (`nccl_places`).

    Args:
        worker: Who loads it, for the line ("worker 1").
        ld_library_path: The process's LD_LIBRARY_PATH
            (`ClusterInfo.library_path`).
        tensorflow_dir: TensorFlow's package folder (default: the installed
            one's).
        loader: `ctypes.CDLL` (a test's stand-in).

    Raises:
        ConfigError: No place has a library that loads (not restartable:
            another attempt would fail alike).
    """
    import ctypes
    import os
    loader = loader or ctypes.CDLL
    if tensorflow_dir is None:
        import tensorflow as tf
        tensorflow_dir = os.path.dirname(os.path.abspath(tf.__file__))
    places = nccl_places(tensorflow_dir, ld_library_path)
    failures = []
    for place in places:
        if os.sep in place and not os.path.exists(place):
            continue
        try:
            library = loader(place)
        except OSError as e:
            failures.append(f"{place}: {e}")
            continue
        version = ""
        get_version = getattr(library, "ncclGetVersion", None)
        if get_version is not None:
            code = ctypes.c_int(0)
            if get_version(ctypes.byref(code)) == 0 and code.value > 0:
                version = nccl_version(code.value)
        return NcclLibrary(place, version)
    folders = [os.path.dirname(p) for p in places if os.sep in p]
    raise ConfigError(
        "all_reduce_alg",
        f"all-reduce over NCCL: {worker} cannot load NCCL ({NCCL_LIBRARY}, "
        f"looked for in {', '.join(folders)} and the system's libraries"
        + (f"; {failures[-1]}" if failures else "") + "): install it with "
        f'pip install "{NCCL_REQUIREMENT}" (or tfscale\'s [and-cuda] extra; '
        "offline: docs/gpus.md, \"A GPU host without internet\"), or use "
        "--all_reduce_alg=ring")


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


def numerics_words(strategy, precision: str, xla) -> str:
    """"precision float32, XLA off, all-reduce ring (auto), a worker silent
    30 s is held lost": what a user's own Trainer or `model.fit` says at
    its start beside its placement line, as the jobs' banner does."""
    from tfscale.cluster.environment import ClusterConfig
    return (f"precision {precision}, XLA {'on' if xla else 'off'}, "
            f"all-reduce {describe(strategy, ClusterConfig())}")


def describe(strategy, cluster) -> str:
    """What the banner says of a strategy's all-reduce: "nccl (auto)",
    "ring", or, for one worker, the flag (MirroredStrategy's own choice
    across its GPUs)."""
    from tfscale import _compat
    options = _compat.communication_options(strategy)
    name = getattr(getattr(options, "implementation", None), "name", "AUTO")
    chosen = name.lower()
    if name == "AUTO":
        chosen = cluster.all_reduce_alg
    elif cluster.all_reduce_alg == "auto":
        chosen = f"{chosen} (auto)"
    elif chosen != cluster.all_reduce_alg:  # nccl asked, no GPU
        chosen = (f"{chosen} (--all_reduce_alg={cluster.all_reduce_alg}: "
                  "no GPU here)")
    # As TensorFlow's coordination service holds it (--heartbeat_timeout),
    # where the service runs.
    if _compat.coordination_service() is not None:
        timeout_ms = _compat.heartbeat_timeout_ms()
        chosen += (f", a worker silent {timeout_ms / 1000:g} s is held lost"
                   if timeout_ms else ", a worker silent 10 s is held lost "
                   "(TensorFlow's default)")
    return chosen
