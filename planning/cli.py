"""tfscale-plan: what a data-parallel job will do on 8 to 4,096 GPUs.

    tfscale-plan --summary runs/demo/summary.json --system dgx-h100
    tfscale-plan --parameters 336e6 --micro_batch 312 --accumulation 4 \\
        --micro_ms 655 --gradient_dtype float16 --system dgx-a100 --json
    tfscale-plan --parameters 336e6 --micro_batch 312 --gradient_dtype \\
        float16 --system dgx-a100 --measured 1:3803.82:32,2:7551.37:16
    tfscale-plan --system dgx-a100 --parameters 336e6 --gradient_dtype \\
        float16 --results 8:448:16.88:2456496,1024:4096:0.4209:2782046 \\
        --gpus 8,64,1024,4096 --train_batch_per_gpu 4

The workload comes from a finished run's summary.json (any worker count),
from flags, or from throughputs measured on 1 and 2+ nodes (--measured);
a flag given beside --summary overrides the run's figure. The system is a
preset (dgx-a100, dgx-h100, dgx-2h, pcie-25gbe) or a JSON file of
`planning.systems.System`'s fields (bandwidths in bytes/s, latencies in
seconds); the framework (what the software adds to a step: the update's
passes, a cost per gradient tensor, overlap) a preset or a JSON file of
`planning.frameworks.Framework`'s. --link reads an all-reduce sweep of
your own hosts (`python -m tfscale.cluster.link_probe`). Prints what it
assumed, then one row per GPU count: the step's terms, throughput with its
band, weak and strong scaling efficiency, the NIC line rate a node needs
for --target_efficiency, time to the run's target (from its gradient noise
scale), its cost with --gpu_hour_price, and the dominant term.

With --results (two or more runs measured to their target: GPUs, global
batch, minutes, examples or steps) it prints time to train at each of
--gpus instead, at --train_batch or --train_batch_per_gpu: each fitted
term, a band that widens outside the measured batches, and rows there
marked extrapolated (`time_to_train.py`).
"""

import argparse
import dataclasses
import json
import math
import re
import sys
from typing import List, Optional

from planning import (calibrate, collectives, frameworks, projection,
                      systems, time_to_train_cli)
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


def _measured(text: str) -> List[calibrate.Row]:
    """NODES:EXAMPLES_PER_S[:ACCUMULATION],... (at least one row)."""
    rows = []
    for item in text.split(","):
        parts = item.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            nodes, rate = int(parts[0]), float(parts[1])
            accumulation = int(parts[2]) if len(parts) == 3 else 0
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--measured {item!r}: NODES:EXAMPLES_PER_S[:ACCUMULATION], "
                "e.g. 1:3803.82:32,2:7551.37:16") from None
        if nodes < 1 or not rate > 0 or accumulation < 0:
            raise argparse.ArgumentTypeError(
                f"--measured {item!r}: nodes >= 1, examples/s > 0")
        rows.append(calibrate.Row(nodes, accumulation, rate))
    if [r.nodes for r in rows] != sorted({r.nodes for r in rows}):
        raise argparse.ArgumentTypeError(
            f"--measured {text!r}: one row per node count, increasing")
    return rows


def _number(name, low=None, high=None, *, low_open=False, high_open=False,
            unit=""):
    """An argparse type: a float in [low, high] (open ends as asked),
    refused in one line naming the flag and the unit."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--{name} {text!r}: not a number") from None
        bad = (math.isnan(value)
               or (low is not None and (value <= low if low_open
                                        else value < low))
               or (high is not None and (value >= high if high_open
                                         else value > high)))
        if bad:
            left = "(" if low_open else "["
            right = ")" if high_open else "]"
            span = (f"{left}{'-inf' if low is None else f'{low:g}'}, "
                    f"{'inf' if high is None else f'{high:g}'}{right}")
            raise argparse.ArgumentTypeError(
                f"--{name} {text}: must be in {span}"
                + (f" {unit}" if unit else ""))
        return value
    return parse


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag answered in one line naming it (no usage
    block before it)."""

    def error(self, message):
        message = re.sub(r"^argument (--\w+): (?:--\w+ )?", r"\1 ", message)
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv):
    p = _Parser(
        prog="tfscale-plan", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_options(p)
    _add_system_options(p.add_argument_group("the system"))
    _add_workload_options(p.add_argument_group("the workload (default: the run's)"))
    _add_target_options(p.add_argument_group("the target"))
    time_to_train_cli.add_options(p.add_argument_group(
        "time to train from measured results"))
    return p.parse_args(argv)


def _add_run_options(g) -> None:
    """The run the plan starts from, and the output."""
    g.add_argument("--summary", help="a run's summary.json "
                   "(run_pretraining.py, train_image_classifier.py)")
    g.add_argument("--json", action="store_true",
                   help="rows as JSON on stdout")
    g.add_argument("--plot", help="efficiency and time to target against "
                   "GPUs, to this .png (needs matplotlib: the [plot] extra)")


def _add_system_options(g) -> None:
    """The GPUs, their network and the framework."""
    g.add_argument("--system", default="dgx-a100", help="a preset (%s) or "
                   "a .json file of System's fields: gpus_per_node, "
                   "peak_tflops, memory_bandwidth (bytes/s), intra_bandwidth "
                   "(bytes/s), intra_latency (s), nic_bandwidth (bytes/s, one "
                   "NIC, one direction), nics_per_node, network_efficiency "
                   "(0-1], nic_latency (s), base_latency (s)"
                   % ", ".join(systems.PRESETS))
    g.add_argument("--framework", default="tfscale",
                   help="a preset (%s) or a .json file of Framework's fields: "
                   "update_passes, tensor_seconds (s), overlap [0, 1]"
                   % ", ".join(frameworks.PRESETS))
    g.add_argument("--gpus", type=_gpu_counts,
                   default=[2 ** i for i in range(3, 13)],
                   help="GPU counts (default 8,16,...,4096): one node's "
                   "GPUs or fewer, or whole nodes")
    g.add_argument("--measured", type=_measured,
                   help="throughputs measured on this system: "
                   "NODES:EXAMPLES_PER_S[:ACCUMULATION],...; the first row "
                   "gives the micro-batch's time, a second the network's "
                   "efficiency (printed, with a warning if implausible)")
    g.add_argument("--link", help="an all-reduce size sweep of your hosts "
                   "(JSON from python -m tfscale.cluster.link_probe): its "
                   "latency and bus bandwidth replace the system's network")
    g.add_argument("--link_from_run", action="store_true",
                   help="the system's network efficiency from the run's "
                   "measured sync (a --summary run on these links)")
    g.add_argument("--algorithm", choices=collectives.ALGORITHMS,
                   default="auto",
                   help="the all-reduce's algorithm (auto: the faster of "
                        "ring and tree at each size and node count)")
    g.add_argument("--fusion_mb", type=_number("fusion_mb", 0, unit="MB",
                                               low_open=True),
                   default=64.0, help="fused all-reduce buffer, MB")


def _add_workload_options(g) -> None:
    """One step of the model, where no run gives it."""
    g.add_argument("--parameters", type=_number("parameters", 0, unit="parameters",
                                                low_open=True),
                   help="trainable parameters")
    g.add_argument("--micro_batch", type=int,
                   help="examples per GPU per micro-batch")
    g.add_argument("--accumulation", type=int,
                   help="micro-batches per step")
    g.add_argument("--micro_ms", type=_number("micro_ms", 0, low_open=True,
                                             unit="ms"),
                   help="one micro-batch's forward and backward, ms")
    g.add_argument("--compute_scale", type=_number("compute_scale", 0, unit="(a ratio)",
                                                   low_open=True),
                   default=1.0,
                   help="multiplies the micro-batch's and the update's "
                   "time (the target GPU's time over the run's device's)")
    g.add_argument("--compute_from", default=None,
                   help="the system (a preset or .json) the step's compute "
                   "was measured on (--micro_ms, --summary): carried to "
                   "--system, its matmul share by the peaks' ratio, the "
                   "rest by the memory bandwidths' (not with "
                   "--compute_scale)")
    g.add_argument("--matmul_share", type=_number("matmul_share", 0, 1,
                                                  unit="(a share)"),
                   default=systems.MATMUL_SHARE,
                   help="with --compute_from: the share of the step's GPU "
                   "time in matmuls (default %g: BERT-base bf16 measured on "
                   "an H200)" % systems.MATMUL_SHARE)
    g.add_argument("--gradient_dtype", choices=sorted(DTYPE_BYTES),
                   help="on the wire (default: the run's, else float32)")
    g.add_argument("--update_ms", type=_number("update_ms", 0, unit="ms"),
                   help="the optimizer's update, ms (default: measured, "
                   "else the framework's passes at the GPU's memory "
                   "bandwidth)")
    g.add_argument("--fixed_ms", type=_number("fixed_ms", 0, unit="ms"),
                   help="per-step time N does not change, ms")
    g.add_argument("--tensors", type=int, help="gradient tensors a step "
                   "reduces (a framework may pay a cost per tensor)")
    g.add_argument("--jitter", type=_number(
        "jitter", 0, 1, unit="(a coefficient of variation)"),
                   help="a micro-batch's time's coefficient of variation")
    g.add_argument("--carry_jitter", action="store_true",
                   help="keep the run's jitter on another kind of device "
                   "(a CPU run's onto GPUs); by default it is the system's "
                   "(0: not measured there)")
    g.add_argument("--overlap", type=_number("overlap", 0, 1, unit="(a share)"),
                   help="share of the backward pass the sync hides behind "
                   "(default: the framework's; tfscale's step: 0)")
    g.add_argument("--zero1", action="store_true", help="optimizer state "
                   "sharded (reduce-scatter + all-gather, 1/N of the "
                   "update)")


def _add_target_options(g) -> None:
    """What the run must reach, and what it may cost."""
    g.add_argument("--target_efficiency", type=_number(
        "target_efficiency", 0, 1, low_open=True, high_open=True,
        unit="(a share)"),
        default=0.9,
        help="the weak-scaling efficiency the NIC column is for (0.9)")
    g.add_argument("--target_steps", type=_number("target_steps", 0, unit="steps",
                                                  low_open=True),
                   help="steps the run's target took at --target_batch "
                   "(default: the run's)")
    g.add_argument("--target_batch", type=int,
                   help="global batch of --target_steps")
    g.add_argument("--noise_scale", type=_number("noise_scale", 0, unit="examples",
                                                 low_open=True),
                   help="B_noise (default: the run's)")
    g.add_argument("--noise_interval",
                   help="LOW,HIGH of B_noise (HIGH may be 'inf')")
    g.add_argument("--gpu_hour_price", type=_number("gpu_hour_price", 0, unit="a GPU-hour",
                                                    low_open=True),
                   help="price of one GPU for an hour: the cost to the "
                   "target per row")
    g.add_argument("--deadline", type=_number("deadline", 0, low_open=True, unit="hours"),
                   help="hours: the cheapest GPU count that reaches the "
                   "target within them")
    g.add_argument("--vary_batch", action="store_true",
                   help="time each row to the target at its own global "
                   "batch (GPUs x the batch a GPU), through the noise "
                   "scale; default: at --target_batch, split over the "
                   "row's GPUs where it divides (no noise scale needed)")


def _check_args(args, system) -> None:
    """The flags no argparse type can check alone, one line each."""
    for name in ("micro_batch", "accumulation", "target_batch", "tensors"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "tensors" else 1):
            raise ValueError(f"--{name} {value}: must be >= "
                             f"{0 if name == 'tensors' else 1}")
    node = system.gpus_per_node
    partial = [g for g in args.gpus if g > node and g % node]
    if partial:
        raise ValueError(
            f"--gpus {partial[0]}: not whole nodes of {node} GPUs "
            f"({system.name}); give {node} or fewer, or multiples of "
            f"{node} ({partial[0] // node * node} or "
            f"{(partial[0] // node + 1) * node})")
    if args.deadline and not args.gpu_hour_price:
        raise ValueError("--deadline needs --gpu_hour_price (the cheapest "
                         "count is by cost)")
    if args.compute_from and args.compute_scale != 1.0:
        raise ValueError("--compute_from and --compute_scale both move the "
                         "compute: give one")


def _compute_move(args, system) -> Optional[systems.ComputeMove]:
    """--compute_from's move of the measured compute onto `system`."""
    if not args.compute_from:
        return None
    return systems.ComputeMove(systems.load(args.compute_from), system,
                               args.matmul_share)


def _workload(args, system) -> tuple:
    """(workload, target or None, the run's facts or None)."""
    facts = _summary(args.summary) if args.summary else None
    base = facts.workload if facts else None
    given = {"parameters": args.parameters, "micro_batch": args.micro_batch,
             "accumulation": args.accumulation,
             "micro_seconds": args.micro_ms and args.micro_ms / 1e3,
             "update_seconds": (None if args.update_ms is None
                                else args.update_ms / 1e3),
             "fixed_seconds": (None if args.fixed_ms is None
                               else args.fixed_ms / 1e3),
             "jitter": args.jitter, "overlap": args.overlap,
             "tensors": args.tensors,
             "gradient_bytes": (DTYPE_BYTES[args.gradient_dtype]
                                if args.gradient_dtype else None)}
    given = {k: v for k, v in given.items() if v is not None}
    if base is None:
        missing = [f"--{k}" for k in ("parameters", "micro_batch")
                   if k not in given]
        if "micro_seconds" not in given and not args.measured:
            missing.append("--micro_ms (or --measured)")
        if missing:
            raise ValueError(f"without --summary, {', '.join(missing)} "
                             "must be given")
        given.setdefault("accumulation", 1)
        given.setdefault("micro_seconds", 1.0)  # --measured solves it
        workload = Workload(**given)
    else:
        workload = dataclasses.replace(base, **given)
    if facts is not None and args.jitter is None and not args.carry_jitter \
            and _other_device(facts, system):
        # Noise measured on another kind of device is not this system's.
        workload = dataclasses.replace(workload, jitter=0.0)
    move = _compute_move(args, system)
    scale, update_scale = ((move.ratio, move.bandwidth_ratio) if move else
                           (args.compute_scale, args.compute_scale))
    if scale != 1.0:
        workload = dataclasses.replace(
            workload, micro_seconds=workload.micro_seconds * scale,
            update_seconds=(None if workload.update_seconds is None else
                            workload.update_seconds * update_scale))
    return workload, _target(args, facts), facts


def _other_device(facts, system) -> bool:
    """The run computed on another kind of device than the system's (a CPU
    run projected onto GPUs)."""
    on_cpu = "CPU" in system.gpu.upper()
    return facts.device in ("cpu", "gpu") and (facts.device == "cpu") != on_cpu


def _summary(path: str):
    """The run's facts, or ValueError naming --summary and the file."""
    try:
        return from_summary(path)
    except OSError as e:
        raise ValueError(f"--summary {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--summary {path}: not a summary.json (not JSON: "
                         f"{e})") from None
    except ValueError as e:
        message = str(e)
        if message.startswith(path):
            message = message[len(path):].lstrip(": ")
        raise ValueError(f"--summary {path}: {message}") from None


# The band of a noise scale a user typed rather than a run measured: this
# factor either way (tfscale's own measurements of B_simple against the
# critical batch span 1.5-10x, docs/batch-size.md).
UNMEASURED_NOISE = 3.0


def _target(args, facts) -> Optional[projection.Target]:
    noise = args.noise_scale or (facts.noise_scale if facts else None)
    if noise is None and (args.target_steps or args.target_batch):
        if not (args.target_steps and args.target_batch):
            raise ValueError("--target_steps and --target_batch go together "
                             "(the steps a run took to the target, at its "
                             "global batch)")
        # At the target's own batch the steps are the run's: no noise
        # scale; other batches' rows say they need one.
        return projection.Target(args.target_steps, args.target_batch,
                                 None, None)
    if noise is None:
        if args.gpu_hour_price and args.deadline:
            raise ValueError("--deadline needs a time to the target: "
                             "--noise_scale with --target_steps and "
                             "--target_batch (or a --summary that has them)")
        return None
    if facts and facts.noise_interval and not args.noise_scale:
        interval = facts.noise_interval  # the run measured it
    else:
        # Given, not measured: a factor either way (`UNMEASURED_NOISE`).
        interval = (noise / UNMEASURED_NOISE, noise * UNMEASURED_NOISE)
    if args.noise_interval:
        try:
            low, high = args.noise_interval.split(",")
            interval = (float(low), None if high == "inf" else float(high))
        except ValueError:
            raise ValueError(f"--noise_interval {args.noise_interval!r}: "
                             "LOW,HIGH, e.g. 500,2000 or 500,inf") from None
        if not (0 < interval[0] <= noise and (
                interval[1] is None or noise <= interval[1])):
            raise ValueError(
                f"--noise_interval {args.noise_interval}: must hold the "
                f"noise scale ({noise:g}): 0 < LOW <= {noise:g} <= HIGH")
    steps = args.target_steps or (facts.steps if facts else None)
    batch = args.target_batch or (facts.global_batch if facts else None)
    if steps is None or batch is None:
        raise ValueError("--noise_scale needs --target_steps and "
                         "--target_batch (or --summary)")
    return projection.Target(steps, batch, noise, interval)


def _link(path: str) -> tuple:
    """(latency s, bus bandwidth bytes/s, ranks) of an all-reduce sweep
    file."""
    try:
        with open(path) as f:
            sweep = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    missing = [k for k in ("ranks", "sizes", "seconds")
               if not isinstance(sweep, dict) or k not in sweep]
    if missing:
        raise ValueError(f"{path}: no {missing}: a sweep of python -m "
                         "tfscale.cluster.link_probe holds ranks, hosts, "
                         "sizes (bytes) and seconds")
    try:
        return (*collectives.fit_link(sweep["sizes"], sweep["seconds"],
                                      sweep["ranks"]), sweep["ranks"])
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# A calibrated network efficiency outside this range is no wire's: the
# rows hold a per-step cost the model's other terms lack.
PLAUSIBLE_NETWORK = (0.3, 1.0)


def _calibrated(args, workload, system, plan) -> tuple:
    """(workload, system, lines saying what --measured set)."""
    rows = [dataclasses.replace(
        r, accumulation=r.accumulation or workload.accumulation)
        for r in args.measured]
    workload, fitted = calibrate.from_rows(
        workload, system, rows[0], rows[1] if len(rows) > 1 else None, plan)
    lines = [f"calibrated: micro-batch {1e3 * workload.micro_seconds:.1f} ms "
             f"from the {rows[0].nodes}-node row"]
    per_node = [r.throughput / r.nodes for r in rows]
    for row, rate in zip(rows[1:], per_node[1:]):
        if rate > per_node[0] * 1.001:
            lines.append(
                f"warning: the {row.nodes}-node row is faster a node than "
                f"the {rows[0].nodes}-node row ({rate:,.1f} against "
                f"{per_node[0]:,.1f} examples/s): beyond linear scaling, "
                "which no network gives; the network efficiency it sets is "
                "capped at 100%. Check each row's accumulation (a larger "
                "one amortizes the step's fixed costs) and that both rows "
                "measured the same model and batch")
    if len(rows) > 1:
        efficiency = fitted.network_efficiency
        line = (f"calibrated: network efficiency {efficiency:.1%} of the "
                f"NICs' line rate from the {rows[1].nodes}-node row")
        low, high = PLAUSIBLE_NETWORK
        if not low <= efficiency <= high:
            row_step = calibrate.step_of(
                rows[1], workload.with_accumulation(rows[1].accumulation),
                fitted)
            line += (
                f" (outside the {low:.0%}-{high:.0%} a wire reaches: the "
                f"{rows[1].nodes}-node row's {1e3 * row_step:.0f} ms step "
                "holds time the model's update, fixed and per-tensor terms "
                "lack, and the network term absorbed it; give --update_ms, "
                "--fixed_ms, --tensors or --framework)")
        lines.append(line)
    return workload, fitted, lines


def assumptions(workload, system, plan, facts, args) -> List[str]:
    """The lines that say every input the rows rest on."""
    update = projection.update_seconds(workload, system, plan)
    how = ("given" if args.update_ms is not None else
           "measured" if facts and workload.update_seconds is not None else
           f"estimated: {plan.framework.update_passes:g} passes over the "
           f"weights at half of {system.memory_bandwidth / 1e12:.2f} TB/s"
           if plan.framework.update_passes else "inside the compute")
    overlap = projection.overlap(workload, plan)
    spread = projection.Uncertainty()
    dtype = {v: k for k, v in DTYPE_BYTES.items()}.get(
        workload.gradient_bytes, f"{workload.gradient_bytes} B")
    size = workload.gradient_size
    lines = [
        systems.describe(system),
        f"framework: {plan.framework.name} (update passes "
        f"{plan.framework.update_passes}, "
        f"{1e3 * plan.framework.tensor_seconds:.3g} ms a gradient tensor, "
        f"overlap {plan.framework.overlap:.0%})" + (
            "" if plan.framework.measured_on_gpus else
            f"; no multi-node GPU run stands behind its figures yet: the "
            f"throughput band reaches {frameworks.REFERENCE}'s"),
        f"workload: {workload.parameters / 1e6:.1f}M parameters, "
        f"{workload.micro_batch} x {workload.accumulation} examples a GPU, "
        f"micro-batch {1e3 * workload.micro_seconds:.1f} ms; update "
        f"{1e3 * update:.1f} ms ({how}); fixed "
        f"{1e3 * workload.fixed_seconds:.1f} ms; {workload.tensors} "
        f"gradient tensors; jitter {workload.jitter:.3g}; overlap "
        f"{overlap:.0%}",
        f"collectives: {dtype} gradients ({size / 1e6:,.0f} MB a step) in "
        f"{collectives.buffers(size, plan.fusion_bytes)} buffer(s) of "
        f"{plan.fusion_bytes / 1e6:g} MB, algorithm {plan.algorithm}, "
        f"ZeRO-1 {'on' if plan.zero1 else 'off'}; latency "
        f"{1e6 * system.intra_latency:.3g} us a hop inside a node, "
        f"{1e6 * system.nic_latency:.3g} us a hop between nodes, "
        f"{1e6 * system.base_latency:.3g} us a collective",
        f"NIC Gb/s: the line rate a node needs for "
        f"{args.target_efficiency:.0%} weak-scaling efficiency "
        "(--target_efficiency)",
        f"band: compute +-{spread.compute:.0%}, network efficiency "
        f"+-{spread.network:.0%}, jitter x or / {spread.jitter_factor:g}"
        + (", the noise scale's interval" if args.noise_scale or (
            facts and facts.noise_scale) else "")
        + (f" (--noise_scale {args.noise_scale:g} was given, not measured:"
           f" x or / {UNMEASURED_NOISE:g}, unless --noise_interval)"
           if args.noise_scale and not args.noise_interval else "")]
    if args.gpu_hour_price:
        lines.append(f"cost: GPUs x hours to the target x "
                     f"{args.gpu_hour_price:g} a GPU-hour "
                     "(--gpu_hour_price, in its currency)")
    return lines + measured_run_notes(workload, system, facts, args)


def measured_run_notes(workload, system, facts, args) -> List[str]:
    """What the header says of a measured run (--summary) taken onto
    `system`: a jitter not carried across device kinds, a loaded host, a
    CPU's compute."""
    lines = []
    if facts is None:
        return lines
    if _other_device(facts, system):
        lines.append(
            f"jitter: {workload.jitter:.3g} " + (
                f"(the run's, measured on a {facts.device.upper()}: "
                "--carry_jitter)" if args.carry_jitter else
                "(--jitter)" if args.jitter is not None else
                f"(the run's {facts.workload.jitter:.3g} was measured on a "
                f"{facts.device.upper()} and is not carried onto this "
                "system, whose own is not measured; --carry_jitter keeps "
                "it)"))
    if facts.loaded:
        lines.append(
            f"warning: the run's host was loaded (load average "
            f"{facts.host_load[0]:.1f} on {facts.host_load[1]} cores at its "
            "end): its timings hold other work")
    if (facts.device == "cpu" and args.compute_scale == 1.0
            and not args.compute_from
            and "CPU" not in system.gpu.upper()):
        lines.append(
            f"warning: the run's compute was measured on a CPU (its "
            f"summary.json); it is projected onto {system.gpu} as it is: "
            "give --compute_scale (the GPU's time for a micro-batch over "
            "the CPU's)")
    return lines


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "inf"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def add_costs(rows, price: float) -> None:
    """Each row's cost to the target (GPUs x hours x `price`), with its
    band; None where the row has no time to the target."""
    for row in rows:
        if row["time_to_target"] is None:
            row["cost_to_target"] = row["cost_to_target_band"] = None
            continue
        row["cost_to_target"] = row["gpus"] * row["time_to_target"] / 3600 \
            * price
        row["cost_to_target_band"] = [row["gpus"] * t / 3600 * price for t
                                      in row["time_to_target_band"]]


def cheapest(rows, deadline_hours: float, which: int = None
             ) -> Optional[dict]:
    """The cheapest row that reaches the target within the deadline (at
    the band's end `which`, 0 or 1, when given: the noise scale's ends)."""
    def hours(r):
        return (r["time_to_target"] if which is None else
                r["time_to_target_band"][which]) / 3600

    def cost(r):
        return (r["cost_to_target"] if which is None else
                r["cost_to_target_band"][which])
    meeting = [r for r in rows if r["time_to_target"] is not None
               and hours(r) <= deadline_hours]
    return min(meeting, key=cost) if meeting else None


def cheapest_line(rows, deadline_hours: float) -> str:
    """"cheapest within 3 h: 8 GPUs, ..." and, where the answer changes
    across the time's band (an unmeasured noise scale, the step's
    spread), the GPU counts it moves between."""
    best = cheapest(rows, deadline_hours)
    line = f"cheapest within {deadline_hours:g} h: " + (
        f"{best['gpus']} GPUs, {_duration(best['time_to_target'])}, "
        f"{best['cost_to_target']:,.0f}" if best else
        "no GPU count of --gpus reaches the target in time")
    ends = [cheapest(rows, deadline_hours, which) for which in (0, 1)]
    counts = sorted({r["gpus"] for r in ends + [best] if r is not None})
    if len(counts) > 1 or (best is None) != all(e is None for e in ends):
        line += (" (within the band of the time to the target, the answer "
                 "moves between " + ", ".join(f"{n} GPUs" for n in counts)
                 + ": it rests on the noise scale and the step's spread; "
                 "measure the noise scale at the target batch to settle it)")
    return line


def table(rows, target) -> str:
    head = ("GPUs nodes   batch  step ms  compute update fixed tensors  "
            "sync stragl   examples/s (band)          weak strong  NIC "
            "Gb/s dominant")
    if target:
        head += "  to target (band)"
    if rows and "cost_to_target" in rows[0]:
        head += "  cost"
    lines = [head]
    for r in rows:
        s = {k: 1e3 * v for k, v in r["split"].items()}
        low, high = r["throughput_band"]
        nic = r["needed_nic_bandwidth"]
        nic = ("-" if nic == 0 else "never" if nic is None
               else f"{8 * nic / 1e9:.0f}")
        strong = ("     -" if r["strong_efficiency"] is None
                  else f"{r['strong_efficiency']:6.1%}")
        line = (f"{r['gpus']:4d} {r['nodes']:5d} {r['global_batch']:7d} "
                f"{1e3 * r['step_seconds']:8.1f} {s['compute']:8.1f} "
                f"{s['update']:6.1f} {s['fixed']:5.1f} {s['tensors']:7.1f} "
                f"{s['sync']:5.1f} {s['straggler']:6.1f} "
                f"{r['throughput']:11,.0f} ({low:,.0f}-{high:,.0f}) "
                f"{r['weak_efficiency']:6.1%} {strong} {nic:>9} "
                f"{r['dominant_overhead']}")
        if target and r["time_to_target"] is None:
            line += (f"  needs --noise_scale (batch {r['global_batch']}, "
                     f"not the target's {target.global_batch})")
        elif target:
            a, b = r["time_to_target_band"]
            line += (f"  {_duration(r['time_to_target'])} "
                     f"({_duration(a)}-{_duration(b)})")
            line += (f" at {r['target_split']}" if "target_split" in r
                     else f" at batch {r['global_batch']}")
        if r.get("cost_to_target") is not None:
            line += f"  {r['cost_to_target']:,.0f}"
        lines.append(line)
    if any(r["strong_efficiency"] is None for r in rows):
        lines.append(f"strong: '-' where the first count's global batch "
                     f"({rows[0]['global_batch']}) does not split into whole "
                     "examples on every GPU (the batch is never changed)")
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gpus = [r["gpus"] for r in rows]
    timed = any(r.get("time_to_target") is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(
        11 if timed else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(gpus, [r["weak_efficiency"] for r in rows], "o-", label="weak")
    strong = [(g, r["strong_efficiency"]) for g, r in zip(gpus, rows)
              if r["strong_efficiency"] is not None]
    ax.plot([g for g, _ in strong], [e for _, e in strong], "s--",
            label="strong")
    ax.set(xscale="log", xlabel="GPUs", ylabel="scaling efficiency",
           ylim=(0, 1.05), title=title)
    ax.legend()
    if timed:
        ax = axes[0][1]
        known = [r for r in rows if r["time_to_target"] is not None]
        at = [r["gpus"] for r in known]
        hours = [r["time_to_target"] / 3600 for r in known]
        band = [[min(b, 1e9) / 3600 for b in r["time_to_target_band"]]
                for r in known]
        ax.plot(at, hours, "o-")
        ax.fill_between(at, [b[0] for b in band], [b[1] for b in band],
                        alpha=0.3)
        ax.set(xscale="log", yscale="log", xlabel="GPUs",
               ylabel="hours to target", title="time to target")
    fig.tight_layout()
    fig.savefig(path)


def _check_plot_extra() -> None:
    """Raises ValueError (one line) when --plot cannot draw: matplotlib is
    tfscale's [plot] extra (also in [demo])."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which comes with tfscale's [plot] "
            "extra: pip install \".[plot]\" in the checkout") from None


def _time_to_train(args) -> int:
    """--results: time to train at --gpus (`time_to_train_cli.py`)."""
    try:
        system = systems.load(args.system)
        _check_args(args, system)
        plan = projection.Plan(algorithm=args.algorithm, zero1=args.zero1,
                               fusion_bytes=args.fusion_mb * 1e6,
                               framework=frameworks.load(args.framework))
        header, rows, model = time_to_train_cli.run(args, system, plan)
    except (ValueError, OSError) as e:
        print(f"tfscale-plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"system": dataclasses.asdict(system),
                          "model": dataclasses.asdict(model),
                          "assumptions": header,
                          "rows": time_to_train_cli.as_json(rows)},
                         indent=1, default=str))
    else:
        print("\n".join(header))
        print(time_to_train_cli.table(rows, args.gpu_hour_price))
    return 0


def _rows(args, workload, system, plan, target, move) -> list:
    """The table's rows (`projection.project`), their band widened by a
    compute carried from another system, their costs."""
    spread = projection.Uncertainty(compute_range=(
        move.band[0] / move.ratio, move.band[1] / move.ratio)
        if move else (1.0, 1.0))
    rows = projection.project(workload, system, args.gpus, plan,
                              args.target_efficiency, target, spread,
                              hold_batch=not args.vary_batch)
    if args.gpu_hour_price and target is not None:
        add_costs(rows, args.gpu_hour_price)
    return rows


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.results:
        return _time_to_train(args)
    try:
        if args.plot:
            _check_plot_extra()  # before any work, not after the table
        system = systems.load(args.system)
        _check_args(args, system)
        plan = projection.Plan(algorithm=args.algorithm, zero1=args.zero1,
                               fusion_bytes=args.fusion_mb * 1e6,
                               framework=frameworks.load(args.framework))
        link = None
        if args.link:
            link = _link(args.link)
            system = systems.with_link(system, *link)
        workload, target, facts = _workload(args, system)
        if args.link_from_run:
            if facts is None:
                raise ValueError("--link_from_run needs --summary")
            system = calibrate.link_from_sync(facts, system, plan)
        calibration = []
        if args.measured:
            workload, system, calibration = _calibrated(args, workload,
                                                        system, plan)
        move = _compute_move(args, system)
        rows = _rows(args, workload, system, plan, target, move)
    except (ValueError, OSError) as e:
        print(f"tfscale-plan: error: {e}", file=sys.stderr)
        return 2
    header = assumptions(workload, system, plan, facts, args) + calibration
    if move:
        header.append(move.describe())
    if link:
        header.append(f"link measured ({args.link}): {1e6 * link[0]:.0f} us "
                      f"an all-reduce of {link[2]} ranks, bus bandwidth "
                      f"{link[1] / 1e9:.3g} GB/s")
    best = (cheapest(rows, args.deadline) if args.deadline and
            args.gpu_hour_price else None)
    if args.json:
        print(json.dumps({"system": dataclasses.asdict(system),
                          "framework": dataclasses.asdict(plan.framework),
                          "workload": dataclasses.asdict(workload),
                          "plan": dataclasses.asdict(plan),
                          "assumptions": header, "rows": rows,
                          "cheapest_within_deadline": best and best["gpus"]},
                         indent=1, default=str))
    else:
        print("\n".join(header))
        print(table(rows, target))
        if args.deadline and args.gpu_hour_price:
            print(cheapest_line(rows, args.deadline))
    if args.plot:
        plot(rows, args.plot, system.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
