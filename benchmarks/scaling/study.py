r"""Scaling report: speedup, efficiency and where the step time goes.

    python -m benchmarks.scaling --model materials_mlp --workers 1,2 \
        --modes weak,strong --variants base,xla,bf16,pack4096 \
        --output_dir runs/scaling

For each variant and mode, trains the model for a fixed number of steps with
1, 2, ... N local workers (through launch.local; each worker gets its share
of the cores as TensorFlow threads, so the comparison is fair) and reports:

- examples/s, speedup over 1 worker (throughput ratio) and parallel
  efficiency (speedup / workers), for weak scaling (fixed per-worker batch)
  and strong scaling (fixed global batch);
- the step time split into input wait, compute, gradient sync and update
  (the Trainer's timed steps);
- gradient all-reduce bandwidth (bytes reduced per step / sync time) next to
  the ring all-reduce bound: 2(N-1) ring steps, each a bidirectional
  exchange of bytes/N between two processes, timed in the same run on the
  backend's own link (TCP loopback for grpc, MPI `Sendrecv` for mpi; see
  benchmarks/scaling/allreduce.py). The older one-way TCP figure (bytes / the
  bandwidth of one TCP stream, which no bidirectional ring step on shared
  cores reaches) is kept as a second column.

Backends (`--backends grpc,mpi`): grpc = MultiWorkerMirroredStrategy through
launch.local, mpi = tfscale's MPI backend through `launch.local --backend
mpi` (Open MPI's default transport on one host: shared memory).

Models: materials_mlp, bert_tiny, gru (synthetic batches in memory) and
resnet50, which reads real JPEG records (patterned images at ImageNet's
sizes, made once in --output_dir/images) through the image pipeline, so its
steps decode, crop and resize while they train.

Variants: base, xla, bf16 (mixed_bfloat16), pack<BYTES> (all-reduce packs),
batch<N> (per-worker batch for weak scaling). Output: report.md, results.csv,
results.json, speedup.png and breakdown.png in --output_dir.
"""

import argparse
import csv
import dataclasses
import json
import os
import socket
import sys
import threading
import time
from typing import List, Optional

from benchmarks import harness
from benchmarks.scaling import allreduce as allreduce_bench

PHASES = ("input_wait", "compute", "sync", "update")
DEFAULT_BATCH = {"materials_mlp": 256, "bert_tiny": 16, "gru": 32,
                 "resnet50": 16}


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str = "base"
    xla: bool = False
    precision: str = "float32"
    bytes_per_pack: int = 0
    per_worker_batch: Optional[int] = None


def parse_variant(text: str) -> Variant:
    """'base' | 'xla' | 'bf16' | 'pack<BYTES>' | 'batch<N>'."""
    if text == "base":
        return Variant()
    if text == "xla":
        return Variant(text, xla=True)
    if text == "bf16":
        return Variant(text, precision="mixed_bfloat16")
    for prefix, field in (("pack", "bytes_per_pack"),
                          ("batch", "per_worker_batch")):
        if text.startswith(prefix) and text[len(prefix):].isdigit():
            return Variant(text, **{field: int(text[len(prefix):])})
    raise ValueError(f"unknown variant {text!r} (base, xla, bf16, pack<BYTES>, "
                     f"batch<N>)")


def measure_loopback_bandwidth(total_bytes: int = 256 << 20,
                               chunk: int = 4 << 20) -> float:
    """Bytes/s of one TCP stream over 127.0.0.1 (the workers' link)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    done = {}

    def receive():
        connection, _ = server.accept()
        buffer = bytearray(chunk)
        received = 0
        while received < total_bytes:
            n = connection.recv_into(buffer)
            if not n:
                break
            received += n
        done["end"] = time.perf_counter()
        connection.close()

    thread = threading.Thread(target=receive)
    thread.start()
    client = socket.create_connection(server.getsockname())
    payload = memoryview(bytearray(chunk))
    start = time.perf_counter()
    for _ in range(total_bytes // chunk):
        client.sendall(payload)
    thread.join()
    client.close()
    server.close()
    return total_bytes / (done["end"] - start)


def ring_allreduce_seconds(nbytes: int, workers: int, bandwidth: float) -> float:
    """Lower bound of a ring all-reduce: 2(N-1)/N x bytes / link bandwidth."""
    if workers <= 1:
        return 0.0
    return 2.0 * (workers - 1) / workers * nbytes / bandwidth


def ring_exchange_bound_seconds(nbytes: int, workers: int,
                                exchange_seconds) -> float:
    """Ring all-reduce bound from the link as a ring step uses it: 2(N-1)
    steps, each a bidirectional exchange of nbytes/N (`exchange_seconds(b)`
    times one exchange of b bytes)."""
    if workers <= 1:
        return 0.0
    return 2.0 * (workers - 1) * exchange_seconds(max(1, nbytes // workers))


def link_exchange_seconds(backend: str, nbytes: int, out_dir: str) -> float:
    """One bidirectional exchange of nbytes between two processes on the
    backend's link: TCP loopback (grpc) or MPI Sendrecv (mpi)."""
    if backend == "grpc":
        return allreduce_bench.tcp_exchange_seconds(nbytes, reps=20)
    row = allreduce_bench.run_transport("mpi_shm", 2, [nbytes], out_dir,
                                        budget=2e8, mpirun_args="")[0]
    return row["link_seconds"]


def analyze(rows: List[dict], bandwidth: float,
            exchange_seconds=None) -> List[dict]:
    """Adds speedup, efficiency and all-reduce figures to each row.

    Rows are grouped by (backend, variant, mode); the 1-worker row of a
    group is its baseline. speedup = examples/s over the baseline's (for
    strong scaling, with the same global batch, that equals the step-time
    ratio). `exchange_seconds(backend, nbytes)` times a bidirectional
    exchange on the backend's link (None: the bound is not computed).
    """
    out = []
    for row in rows:
        backend = row.get("backend", "grpc")
        base = next((r for r in rows if r["variant"] == row["variant"] and
                     r.get("backend", "grpc") == backend and
                     r["mode"] == row["mode"] and r["num_workers"] == 1), None)
        row = dict(row, backend=backend)
        n = row["num_workers"]
        row["speedup"] = (row["examples_per_second"] /
                          base["examples_per_second"]) if base else float("nan")
        row["efficiency"] = row["speedup"] / n
        row["phase_sum"] = sum(row[p] for p in PHASES)
        row["one_way_bound_seconds"] = ring_allreduce_seconds(
            row["gradient_bytes"], n, bandwidth)
        row["ring_bound_seconds"] = (ring_exchange_bound_seconds(
            row["gradient_bytes"], n,
            lambda b: exchange_seconds(backend, b))
            if exchange_seconds and n > 1 else float("nan"))
        if n > 1 and row["sync"] > 0:
            row["allreduce_bandwidth"] = row["gradient_bytes"] / row["sync"]
            row["sync_vs_bound"] = row["ring_bound_seconds"] / row["sync"]
            row["sync_vs_one_way"] = row["one_way_bound_seconds"] / row["sync"]
        else:
            row["allreduce_bandwidth"] = row["sync_vs_bound"] = float("nan")
            row["sync_vs_one_way"] = float("nan")
        out.append(row)
    return out


def run_point(model, workers, global_batch, variant, mode, steps, warmup,
              out_dir, timeout=1800, backend="grpc",
              threads_per_worker=None, model_args=()) -> dict:
    """One measurement: `workers` local workers via launch.local."""
    cores = os.cpu_count() or 1
    threads = threads_per_worker or max(1, cores // workers)
    result = os.path.join(out_dir, f"point-{backend}-{variant.name}-{mode}-"
                                   f"{workers}w-{global_batch}.json")
    launcher = ["--backend", "mpi"] if backend == "mpi" else []
    program = harness.python(
        "benchmarks.scaling.worker",
        "--backend", "mpi" if backend == "mpi" else "mwms",
        "--model", model, "--global_batch_size", global_batch,
        "--steps", steps, "--warmup_steps", warmup,
        "--precision", variant.precision,
        "--bytes_per_pack", variant.bytes_per_pack,
        "--result_file", result, *model_args,
        *(["--xla"] if variant.xla else []))
    harness.run(harness.on_workers(workers, program, threads=threads,
                                   launcher=launcher), timeout=timeout,
                what=f"{backend}, {workers} worker(s), {variant.name}",
                tail=4000)
    with open(result) as f:
        return json.load(f)


def write_outputs(rows, bandwidth, out_dir, title) -> str:
    """report.md, results.csv, results.json, speedup.png, breakdown.png."""
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"link_bandwidth": bandwidth, "rows": rows}, f, indent=2)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"{title}; one TCP stream over loopback "
             f"{bandwidth / 1e9:.2f} GB/s", "",
             harness.table(
                 ["backend", "variant", "mode", "workers", "global batch",
                  "examples/s", "speedup", "efficiency", "step ms", "input",
                  "compute", "sync", "update",
                  "all-reduce MB", "ring bound ms", "bound / sync",
                  "one-way bound / sync", "B_simple", "batch / B_simple"],
                 map(_cells, rows), align="lll" + "r" * 16)]
    lines += ["", "B_simple: the gradient noise scale the Trainer measured "
              "(tfscale/noise/scale.py; needs >= 2 replicas or accumulation "
              "steps). It describes the data: on the synthetic workloads, "
              "one batch repeated, it is not the data set's."]
    report = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(report)
    _plot(rows, out_dir)
    return report


def _cells(r) -> list:
    """One row of report.md's table."""
    value = r.get("gradient_noise_scale")
    noise = (["-", "-"] if not value else
             [f"{value:,.0f}", f"{r['critical_batch_ratio']:.2f}"])
    return [r["backend"], r["variant"], r["mode"], r["num_workers"],
            r["global_batch_size"], f"{r['examples_per_second']:,.0f}",
            f"{r['speedup']:.2f}", f"{r['efficiency']:.2f}",
            f"{1000 * r['step_time']:.1f}",
            *(f"{1000 * r[p]:.1f}" for p in PHASES),
            f"{r['gradient_bytes'] / 1e6:.2f}",
            f"{1000 * r['ring_bound_seconds']:.2f}",
            f"{r['sync_vs_bound']:.3f}", f"{r['sync_vs_one_way']:.3f}", *noise]


def _plot(rows, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["backend"], r["variant"], r["mode"]) for r in rows})
    fig, (ax_s, ax_e) = plt.subplots(1, 2, figsize=(10, 4))
    for backend, variant, mode in groups:
        points = sorted((r for r in rows if (r["backend"], r["variant"],
                                             r["mode"]) ==
                         (backend, variant, mode)),
                        key=lambda r: r["num_workers"])
        n = [r["num_workers"] for r in points]
        ax_s.plot(n, [r["speedup"] for r in points], "o-",
                  label=f"{backend}/{variant}/{mode}")
        ax_e.plot(n, [r["efficiency"] for r in points], "o-",
                  label=f"{backend}/{variant}/{mode}")
    most = max(r["num_workers"] for r in rows)
    ax_s.plot([1, most], [1, most], "k--", linewidth=0.8, label="linear")
    ticks = sorted({r["num_workers"] for r in rows})
    ax_s.set_xticks(ticks)
    ax_e.set_xticks(ticks)
    ax_s.set(xlabel="workers", ylabel="speedup", title="Speedup")
    ax_e.set(xlabel="workers", ylabel="efficiency", title="Parallel efficiency",
             ylim=(0, 1.1))
    ax_s.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "speedup.png"), dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.8), 4))
    labels = [f"{r['backend']}\n{r['variant']}\n{r['mode']}\n"
              f"{r['num_workers']}w" for r in rows]
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        values = [1000 * r[phase] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="ms per step (timed steps)", title="Step time breakdown")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "breakdown.png"), dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="materials_mlp",
                        choices=sorted(DEFAULT_BATCH),
                        help="the model")
    parser.add_argument("--workers", default="1,2",
                        help="worker counts, comma-separated")
    parser.add_argument("--modes", default="weak,strong",
                        help="weak (batch per worker fixed), strong (global "
                             "batch fixed), comma-separated")
    parser.add_argument("--variants", default="base",
                        help="step variants, comma-separated")
    parser.add_argument("--backends", default="grpc",
                        help="grpc (MultiWorkerMirroredStrategy) and/or mpi")
    parser.add_argument("--threads_per_worker", type=int, default=None,
                        help="TF threads per worker (default: cores / "
                             "workers; 1 compares 1 thread per worker with "
                             "1 worker on 1 thread)")
    parser.add_argument("--per_worker_batch", type=int, default=None,
                        help="examples a worker a step (default: the model's)")
    parser.add_argument("--global_batch", type=int, default=None,
                        help="strong scaling batch (default: per-worker x max)")
    parser.add_argument("--steps", type=int, default=50,
                        help="steps timed in each run")
    parser.add_argument("--warmup_steps", type=int, default=10,
                        help="steps run first, untimed (tracing, compilation)")
    parser.add_argument("--output_dir", default="runs/scaling",
                        help="folder for report.md and results.json")
    parser.add_argument("--image_size", type=int, default=224,
                        help="resnet50: side of the images, decoded from "
                             "JPEG records made in --output_dir")
    args = parser.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    if 1 not in workers:
        parser.error("--workers must include 1 (the baseline)")
    modes = args.modes.split(",")
    if not set(modes) <= {"weak", "strong"}:
        parser.error("--modes takes weak and/or strong")
    try:
        variants = [parse_variant(v) for v in args.variants.split(",")]
    except ValueError as e:
        parser.error(str(e))
    backends = args.backends.split(",")
    if not set(backends) <= {"grpc", "mpi"}:
        parser.error("--backends takes grpc and/or mpi")
    os.makedirs(args.output_dir, exist_ok=True)
    bandwidth = measure_loopback_bandwidth()
    model_args = []
    if args.model == "resnet50":
        from benchmarks.pipelines import image_pipeline
        model_args = ["--image_records", image_pipeline.make_records(
            os.path.join(args.output_dir, "images"), 10, 32),
            "--image_size", str(args.image_size)]
    rows = []
    for backend, variant in ((b, v) for b in backends for v in variants):
        per_worker = (variant.per_worker_batch or args.per_worker_batch or
                      DEFAULT_BATCH[args.model])
        for mode in modes:
            for n in workers:
                batch = (per_worker * n if mode == "weak" else
                         args.global_batch or per_worker * max(workers))
                if batch % n:
                    continue
                point = run_point(args.model, n, batch, variant, mode,
                                  args.steps, args.warmup_steps,
                                  args.output_dir, backend=backend,
                                  threads_per_worker=args.threads_per_worker,
                                  model_args=model_args)
                point.update(variant=variant.name, mode=mode, backend=backend)
                rows.append(point)
                print(f"{backend} {variant.name} {mode} {n} worker(s), "
                      f"batch {batch}: "
                      f"{point['examples_per_second']:,.0f} examples/s",
                      flush=True)
    exchanges = {}

    def exchange_seconds(backend, nbytes):
        if (backend, nbytes) not in exchanges:
            exchanges[backend, nbytes] = link_exchange_seconds(
                backend, nbytes, args.output_dir)
        return exchanges[backend, nbytes]

    rows = analyze(rows, bandwidth, exchange_seconds)
    threads = (f"{args.threads_per_worker} thread(s) per worker"
               if args.threads_per_worker else "cores / workers threads each")
    title = (f"{args.model}, {args.steps} steps after {args.warmup_steps} "
             f"warmup, {os.cpu_count()} cores shared by the workers, "
             f"{threads}; command: python -m benchmarks.scaling "
             + " ".join(argv if argv is not None else sys.argv[1:]))
    print(write_outputs(rows, bandwidth, args.output_dir, title))


if __name__ == "__main__":
    main()
