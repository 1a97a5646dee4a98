r"""All-reduce benchmark: tfscale's backends against the link they run on.

    python -m benchmarks.scaling.allreduce --workers 2,4 \
        --transports grpc,mpi_tcp,mpi_shm --output_dir runs/allreduce

For each transport and process count (all on this host; `--mpirun_args
"--host a,b"` spreads MPI ranks over hosts), each size from 64 KB to 256 MB:

- time of one float32 all-reduce through tfscale's path, in a tf.function
  as the Trainer's step issues it: of one tensor (the TensorFlow boundary
  alone) and of 8 tensors (plus the fusion buffer's concat and split);
  grpc = MultiWorkerMirroredStrategy's collectives, mpi_* = tfscale's MPI
  backend (`tfscale/cluster/mpi.py`) with Open MPI's TCP transport (`--mca btl
  tcp,self`) or its shared memory transport (the default on one host);
- for MPI, a bare mpi4py `Allreduce` of a NumPy buffer of the same size in
  the same run: tfscale / bare is the cost of the TensorFlow boundary; and
  `tfscale.horovod`'s `hvd.allreduce` of the same size, eager and in a
  tf.function, against the same bare figure;
- NCCL-tests conventions: algorithm bandwidth = bytes / time, bus bandwidth
  = algbw x 2(N-1)/N (what each process's link carries in a ring);
- the link measured in the same run as a *bidirectional* exchange of the
  same size between two processes (what one ring step does): MPI `Sendrecv`
  on the same transport, or for grpc a TCP loopback exchange between two
  processes. bus bandwidth / link bandwidth is the fraction of the bound.

Output: report.md and results.json in --output_dir.
"""

import argparse
import json
import multiprocessing
import os
import shlex
import socket
import sys
import threading
import time
from typing import List

from benchmarks import harness

DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M,256M"
TRANSPORTS = {
    "grpc": ("mwms", ""),
    "mpi_tcp": ("mpi", "--mca pml ob1 --mca btl tcp,self"),
    "mpi_shm": ("mpi", ""),
}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text[-1:] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _exchange_peer(port: int, nbytes: int, reps: int):
    connection = socket.create_connection(("127.0.0.1", port))
    _exchange(connection, nbytes, reps)
    connection.close()


def _exchange(connection, nbytes: int, reps: int) -> List[float]:
    """`reps` times: send nbytes and receive nbytes at once."""
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(bytearray(nbytes))
    buffer = memoryview(bytearray(nbytes))
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        sender = threading.Thread(target=connection.sendall, args=(payload,))
        sender.start()
        received = 0
        while received < nbytes:
            received += connection.recv_into(buffer[received:])
        sender.join()
        times.append(time.perf_counter() - start)
    return times[1:]


def tcp_exchange_seconds(nbytes: int, reps: int) -> float:
    """Median time of a bidirectional exchange of nbytes between two
    processes over TCP loopback."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    peer = multiprocessing.get_context("fork").Process(
        target=_exchange_peer, args=(server.getsockname()[1], nbytes, reps))
    peer.start()
    connection, _ = server.accept()
    times = _exchange(connection, nbytes, reps)
    peer.join()
    connection.close()
    server.close()
    times.sort()
    return times[len(times) // 2]


def run_transport(transport: str, workers: int, sizes: List[int],
                  out_dir: str, budget: float, mpirun_args: str) -> List[dict]:
    backend, transport_args = TRANSPORTS[transport]
    result = os.path.join(out_dir, f"{transport}-{workers}.jsonl")
    launcher = []
    if backend == "mpi":
        launcher = ["--backend", "mpi", "--mpirun_args",
                    " ".join(filter(None, [transport_args, mpirun_args]))]
    harness.run(harness.on_workers(workers, harness.python(
        "benchmarks.scaling.allreduce_worker", "--backend", backend,
        "--sizes", ",".join(map(str, sizes)), "--budget_bytes", budget,
        "--result_file", result), launcher=launcher),
        what=f"{transport} x {workers}")
    with open(result) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        row["transport"] = transport
        if transport == "grpc":
            row["link_seconds"] = tcp_exchange_seconds(row["bytes"],
                                                       row["repetitions"])
    return rows


def analyze(rows: List[dict]) -> List[dict]:
    out = []
    for row in rows:
        row = dict(row)
        n, nbytes = row["num_workers"], row["bytes"]
        row["algbw"] = nbytes / row["tfscale_seconds"]
        row["busbw"] = row["algbw"] * 2 * (n - 1) / n
        row["link_bandwidth"] = nbytes / row["link_seconds"]
        row["fraction_of_link"] = row["busbw"] / row["link_bandwidth"]
        row["fused_vs_one"] = row["tfscale_seconds"] / row["fused_seconds"]
        if "bare_seconds" in row:
            row["bare_busbw"] = (nbytes / row["bare_seconds"]) * 2 * (n - 1) / n
            row["tfscale_vs_bare"] = row["bare_seconds"] / row["tfscale_seconds"]
            row["fused_vs_bare"] = row["bare_seconds"] / row["fused_seconds"]
        if "hvd_eager_seconds" in row:
            row["hvd_eager_vs_bare"] = (row["bare_seconds"] /
                                        row["hvd_eager_seconds"])
            row["hvd_graph_vs_bare"] = (row["bare_seconds"] /
                                        row["hvd_graph_seconds"])
        grpc = next((r for r in rows if r["transport"] == "grpc" and
                     r["num_workers"] == n and r["bytes"] == nbytes), None)
        if grpc and row["transport"] != "grpc":
            row["speedup_vs_grpc"] = (grpc["tfscale_seconds"] /
                                      row["tfscale_seconds"])
        out.append(row)
    return out


def _size(nbytes: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def report(rows: List[dict], title: str) -> str:
    def cells(r):
        bare = ([f"{1000 * r['bare_seconds']:.2f}",
                 f"{r['tfscale_vs_bare']:.2f}"] if "bare_seconds" in r
                else ["-", "-"])
        fused = [f"{1000 * r['fused_seconds']:.2f}",
                 f"{r['fused_vs_bare']:.2f}" if "fused_vs_bare" in r
                 else "-"]
        speed = (f"{r['speedup_vs_grpc']:.1f}" if "speedup_vs_grpc" in r
                 else "-")
        return [r["transport"], r["num_workers"], _size(r["bytes"]),
                f"{1000 * r['tfscale_seconds']:.2f}",
                f"{r['algbw'] / 1e9:.3f}", f"{r['busbw'] / 1e9:.3f}",
                f"{r['link_bandwidth'] / 1e9:.3f}",
                f"{r['fraction_of_link']:.2f}", *bare, speed, *fused]

    text = [title, "", harness.table(
        ["transport", "N", "size", "ms", "algbw GB/s", "busbw GB/s",
         "link GB/s", "busbw / link", "bare MPI ms", "tfscale / bare",
         "x grpc", "8 tensors ms", "8 tensors / bare"],
        map(cells, rows))]
    horovod = [r for r in rows if "hvd_eager_seconds" in r]
    if horovod:
        text += ["", "tfscale.horovod's `hvd.allreduce` (one float32 tensor, "
                 "op=Sum) against bare mpi4py in the same run:", "",
                 harness.table(
                     ["transport", "N", "size", "bare MPI ms", "hvd eager ms",
                      "eager / bare", "hvd in tf.function ms",
                      "tf.function / bare"],
                     ([r["transport"], r["num_workers"], _size(r["bytes"]),
                       f"{1000 * r['bare_seconds']:.2f}",
                       f"{1000 * r['hvd_eager_seconds']:.2f}",
                       f"{r['hvd_eager_vs_bare']:.2f}",
                       f"{1000 * r['hvd_graph_seconds']:.2f}",
                       f"{r['hvd_graph_vs_bare']:.2f}"] for r in horovod))]
    return "\n".join(text) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4",
                        help="worker counts, comma-separated")
    parser.add_argument("--transports", default="grpc,mpi_tcp,mpi_shm",
                        help="transports to time, comma-separated: grpc "
                             "(MultiWorkerMirroredStrategy's ring), mpi_tcp, "
                             "mpi_shm")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help="all-reduce sizes in bytes, comma-separated")
    parser.add_argument("--budget_bytes", type=float, default=2e9,
                        help="bytes all-reduced per point (3 to 50 repeats)")
    parser.add_argument("--mpirun_args", default="",
                        help="added to mpirun (e.g. hosts)")
    parser.add_argument("--output_dir", default="runs/allreduce",
                        help="folder for report.md and results.json")
    args = parser.parse_args(argv)
    transports = args.transports.split(",")
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown:
        parser.error(f"unknown transports {unknown}; choose from "
                     f"{sorted(TRANSPORTS)}")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    os.makedirs(args.output_dir, exist_ok=True)
    rows = []
    for transport in transports:
        for workers in (int(w) for w in args.workers.split(",")):
            rows += run_transport(transport, workers, sizes, args.output_dir,
                                  args.budget_bytes, args.mpirun_args)
            print(f"{transport} x {workers} done", flush=True)
    rows = analyze(rows)
    title = (f"All-reduce of float32, median time; {os.cpu_count()} cores; "
             f"command: python -m benchmarks.scaling.allreduce "
             f"{' '.join(shlex.quote(a) for a in (argv or sys.argv[1:]))}")
    text = report(rows, title)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(args.output_dir, "report.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
