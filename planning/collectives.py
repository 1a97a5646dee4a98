"""What a collective costs on a system: a latency term plus a bandwidth
term (the alpha-beta model NCCL's tuner uses to pick an algorithm).

Ring all-reduce over R ranks: 2 (R - 1) hops, each moving 1/R of the
buffer, so the bytes term is `2 (R - 1) / R x size / bus bandwidth`
(nccl-tests' bus bandwidth convention) and the latency term is one hop's
latency per step, inter-node hops on the network, the rest inside nodes.
Tree all-reduce (NCCL's double binary tree between nodes, a chain inside
each): about `2 x size / bus bandwidth`, with a latency of a chain plus
log2(nodes) network hops, up and down. "auto" takes the cheaper, as NCCL's
tuner does for each size. ZeRO-1 sends the same bytes as a ring all-reduce,
as a reduce-scatter and an all-gather: twice the base latency.
"""

import math
from typing import Sequence, Tuple

from planning.systems import System

ALGORITHMS = ("ring", "tree", "auto")


def _bandwidth(system: System, nodes: int, bus_bandwidth=None) -> float:
    if bus_bandwidth is not None:
        return bus_bandwidth
    return system.intra_bandwidth if nodes == 1 else system.network_bandwidth


def ring(system: System, nodes: int, size: float,
         bus_bandwidth: float = None) -> float:
    """Seconds of a ring all-reduce of `size` bytes over every GPU of
    `nodes` nodes (`bus_bandwidth` overrides the system's)."""
    ranks = nodes * system.gpus_per_node
    if ranks == 1:
        return 0.0
    hops = (nodes * system.nic_latency if nodes > 1 else 0.0) + \
        (ranks - (nodes if nodes > 1 else 0)) * system.intra_latency
    return (system.base_latency + 2 * hops
            + 2 * (ranks - 1) / ranks * size
            / _bandwidth(system, nodes, bus_bandwidth))


def tree(system: System, nodes: int, size: float,
         bus_bandwidth: float = None) -> float:
    """Seconds of a tree all-reduce (see the module docstring)."""
    ranks = nodes * system.gpus_per_node
    if ranks == 1:
        return 0.0
    hops = ((system.gpus_per_node - 1) * system.intra_latency
            + math.ceil(math.log2(nodes)) * system.nic_latency)
    return (system.base_latency + 2 * hops
            + 2 * size / _bandwidth(system, nodes, bus_bandwidth))


def all_reduce(system: System, nodes: int, size: float,
               algorithm: str = "auto", bus_bandwidth: float = None) -> float:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"--algorithm must be one of {ALGORITHMS}, got "
                         f"{algorithm!r}")
    costs = {"ring": ring(system, nodes, size, bus_bandwidth),
             "tree": tree(system, nodes, size, bus_bandwidth)}
    return min(costs.values()) if algorithm == "auto" else costs[algorithm]


def buffers(size: float, fusion_bytes: float) -> int:
    """All-reduces a step's gradients take, fused into buffers of at most
    `fusion_bytes` (Horovod's tensor fusion, TensorFlow's packing)."""
    return max(1, math.ceil(size / fusion_bytes)) if fusion_bytes else 1


def gradient_sync(system: System, nodes: int, size: float,
                  algorithm: str = "auto", zero1: bool = False,
                  bus_bandwidth: float = None,
                  fusion_bytes: float = 64e6) -> float:
    """Seconds a step spends sending `size` bytes of gradients: all-reduces
    of fused buffers, each paying its latency, or ZeRO-1's reduce-scatter
    then all-gather of the updated weights (the ring's bytes, two
    collectives' base latency)."""
    count = buffers(size, fusion_bytes)
    if zero1 and nodes * system.gpus_per_node > 1:
        return count * (ring(system, nodes, size / count, bus_bandwidth)
                        + system.base_latency)
    return count * all_reduce(system, nodes, size / count, algorithm,
                              bus_bandwidth)


def latency_only(system: System, nodes: int, size: float,
                 algorithm: str = "auto", zero1: bool = False,
                 fusion_bytes: float = 64e6) -> float:
    """The latency part alone of `gradient_sync` for `size` bytes."""
    count = buffers(size, fusion_bytes)
    return count * gradient_sync(system, nodes, 0.0, algorithm, zero1)


def bus_factor(system: System, nodes: int, algorithm: str = "auto") -> float:
    """Bytes over bus bandwidth per byte of buffer: 2 (R - 1) / R for a
    ring, 2 for a tree (the algorithm "auto" picks at a large size)."""
    ranks = nodes * system.gpus_per_node
    ring_factor = 2 * (ranks - 1) / ranks
    if algorithm == "ring" or ranks == 1:
        return ring_factor
    if algorithm == "tree":
        return 2.0
    big = 1e12  # the bandwidth term decides at this size
    return (ring_factor if ring(system, nodes, big) <= tree(system, nodes, big)
            else 2.0)


def fit_link(sizes: Sequence[float], seconds: Sequence[float],
             ranks: int) -> Tuple[float, float]:
    """(latency seconds, bus bandwidth bytes/s) of a measured all-reduce size
    sweep among `ranks` processes, fitted to
    `seconds = latency + 2 (R - 1) / R x size / bandwidth`.

    Least squares on relative errors (each time weighted by its inverse
    square): a sweep's times span orders of magnitude and their noise grows
    with them, so unweighted, 1% of the largest size's time would outweigh
    the latency the small sizes show."""
    if len(sizes) < 2 or len(sizes) != len(seconds):
        raise ValueError("a link fit needs two or more (size, seconds) pairs")
    if min(seconds) <= 0:
        raise ValueError("a link fit needs times above zero")
    factor = 2 * (ranks - 1) / ranks
    xs = [factor * s for s in sizes]
    weights = [1.0 / (y * y) for y in seconds]
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs)) / total
    mean_y = sum(w * y for w, y in zip(weights, seconds)) / total
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs))
    if sxx == 0:
        raise ValueError("a link fit needs two or more distinct sizes")
    slope = sum(w * (x - mean_x) * (y - mean_y)
                for w, x, y in zip(weights, xs, seconds)) / sxx
    if slope <= 0:
        raise ValueError("the sweep's time does not grow with size: no "
                         "bandwidth to fit")
    return max(0.0, mean_y - slope * mean_x), 1.0 / slope
