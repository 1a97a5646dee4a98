"""Published multi-node results (published.json: each figure with its
source, file and table row) and the projections checked against them: the
presets as shipped, each table's smallest row giving its micro-batch's
time, predicting the rest."""

import json
import os
from typing import Dict

from planning import calibrate, frameworks, projection, systems
from planning.workload import Workload

TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "published.json")


def load() -> dict:
    with open(TABLES) as f:
        return json.load(f)


def nvidia_bert(name: str, calibration_rows: int = 1) -> Dict[int, dict]:
    """NVIDIA's TF2 BERT-large table `name`: its micro-batch's seconds
    from its 1-node row (and with `calibration_rows` 2 the network's
    efficiency from its second row too); for every row, the predicted and
    published throughput. The system is the table's preset as shipped; the
    framework `horovod-nvidia-tf2` (`frameworks.py`): its update's passes
    over the weights, its cost per gradient tensor; float16 gradients
    (Horovod's fp16 compression), no straggler term, the sync after the
    step's compute."""
    table = load()[name]
    system = systems.PRESETS[table["system"]]
    plan = projection.Plan(framework=frameworks.PRESETS[table["framework"]])
    rows = [calibrate.Row(r["nodes"], r["accumulation"], r["throughput"])
            for r in table["rows"]]
    workload = Workload(
        parameters=table["parameters"], micro_batch=table["micro_batch"],
        accumulation=rows[0].accumulation, micro_seconds=1.0,
        gradient_bytes=2, tensors=table["tensors"])
    more = rows[1] if calibration_rows > 1 else None
    workload, system = calibrate.from_rows(workload, system, rows[0], more,
                                           plan)
    base = rows[0].throughput / rows[0].nodes
    result = {}
    for row in rows:
        gpus = row.nodes * system.gpus_per_node
        predicted = projection.throughput(
            workload.with_accumulation(row.accumulation), system, gpus, plan)
        result[row.nodes] = {
            "published": row.throughput, "predicted": predicted,
            "published_efficiency": row.throughput / (base * row.nodes),
            "predicted_efficiency": predicted / (base * row.nodes),
            "network_efficiency": system.network_efficiency,
            "micro_seconds": workload.micro_seconds}
    return result


def horovod(model: str) -> dict:
    """Horovod's 16-GPU throughput and 512-GPU efficiency for `model`,
    projected from its single-GPU row alone on the `pcie-25gbe` preset as
    shipped, with the framework `horovod-2017` (`frameworks.py`): float32
    gradients fused into 64 MB buffers, NCCL's ring (2017's NCCL had no
    tree), the model's gradient tensors (published.json) each negotiated
    every step, no jitter."""
    data = load()
    small = data["horovod_16_p100"]
    system = systems.PRESETS[small["system"]]
    figures = small["models"][model]
    workload = Workload(parameters=figures["parameters"],
                        micro_batch=small["micro_batch"], accumulation=1,
                        micro_seconds=small["micro_batch"]
                        / figures["single_gpu"], gradient_bytes=4,
                        tensors=figures["tensors"])
    plan = projection.Plan(algorithm="ring",
                           framework=frameworks.PRESETS[small["framework"]])
    gpus = data["horovod_512_p100"]["gpus"]
    return {"published": data["horovod_512_p100"]["efficiency"][model],
            "predicted": projection.throughput(workload, system, gpus, plan)
            / (gpus * figures["single_gpu"]),
            "published_16": figures["gpus_16"],
            "predicted_16": projection.throughput(workload, system, 16,
                                                  plan)}


MLPERF = "mlperf_training_v3_0_h100"


def mlperf(benchmark: str) -> Dict[int, dict]:
    """MLPerf Training v3.0's `benchmark` ("bert" or "resnet") on H100s:
    the time-to-train model (`time_to_train.py`) fitted on the two rows
    published.json names (8 GPUs and one other), on the dgx-h100 preset
    as shipped; for every row, the predicted and published minutes."""
    from planning import time_to_train
    table = load()[MLPERF]
    spec = table["benchmarks"][benchmark]
    system = systems.PRESETS[table["system"]]
    results = {r["gpus"]: time_to_train.Result(
        r["gpus"], r["global_batch"], r["minutes"], r["examples"])
        for r in table["rows"] if r["benchmark"] == benchmark}
    first, other = (results[g] for g in spec["fit_rows"])
    model = time_to_train.fit(system, spec["parameters"],
                              spec["gradient_bytes"], first, other)
    return {gpus: {"published": r.minutes,
                   "predicted": time_to_train.predict(
                       model, system, gpus, r.global_batch),
                   "global_batch": r.global_batch,
                   "per_gpu_batch": r.global_batch / gpus,
                   "model": model}
            for gpus, r in sorted(results.items())}


def mlperf_results(table: str, benchmark: str) -> dict:
    """{GPUs: `time_to_train.Result`} of published.json's MLPerf `table`
    for `benchmark`, with its system preset and the parameters and
    gradient bytes its benchmark names: (results, system, parameters,
    gradient bytes)."""
    from planning import time_to_train
    data = load()[table]
    spec = data["benchmarks"][benchmark]
    results = {r["gpus"]: time_to_train.Result(
        r["gpus"], r["global_batch"], r["minutes"], r["examples"],
        tuple(r.get("kept_minutes", ())))
        for r in data["rows"] if r["benchmark"] == benchmark}
    return (results, systems.PRESETS[data["system"]], spec["parameters"],
            spec["gradient_bytes"])
