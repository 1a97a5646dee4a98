r"""The tf.data service against local input, on this host.

    python -m benchmarks.pipelines.data_service --output_dir runs/data_service

For each setup, in turns over --repeats rounds (medians kept), a trainer
process (`data_service_trainer.py`) reads ResNet-50 training batches
(224 px, decode-and-crop, flip, resize, uint8) of the image benchmark's
records into a minimal step:

  local          its own pipeline, as shipped (the global order)
  service_K      a tf.data service of K workers started here
                 (`launch.data_service.Service`: a dispatcher and K worker
                 processes), distributed_epoch, no compression
  service_2_auto the same with 2 workers and compression "auto"

and reports the images/s reaching the step, the trainer's own CPU time
per image (what the service takes off a trainer), and the service
processes' CPU time per image (what it costs them), over the measured
batches. On one host the service and the trainer share the cores: the
service can move the decode, not add cores.
"""

import argparse
import os
import statistics
import time

from benchmarks import harness
from benchmarks.pipelines.image_pipeline import make_records
from launch.data_service import Service
from launch import ports

SETUPS = {"local": (0, "none"), "service_1": (1, "none"),
          "service_2": (2, "none"), "service_2_auto": (2, "auto")}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (and its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(setup: str, files: str, args, round_: int) -> dict:
    workers, compression = SETUPS[setup]
    command = harness.python(
        "benchmarks.pipelines.data_service_trainer", "--files", files,
        "--batch_size", args.batch_size, "--batches", args.batches,
        "--warmup_batches", args.warmup_batches, "--compression",
        compression, "--job_name", f"{setup}-{round_}")
    service, held = None, None
    if workers:
        lines = _Lines()
        held = ports.lease(1)
        service = Service(workers, held.ports[0], lines)
        command += ["--data_service", service.address]
        lines.wait_for(workers + 1)  # serving: TF's import is not counted
    try:
        before = _service_cpu(service)
        output = harness.run(command, timeout=900, what=setup)
        after = _service_cpu(service)
    finally:
        if service:
            service.stop()
            held.close()
    row = harness.last_json(output)
    # The service's CPU from its servers' start to the trainer's end
    # (warm-up batches included), per image the trainer received.
    images = (args.batches + args.warmup_batches) * args.batch_size
    row["service_cpu_ms_per_image"] = 1000 * (after - before) / images
    return row


class _Lines:
    """The service's output, counted: each process says one line once its
    server runs."""

    def __init__(self):
        self.started = 0

    def write(self, text):
        self.started += text.count("tf.data service ")

    def flush(self):
        pass

    def wait_for(self, count, timeout=120):
        deadline = time.monotonic() + timeout
        while self.started < count and time.monotonic() < deadline:
            time.sleep(0.1)


def _service_cpu(service) -> float:
    if service is None:
        return 0.0
    return sum(cpu_seconds(p.pid) for p in service.procs)


def report(rows: dict, args) -> str:
    median = {setup: {key: statistics.median(r[key] for r in runs)
                      for key in runs[0]} for setup, runs in rows.items()}
    local = median["local"]
    lines = [f"tf.data service vs local input, {args.image_size} px, batch "
             f"{args.batch_size}, {os.cpu_count()} cores, median of "
             f"{args.repeats} rounds", "",
             harness.table(
                 ["setup", "images/s", "vs local", "trainer CPU ms/image",
                  "trainer CPU vs local", "service CPU ms/image"],
                 ([setup, f"{m['images_per_second']:.1f}",
                   f"{m['images_per_second'] / local['images_per_second']:.2f}",
                   f"{m['cpu_ms_per_image']:.3f}",
                   f"{local['cpu_ms_per_image'] / m['cpu_ms_per_image']:.1f}x "
                   "less" if setup != "local" else "(baseline)",
                   f"{m['service_cpu_ms_per_image']:.3f}"]
                  for setup, m in median.items()))]
    lines += ["", "Rounds (images/s, trainer CPU ms/image):"]
    for setup, runs in rows.items():
        lines.append(f"- {setup}: " + ", ".join(
            f"{r['images_per_second']:.0f} / {r['cpu_ms_per_image']:.3f}"
            for r in runs))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output_dir", default="runs/data_service",
                   help="folder for report.md and results.json")
    p.add_argument("--records_dir", default="runs/image_pipeline",
                   help="where the image benchmark's records are (made "
                        "there if missing)")
    p.add_argument("--image_size", type=int, default=224,
                   help="image side in pixels")
    p.add_argument("--batch_size", type=int, default=64,
                   help="examples a batch")
    p.add_argument("--batches", type=int, default=100,
                   help="batches timed")
    p.add_argument("--warmup_batches", type=int, default=10,
                   help="batches read first, untimed")
    p.add_argument("--repeats", type=int, default=3,
                   help="times each measurement is repeated")
    p.add_argument("--setups", default=",".join(SETUPS),
                   help="input setups to time, comma-separated")
    args = p.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    files = make_records(args.records_dir, 10, 64)
    setups = [s.strip() for s in args.setups.split(",")]
    if "local" not in setups:
        setups.insert(0, "local")
    rows = {setup: [] for setup in setups}
    for round_ in range(args.repeats):
        for setup in setups:
            started = time.perf_counter()
            row = measure(setup, files, args, round_)
            rows[setup].append(row)
            print(f"round {round_ + 1}: {setup}: "
                  f"{row['images_per_second']:.1f} images/s, trainer "
                  f"{row['cpu_ms_per_image']:.3f} CPU ms/image, service "
                  f"{row['service_cpu_ms_per_image']:.3f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    table = report(rows, args)
    print(table)
    with open(os.path.join(args.output_dir, "data_service.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
