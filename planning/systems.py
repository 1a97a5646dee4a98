"""A machine as the projection sees it: GPUs per node, the link between the
GPUs of a node and the network between nodes.

Bandwidths are bytes per second in one direction; latencies are seconds
per hop of a ring. A system file is JSON with the fields of `System`
(`python -m planning --system my.json`); `describe(system)` says what a
preset assumes. The presets' figures are the vendors' data sheets; the
efficiencies (the share of a link a collective reaches) are assumptions,
and the latencies approximate the per-hop figures of NCCL's tuning model
for its Simple protocol (3.4 us a hop on NVLink, 5.7 on PCIe, 14 on the
network, 8.4 us a collective; NVIDIA/nccl src/graph/tuning.cc):

- intra-node `intra_bandwidth`: the bus bandwidth an all-reduce among a
  node's GPUs reaches (nccl-tests' busbw convention, doc/PERFORMANCE.md);
- `nic_bandwidth` x `nics_per_node` x `network_efficiency`: the bus
  bandwidth of an all-reduce across nodes (one ring per NIC, each crossing
  a node boundary once per node), never above the intra-node figure.
"""

import dataclasses
from typing import Dict

from planning import preset_files

GB = 1e9


@dataclasses.dataclass(frozen=True)
class System:
    """One node type, every node alike.

    Attributes:
        name: What the tables print.
        gpu: The accelerator's name.
        gpus_per_node: Accelerators (workers' replicas) in a node.
        peak_tflops: Dense 16-bit peak per GPU (shares of peak).
        memory_bandwidth: HBM bytes/s per GPU (an optimizer update's floor).
        intra_bandwidth: All-reduce bus bandwidth inside a node, bytes/s.
        intra_latency: Seconds per ring hop inside a node.
        nic_bandwidth: One NIC's line rate, bytes/s, one direction.
        nics_per_node: NICs a node's collectives use.
        network_efficiency: Share of the NICs' line rate an all-reduce
            reaches across nodes.
        nic_latency: Seconds per ring hop between nodes.
        base_latency: Seconds a collective costs before its first hop.
    """
    name: str
    gpu: str
    gpus_per_node: int
    peak_tflops: float
    memory_bandwidth: float
    intra_bandwidth: float
    intra_latency: float
    nic_bandwidth: float
    nics_per_node: int
    network_efficiency: float
    nic_latency: float
    base_latency: float = 8.4e-6

    def __post_init__(self):
        for field in ("gpus_per_node", "nics_per_node"):
            if getattr(self, field) < 1:
                raise ValueError(f"system {self.name!r}: {field} must be "
                                 f">= 1, got {getattr(self, field)}")
        for field in ("peak_tflops", "memory_bandwidth", "intra_bandwidth",
                      "nic_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"system {self.name!r}: {field} must be "
                                 f"> 0, got {getattr(self, field)}")
        if not 0 < self.network_efficiency <= 1:
            raise ValueError(f"system {self.name!r}: network_efficiency must "
                             f"be in (0, 1], got {self.network_efficiency}")

    @property
    def network_bandwidth(self) -> float:
        """All-reduce bus bandwidth across nodes, bytes/s."""
        return min(self.intra_bandwidth, self.nic_bandwidth
                   * self.nics_per_node * self.network_efficiency)


PRESETS: Dict[str, System] = {
    # 8 x A100 80GB SXM (NVLink 3: 300 GB/s a direction), 8 x HDR 200 Gb/s.
    "dgx-a100": System(
        "dgx-a100", "A100 80GB SXM", 8, 312.0, 2.04e12,
        intra_bandwidth=230 * GB, intra_latency=3.4e-6,
        nic_bandwidth=25 * GB, nics_per_node=8, network_efficiency=0.9,
        nic_latency=14e-6),
    # 8 x H100 SXM (NVLink 4: 450 GB/s a direction), 8 x NDR 400 Gb/s.
    "dgx-h100": System(
        "dgx-h100", "H100 SXM", 8, 989.0, 3.35e12,
        intra_bandwidth=360 * GB, intra_latency=3.4e-6,
        nic_bandwidth=50 * GB, nics_per_node=8, network_efficiency=0.9,
        nic_latency=14e-6),
    # 16 x V100 32GB (NVSwitch: 150 GB/s a direction), 8 x EDR 100 Gb/s:
    # half a DGX A100's network per node for twice the GPUs.
    "dgx-2h": System(
        "dgx-2h", "V100 32GB SXM3", 16, 130.0, 1.0e12,
        intra_bandwidth=120 * GB, intra_latency=3.4e-6,
        nic_bandwidth=12.5 * GB, nics_per_node=8, network_efficiency=0.9,
        nic_latency=14e-6),
    # 4 x P100 16GB on PCIe 3.0 x16, one 25 Gb/s Ethernet NIC (RoCE): the
    # servers of Horovod's published benchmark.
    "pcie-25gbe": System(
        "pcie-25gbe", "P100 16GB PCIe", 4, 18.7, 0.72e12,
        intra_bandwidth=10 * GB, intra_latency=5.7e-6,
        nic_bandwidth=3.125 * GB, nics_per_node=1, network_efficiency=0.8,
        nic_latency=14e-6),
}


def load(name_or_path: str) -> System:
    """A preset by name, or a JSON file of `System`'s fields."""
    return preset_files.load("--system", name_or_path, PRESETS, System,
                             kind="system", check=_check_units,
                             where=" (UNITS in planning/systems.py)")


def _check_units(path: str, fields: dict) -> None:
    for field, (low, high, unit, example) in UNITS.items():
        value = fields.get(field)
        if isinstance(value, (int, float)) and not low <= value <= high:
            raise ValueError(
                f"{path}: {field} {value:g} is not in {unit} "
                f"({low:g}-{high:g}; {example})")


# Each number field of a system file: (least, most, unit, an example). A
# figure outside is in another unit (GB/s for bytes/s, us for seconds).
UNITS = {
    "gpus_per_node": (1, 1024, "GPUs", "8"),
    "peak_tflops": (0.1, 1e5, "TFLOP/s", "989 for an H100"),
    "memory_bandwidth": (1e9, 1e14, "bytes/s", "3.35e12 for 3.35 TB/s"),
    "intra_bandwidth": (1e6, 1e14, "bytes/s", "360e9 for 360 GB/s"),
    "intra_latency": (0, 1e-2, "seconds", "3.4e-6 for 3.4 us"),
    "nic_bandwidth": (1e6, 1e13, "bytes/s", "50e9 for 400 Gb/s"),
    "nics_per_node": (1, 64, "NICs", "8"),
    "network_efficiency": (1e-3, 1, "a share of the line rate",
                           "0.9 for 90%"),
    "nic_latency": (0, 1e-1, "seconds", "14e-6 for 14 us"),
    "base_latency": (0, 1e-1, "seconds", "8.4e-6 for 8.4 us"),
}


def describe(system: System) -> str:
    return (f"{system.name}: {system.gpus_per_node} x {system.gpu} a node; "
            f"all-reduce {system.intra_bandwidth / GB:.0f} GB/s inside a "
            f"node, {system.network_bandwidth / GB:.1f} GB/s across nodes "
            f"({system.nics_per_node} x {8 * system.nic_bandwidth / GB:.0f}"
            f" Gb/s at {system.network_efficiency:.0%})")


def with_link(system: System, latency: float, bus_bandwidth: float,
              ranks: int) -> System:
    """`system` with the network a measured all-reduce sweep between
    `ranks` hosts gave (`collectives.fit_link`): its bus bandwidth as the
    nodes' (one NIC at that rate, all of it reached), and its latency,
    less a collective's base, spread over the 2 x ranks network hops of a
    ring (`collectives.ring`)."""
    return dataclasses.replace(
        system, name=f"{system.name} (link measured)",
        nic_bandwidth=bus_bandwidth, nics_per_node=1, network_efficiency=1.0,
        nic_latency=max(0.0, latency - system.base_latency) / (2 * ranks))


# The matmul share of a transformer step's GPU time, measured: BERT-base,
# bf16, one XLA program a step on an H200, cuBLAS GEMMs 49% of kernel time
# (benchmarks/README.md, "BERT on one GPU", 2026-11-27).
MATMUL_SHARE = 0.49


@dataclasses.dataclass(frozen=True)
class ComputeMove:
    """A step's compute measured on one system, carried to another: its
    matmul share scales by the peaks' ratio, the rest by the memory
    bandwidths'; the band spans all of it one way or the other."""
    source: System
    target: System
    matmul_share: float

    @property
    def flops_ratio(self) -> float:
        return self.source.peak_tflops / self.target.peak_tflops

    @property
    def bandwidth_ratio(self) -> float:
        return self.source.memory_bandwidth / self.target.memory_bandwidth

    @property
    def ratio(self) -> float:
        """Target time over source time."""
        return (self.matmul_share * self.flops_ratio
                + (1 - self.matmul_share) * self.bandwidth_ratio)

    @property
    def band(self) -> tuple:
        return (min(self.flops_ratio, self.bandwidth_ratio),
                max(self.flops_ratio, self.bandwidth_ratio))

    def describe(self) -> str:
        low, high = self.band
        return (f"compute moved from {self.source.name} ({self.source.gpu})"
                f" to {self.target.name}: {self.matmul_share:.0%} matmul "
                f"(peak {self.source.peak_tflops:g} -> "
                f"{self.target.peak_tflops:g} TFLOP/s), "
                f"{1 - self.matmul_share:.0%} memory-bound (bandwidth "
                f"{self.source.memory_bandwidth / 1e12:.3g} -> "
                f"{self.target.memory_bandwidth / 1e12:.3g} TB/s): time "
                f"x{self.ratio:.3g} (band x{low:.3g}-x{high:.3g}: all "
                "matmul, all memory-bound); the update by the bandwidths")
