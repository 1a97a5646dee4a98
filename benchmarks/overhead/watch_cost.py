r"""What watching a run costs: a heartbeat, and the chief's gather of every
worker's interval numbers (stragglers), against the step.

    python -m benchmarks.overhead.watch_cost --output_dir runs/watch_cost

Heartbeat: `Heartbeat.beat` (one small file rewritten) timed --beats times
in this process; the Trainer beats twice a call of the step (entering and
leaving it), so that is its cost a call, whatever the steps a call runs.

Gather: 2 workers through `launch.local` (MultiWorkerMirroredStrategy on
this host's CPUs), each calling `collectives.gather` --gathers times with
the numbers `trainer/peers.py` sends (the coordination service's key-value
store); beside it, `agree` (a one-float all-reduce through the strategy)
as the yardstick of a collective. One gather a log interval: its cost a
step is the chief's time / --log_steps. Output: report.md and results.json
in --output_dir.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

from benchmarks import harness


def time_beats(count: int) -> float:
    """Microseconds a `Heartbeat.beat`, the median of 5 runs of `count`."""
    from tfscale.cluster.heartbeat import Heartbeat
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        beat = Heartbeat(os.path.join(folder, "worker-0"))
        for _ in range(5):
            start = time.perf_counter()
            for step in range(count):
                beat.beat("call" if step % 2 else "step", step)
            runs.append((time.perf_counter() - start) / count * 1e6)
    return statistics.median(runs)


def worker(gathers: int, out: str, backend: str) -> None:
    """One worker: times gathers and agrees; the chief writes them."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfscale.cluster import collectives, environment, strategies
    from tfscale.trainer.peers import FIELDS
    info = environment.resolve_cluster(backend=backend)
    strategy = strategies.make_strategy(
        info, environment.ClusterConfig(backend=backend))
    group = collectives.make(backend, strategy)
    numbers = json.dumps({**{f: 0.012345 for f in FIELDS},
                          "timed_steps": 4, "host": "node0000"})
    times = {"gather": [], "agree": []}
    for _ in range(gathers):
        for name, call in (("gather", lambda: group.gather(
                "interval", numbers, 60.0)), ("agree", lambda: group.agree(
                    1.0))):
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    group.barrier()
    if group.is_chief:
        with open(out, "w") as f:
            json.dump(times, f)
    group.leave_together()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default="runs/watch_cost",
                   help="folder for report.md and results.json")
    p.add_argument("--beats", type=int, default=2000,
                   help="heartbeats timed in each of 5 runs")
    p.add_argument("--gathers", type=int, default=200,
                   help="gathers (and agrees) each worker times")
    p.add_argument("--log_steps", type=int, default=100,
                   help="steps a log interval (the jobs' default): one "
                        "gather each")
    p.add_argument("--backend", default="mwms", choices=["mwms", "mpi"],
                   help="mwms: the gather through the coordination "
                        "service's key-value store; mpi: one MPI_Gather")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.gathers, args.worker, args.backend)
    os.makedirs(args.output_dir, exist_ok=True)
    beat_us = time_beats(args.beats)
    raw = os.path.join(args.output_dir, "gathers.json")
    harness.run(harness.on_workers(2, harness.python(
        "benchmarks.overhead.watch_cost", "--gathers", args.gathers,
        "--backend", args.backend, "--worker", raw),
        launcher=["--backend", args.backend]), what="the gathers")
    with open(raw) as f:
        times = json.load(f)
    steady = {k: v[len(v) // 10:] for k, v in times.items()}  # warm-up out
    gather_ms = 1000 * statistics.median(steady["gather"])
    agree_ms = 1000 * statistics.median(steady["agree"])
    results = {
        "heartbeat_us_per_beat": beat_us,
        "heartbeat_us_per_call": 2 * beat_us,
        "gather_ms_per_interval": gather_ms,
        "gather_ms_p90": 1000 * sorted(steady["gather"])[
            int(0.9 * len(steady["gather"]))],
        "agree_ms": agree_ms,
        "gather_us_per_step": 1000 * gather_ms / args.log_steps,
        "log_steps": args.log_steps, "gathers": args.gathers,
        "backend": args.backend}
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    report = harness.table(["what", "cost"], [
        ["heartbeat", f"{beat_us:.1f} us a beat, {2 * beat_us:.1f} us a "
         "call of the step"],
        [f"gather of 2 workers' numbers ({args.backend}; the chief, median)",
         f"{1000 * gather_ms:.1f} us an interval (p90 "
         f"{1000 * results['gather_ms_p90']:.1f}), "
         f"{results['gather_us_per_step']:.2f} us a step at "
         f"{args.log_steps} steps an interval"],
        ["for scale: a one-float all-reduce (`agree`)",
         f"{1000 * agree_ms:.1f} us"]], align="ll") + "\n"
    with open(os.path.join(args.output_dir, "report.md"), "w") as f:
        f.write(report)
    print(report)


if __name__ == "__main__":
    main()
