"""The unknowns of a workload solved from measured throughput rows.

A 1-node row gives the micro-batch's seconds: its step time less the
update, the fixed part, the intra-node sync and the straggler term (which
is proportional to the micro-batch). A row on more nodes then gives the
network: what its step time leaves for the sync, turned into the share of
the NICs' line rate (`System.network_efficiency`) that reaches it. Every
other input (parameters, gradient bytes, update, jitter, overlap) is
assumed and stated by the caller.
"""

import dataclasses
from typing import Optional, Tuple

from planning import collectives, projection
from planning.systems import System
from planning.workload import Workload


@dataclasses.dataclass(frozen=True)
class Row:
    """A measured throughput: examples/s on `nodes` nodes with
    `accumulation` micro-batches a step."""
    nodes: int
    accumulation: int
    throughput: float


def step_of(row: Row, workload: Workload, system: System) -> float:
    gpus = row.nodes * system.gpus_per_node
    return gpus * workload.micro_batch * row.accumulation / row.throughput


def micro_seconds(row: Row, workload: Workload, system: System,
                  plan=projection.Plan()) -> float:
    """The micro-batch seconds that reproduce `row` exactly."""
    gpus = row.nodes * system.gpus_per_node
    probe = dataclasses.replace(workload, accumulation=row.accumulation,
                                micro_seconds=1.0, overlap=0.0)
    split = projection.step_split(probe, system, gpus, plan)
    # step = per_micro x m + update + fixed + max(0, sync - hidden x m):
    # compute and straggler scale with the micro-batch, and so does the
    # part of the sync the last backward pass hides.
    per_micro = split["compute"] + split["straggler"]
    hidden = projection.overlap(workload, plan) * workload.backward_share
    rest = (step_of(row, workload, system) - split["update"]
            - split["fixed"] - split["tensors"])
    m = (rest - split["sync"]) / (per_micro - hidden)
    if split["sync"] - hidden * m < 0:  # the sync hides entirely
        m = rest / per_micro
    if m <= 0:
        raise ValueError(f"the row on {row.nodes} node(s) leaves no time "
                         "for compute: its update, fixed, per-tensor or sync "
                         "inputs are too large")
    return m


def network_efficiency(row: Row, workload: Workload, system: System,
                       plan=projection.Plan()) -> float:
    """The share of the NICs' line rate that makes `row` (more than one
    node) take its measured step, within [0.001, 1]."""
    gpus = row.nodes * system.gpus_per_node
    w = workload.with_accumulation(row.accumulation)
    measured = step_of(row, workload, system)

    def faster(efficiency):  # > 0 once the model's step beats the row's
        at = dataclasses.replace(system, network_efficiency=efficiency)
        return measured - projection.step_seconds(w, at, gpus, plan)

    if faster(1.0) <= 0:
        return 1.0
    return projection.solve(faster, 1e-3, 1.0)


def from_rows(workload: Workload, system: System, one_node: Row,
              more_nodes: Optional[Row] = None,
              plan=projection.Plan()) -> Tuple[Workload, System]:
    """The workload with its micro-batch seconds from `one_node`, and the
    system with its network efficiency from `more_nodes` (kept when
    None). The two are solved in turn until they agree."""
    system = dataclasses.replace(system)
    for _ in range(20):
        workload = dataclasses.replace(workload, micro_seconds=micro_seconds(
            one_node, workload, system, plan))
        if more_nodes is None:
            break
        efficiency = network_efficiency(more_nodes, workload, system, plan)
        if abs(efficiency - system.network_efficiency) < 1e-9:
            break
        system = dataclasses.replace(system, network_efficiency=efficiency)
    return workload, system


def link_from_sync(facts, system: System,
                   plan=projection.Plan()) -> System:
    """`system` with the network efficiency at which a gradient sync of
    the run (`workload.RunFacts`: its replicas, its measured sync) takes
    what the run measured; unchanged for a run of one replica or inside
    one node."""
    nodes = projection.nodes_for(system, facts.replicas)
    if facts.replicas < 2 or nodes < 2 or facts.sync_seconds <= 0:
        return system
    size = facts.workload.gradient_size

    def faster(efficiency):  # > 0 once the model's sync beats the run's
        at = dataclasses.replace(system, network_efficiency=efficiency)
        return facts.sync_seconds - collectives.gradient_sync(
            at, nodes, size, plan.algorithm, plan.zero1,
            plan.bus_bandwidth, plan.fusion_bytes)

    if faster(1.0) <= 0:
        return dataclasses.replace(system, network_efficiency=1.0)
    return dataclasses.replace(system, network_efficiency=projection.solve(
        faster, 1e-4, 1.0))
