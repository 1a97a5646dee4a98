"""Published multi-node results (published.json: each figure with its
source, file and table row) and the projections checked against them:
calibrated on the smallest rows, predicting the rest."""

import dataclasses
import json
import os
from typing import Dict

from planning import calibrate, projection, systems
from planning.workload import Workload, update_estimate

TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "published.json")


def load() -> dict:
    with open(TABLES) as f:
        return json.load(f)


def nvidia_bert(name: str, calibration_rows: int = 2) -> Dict[int, dict]:
    """NVIDIA's TF2 BERT-large table `name`: calibrated on its first
    `calibration_rows` rows; for every row, the predicted and published
    throughput. Assumed: float16 gradients (Horovod's fp16 compression),
    LAMB's update from HBM bandwidth (`update_estimate`), no fixed or
    straggler term, the sync after the step's compute (no overlap)."""
    table = load()[name]
    system = systems.PRESETS[table["system"]]
    rows = [calibrate.Row(r["nodes"], r["accumulation"], r["throughput"])
            for r in table["rows"]]
    workload = Workload(
        parameters=table["parameters"], micro_batch=table["micro_batch"],
        accumulation=rows[0].accumulation, micro_seconds=1.0,
        gradient_bytes=2, update_seconds=update_estimate(
            table["parameters"], system.memory_bandwidth))
    more = rows[1] if calibration_rows > 1 else None
    workload, system = calibrate.from_rows(workload, system, rows[0], more)
    base = rows[0].throughput / rows[0].nodes
    result = {}
    for row in rows:
        gpus = row.nodes * system.gpus_per_node
        predicted = projection.throughput(
            workload.with_accumulation(row.accumulation), system, gpus)
        result[row.nodes] = {
            "published": row.throughput, "predicted": predicted,
            "published_efficiency": row.throughput / (base * row.nodes),
            "predicted_efficiency": predicted / (base * row.nodes),
            "network_efficiency": system.network_efficiency,
            "micro_seconds": workload.micro_seconds}
    return result


# Horovod starts each fused all-reduce while the backward pass goes on: on
# average, the gradients' sync is taken to run beside half of it.
HOROVOD_OVERLAP = 0.5


def horovod(model: str, overlap: float = HOROVOD_OVERLAP) -> dict:
    """Horovod's 512-GPU efficiency for `model`, projected from its
    single-GPU and 16-GPU rows. Assumed: float32 gradients fused into
    64 MB buffers, NCCL's ring (2017's NCCL had no tree), the all-reduces
    hidden behind half of the backward pass (`HOROVOD_OVERLAP`), SGD's
    update folded into the compute, no jitter."""
    data = load()
    small = data["horovod_16_p100"]
    system = systems.PRESETS[small["system"]]
    figures = small["models"][model]
    workload = Workload(parameters=figures["parameters"],
                        micro_batch=small["micro_batch"], accumulation=1,
                        micro_seconds=small["micro_batch"]
                        / figures["single_gpu"], gradient_bytes=4,
                        overlap=overlap)
    plan = projection.Plan(algorithm="ring")
    sixteen = calibrate.Row(16 // system.gpus_per_node, 1, figures["gpus_16"])
    system = dataclasses.replace(system, network_efficiency=(
        calibrate.network_efficiency(sixteen, workload, system, plan)))
    gpus = data["horovod_512_p100"]["gpus"]
    return {"published": data["horovod_512_p100"]["efficiency"][model],
            "predicted": projection.throughput(workload, system, gpus, plan)
            / (gpus * figures["single_gpu"]),
            "network_efficiency": system.network_efficiency,
            "published_16": figures["gpus_16"] / (16 * figures["single_gpu"])}
