"""tfscale-plan: what a data-parallel job will do on 8 to 4,096 GPUs.

    tfscale-plan --summary runs/demo/summary.json --system dgx-h100
    tfscale-plan --parameters 336e6 --micro_batch 312 --accumulation 4 \\
        --micro_ms 655 --gradient_dtype float16 --system dgx-a100 --json

The workload comes from a finished run's summary.json (any worker count)
or from flags; a flag given beside --summary overrides the run's figure.
The system is a preset (dgx-a100, dgx-h100, dgx-2h, pcie-25gbe) or a JSON
file of `planning.systems.System`'s fields. Prints one row per GPU count:
the step's terms, throughput with its band, weak and strong scaling
efficiency, the NIC line rate a node needs for --target_efficiency, time to
the run's target (from its gradient noise scale), and the dominant term.
"""

import argparse
import dataclasses
import json
import math
import sys
from typing import List, Optional

from planning import calibrate, collectives, projection, systems
from planning.workload import DTYPE_BYTES, Workload, from_summary


def _gpu_counts(text: str) -> List[int]:
    try:
        counts = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: comma-separated "
                                         "integers, e.g. 8,64,512") from None
    if not counts or min(counts) < 1 or counts != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: increasing "
                                         "counts >= 1")
    return counts


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="tfscale-plan", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summary", help="a run's summary.json "
                   "(run_pretraining.py, train_image_classifier.py)")
    p.add_argument("--system", default="dgx-a100", help="a preset (%s) or "
                   "a .json file" % ", ".join(systems.PRESETS))
    p.add_argument("--gpus", type=_gpu_counts,
                   default=[2 ** i for i in range(3, 13)],
                   help="GPU counts (default 8,16,...,4096)")
    p.add_argument("--parameters", type=float, help="trainable parameters")
    p.add_argument("--micro_batch", type=int,
                   help="examples per GPU per micro-batch")
    p.add_argument("--accumulation", type=int,
                   help="micro-batches per step")
    p.add_argument("--micro_ms", type=float, help="one micro-batch's "
                   "forward and backward, ms")
    p.add_argument("--compute_scale", type=float, default=1.0,
                   help="multiplies the micro-batch's and the update's "
                   "time (the run's device against the target GPU)")
    p.add_argument("--gradient_dtype", choices=sorted(DTYPE_BYTES),
                   help="on the wire")
    p.add_argument("--update_ms", type=float,
                   help="the optimizer's update, ms")
    p.add_argument("--fixed_ms", type=float,
                   help="per-step time N does not change, ms")
    p.add_argument("--jitter", type=float, help="a micro-batch's time's "
                   "coefficient of variation")
    p.add_argument("--overlap", type=float, help="share of the backward "
                   "pass the sync hides behind (0: tfscale's step)")
    p.add_argument("--algorithm", choices=collectives.ALGORITHMS,
                   default="auto")
    p.add_argument("--zero1", action="store_true", help="optimizer state "
                   "sharded (reduce-scatter + all-gather, 1/N of the "
                   "update)")
    p.add_argument("--fusion_mb", type=float, default=64.0,
                   help="fused all-reduce buffer, MB")
    p.add_argument("--link_from_run", action="store_true",
                   help="the system's network efficiency from the run's "
                   "measured sync (a --summary run on these links)")
    p.add_argument("--target_efficiency", type=float, default=0.9)
    p.add_argument("--target_steps", type=float, help="steps the run's "
                   "target took at --target_batch (default: the run's)")
    p.add_argument("--target_batch", type=int,
                   help="global batch of --target_steps")
    p.add_argument("--noise_scale", type=float,
                   help="B_noise (default: the run's)")
    p.add_argument("--noise_interval",
                   help="LOW,HIGH of B_noise (HIGH may be 'inf')")
    p.add_argument("--json", action="store_true",
                   help="rows as JSON on stdout")
    p.add_argument("--plot", help="efficiency and time to target against "
                   "GPUs, to this .png (needs matplotlib)")
    return p.parse_args(argv)


def _workload(args) -> tuple:
    """(workload, target or None, the run's facts or None)."""
    facts = from_summary(args.summary) if args.summary else None
    base = facts.workload if facts else None
    given = {"parameters": args.parameters, "micro_batch": args.micro_batch,
             "accumulation": args.accumulation,
             "micro_seconds": args.micro_ms and args.micro_ms / 1e3,
             "update_seconds": args.update_ms and args.update_ms / 1e3,
             "fixed_seconds": args.fixed_ms and args.fixed_ms / 1e3,
             "jitter": args.jitter, "overlap": args.overlap,
             "gradient_bytes": (DTYPE_BYTES[args.gradient_dtype]
                                if args.gradient_dtype else None)}
    given = {k: v for k, v in given.items() if v is not None}
    if base is None:
        missing = [f"--{k}" for k in ("parameters", "micro_batch")
                   if k not in given]
        if "micro_seconds" not in given:
            missing.append("--micro_ms")
        if missing:
            raise ValueError(f"without --summary, {', '.join(missing)} "
                             "must be given")
        given.setdefault("accumulation", 1)
        workload = Workload(**given)
    else:
        workload = dataclasses.replace(base, **given)
    workload = dataclasses.replace(
        workload, micro_seconds=workload.micro_seconds * args.compute_scale,
        update_seconds=workload.update_seconds * args.compute_scale)
    return workload, _target(args, facts), facts


def _target(args, facts) -> Optional[projection.Target]:
    noise = args.noise_scale or (facts.noise_scale if facts else None)
    if noise is None:
        return None
    interval = (facts.noise_interval if facts and facts.noise_interval
                else (noise, noise))
    if args.noise_interval:
        low, high = args.noise_interval.split(",")
        interval = (float(low), None if high == "inf" else float(high))
    steps = args.target_steps or (facts.steps if facts else None)
    batch = args.target_batch or (facts.global_batch if facts else None)
    if steps is None or batch is None:
        raise ValueError("--noise_scale needs --target_steps and "
                         "--target_batch (or --summary)")
    return projection.Target(steps, batch, noise, interval)


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "inf"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def table(rows, target) -> str:
    head = ("GPUs nodes   batch  step ms  compute update fixed  sync "
            "stragl   examples/s (band)          weak strong  NIC Gb/s "
            "dominant")
    if target:
        head += "  to target (band)"
    lines = [head]
    for r in rows:
        s = {k: 1e3 * v for k, v in r["split"].items()}
        low, high = r["throughput_band"]
        nic = r["needed_nic_bandwidth"]
        nic = ("-" if nic == 0 else "never" if nic is None
               else f"{8 * nic / 1e9:.0f}")
        line = (f"{r['gpus']:4d} {r['nodes']:5d} {r['global_batch']:7d} "
                f"{1e3 * r['step_seconds']:8.1f} {s['compute']:8.1f} "
                f"{s['update']:6.1f} {s['fixed']:5.1f} {s['sync']:5.1f} "
                f"{s['straggler']:6.1f} {r['throughput']:11,.0f} "
                f"({low:,.0f}-{high:,.0f}) {r['weak_efficiency']:6.1%} "
                f"{r['strong_efficiency']:6.1%} {nic:>9} "
                f"{r['dominant_overhead']}")
        if target:
            a, b = r["time_to_target_band"]
            line += (f"  {_duration(r['time_to_target'])} "
                     f"({_duration(a)}-{_duration(b)})")
        lines.append(line)
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gpus = [r["gpus"] for r in rows]
    timed = "time_to_target" in rows[0]
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(
        11 if timed else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(gpus, [r["weak_efficiency"] for r in rows], "o-", label="weak")
    ax.plot(gpus, [r["strong_efficiency"] for r in rows], "s--",
            label="strong")
    ax.set(xscale="log", xlabel="GPUs", ylabel="scaling efficiency",
           ylim=(0, 1.05), title=title)
    ax.legend()
    if timed:
        ax = axes[0][1]
        hours = [r["time_to_target"] / 3600 for r in rows]
        band = [[min(b, 1e9) / 3600 for b in r["time_to_target_band"]]
                for r in rows]
        ax.plot(gpus, hours, "o-")
        ax.fill_between(gpus, [b[0] for b in band], [b[1] for b in band],
                        alpha=0.3)
        ax.set(xscale="log", yscale="log", xlabel="GPUs",
               ylabel="hours to target", title="time to target")
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        system = systems.load(args.system)
        workload, target, facts = _workload(args)
        if args.link_from_run:
            if facts is None:
                raise ValueError("--link_from_run needs --summary")
            system = calibrate.link_from_sync(facts, system)
        plan = projection.Plan(algorithm=args.algorithm, zero1=args.zero1,
                               fusion_bytes=args.fusion_mb * 1e6)
        rows = projection.project(workload, system, args.gpus, plan,
                                  args.target_efficiency, target)
    except (ValueError, OSError) as e:
        print(f"tfscale-plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"system": dataclasses.asdict(system),
                          "workload": dataclasses.asdict(workload),
                          "plan": dataclasses.asdict(plan), "rows": rows},
                         indent=1))
    else:
        print(systems.describe(system))
        print(f"workload: {workload.parameters / 1e6:.1f}M parameters, "
              f"{workload.micro_batch} x {workload.accumulation} examples "
              f"a GPU, micro-batch {1e3 * workload.micro_seconds:.1f} ms")
        print(table(rows, target))
    if args.plot:
        plot(rows, args.plot, system.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
