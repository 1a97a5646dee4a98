"""One worker, its own GPUs: which GPUs a host has and which each worker gets.

A worker that sees every GPU of its host places its replica on GPU 0, so N
workers on one host share one GPU. Each worker must see only its own:
worker i (its index on the host, the "local rank") gets GPUs
i*K .. i*K+K-1 of the host through `CUDA_VISIBLE_DEVICES`, which CUDA reads
when the process first touches a GPU.

    launch.local --gpus_per_worker K   sets it for each worker it starts
    python -m launch.gpus --gpus_per_worker K -- COMMAND ...
                                       sets it for this process from its
                                       local rank and runs COMMAND (mpirun's
                                       ranks, srun tasks without
                                       --gpus-per-task, tfscale-run)

The host's GPUs: `CUDA_VISIBLE_DEVICES` when set (a scheduler's choice is
respected: the worker's GPUs are picked from it), else `nvidia-smi -L`;
none when neither says any.

Never imports TensorFlow.
"""

import argparse
import os
import sys
from typing import List, Mapping, Optional, Sequence

import tfscale.cluster.contract as contract
from tfscale.cluster.contract import (GPUS_BOUND_ENV, LOCAL_RANK_VARIABLES,
                                      local_rank, local_workers)

__all__ = ["LOCAL_RANK_VARIABLES", "host_gpus", "worker_gpus", "local_rank",
           "local_workers", "main"]


def host_gpus(env: Mapping[str, str], nvidia_smi: str = "nvidia-smi"
              ) -> List[str]:
    """The GPUs this host offers: `CUDA_VISIBLE_DEVICES`' entries when set
    ("" or "-1": none), else the indices `nvidia-smi -L` lists."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [g.strip() for g in visible.split(",") if g.strip()]
        return [] if entries in ([], ["-1"]) else entries
    return [index for index, _ in contract.nvidia_smi_listing(nvidia_smi) or []]


def worker_gpus(gpus: Sequence[str], num_workers: int,
                gpus_per_worker: Optional[int]) -> Optional[List[str]]:
    """Each worker's `CUDA_VISIBLE_DEVICES`, or None to leave it alone.

    Args:
        gpus: The host's GPUs (`host_gpus`).
        num_workers: Workers on this host.
        gpus_per_worker: K; None: 1 when the host has GPUs, else leave
            alone; 0: no GPU for any worker (CPU training on a GPU host).

    Raises:
        ValueError: Fewer GPUs than workers x K (the message names the flag).
    """
    if gpus_per_worker is None:
        if not gpus:
            return None
        gpus_per_worker = 1
    if gpus_per_worker < 0:
        raise ValueError(f"--gpus_per_worker must be >= 0, got "
                         f"{gpus_per_worker}")
    if gpus_per_worker == 0:
        return [""] * num_workers
    needed = num_workers * gpus_per_worker
    if needed > len(gpus):
        raise ValueError(
            f"--gpus_per_worker {gpus_per_worker} x {num_workers} worker(s) "
            f"needs {needed} GPUs; this host has {len(gpus)}"
            f"{' (' + ','.join(gpus) + ')' if gpus else ''}")
    return [",".join(gpus[i * gpus_per_worker:(i + 1) * gpus_per_worker])
            for i in range(num_workers)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.gpus",
        description="Runs COMMAND with CUDA_VISIBLE_DEVICES set to this "
                    "process's GPUs: local rank i gets GPUs i*K..i*K+K-1 of "
                    "the host.",
        usage="%(prog)s [--gpus_per_worker K] -- COMMAND ...")
    parser.add_argument("--gpus_per_worker", type=int, default=None,
                        help="K (default: 1 when the host has GPUs)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("put the command after '--'")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    env = dict(os.environ)
    rank = local_rank(env)
    try:
        sets = worker_gpus(host_gpus(env),
                           max(local_workers(env) or 0, rank + 1),
                           args.gpus_per_worker)
    except ValueError as e:
        print(f"launch.gpus: error: local rank {rank}: {e}", file=sys.stderr)
        return 2
    if sets is not None:
        env["CUDA_VISIBLE_DEVICES"] = sets[rank]
        env[GPUS_BOUND_ENV] = "1"
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    sys.exit(main())
