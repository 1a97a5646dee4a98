"""tfscale-plan's time to train from measured results (`--results`):
the flags, what they are checked against, the header that says every
fitted term and the band's rules, and the table (`time_to_train.py` does
the arithmetic).

    tfscale-plan --system dgx-a100 --parameters 336e6 --gradient_dtype float16 \\
        --results 8:448:16.88:2456496,1024:4096:0.4209:2782046 \\
        --gpus 8,64,1024,4096 --train_batch_per_gpu 4
"""

import argparse
import math
from typing import List

from planning import time_to_train
from planning.workload import DTYPE_BYTES


def results(text: str) -> List[time_to_train.Result]:
    """GPUS:GLOBAL_BATCH:MINUTES:EXAMPLES (or ...:steps=STEPS),...; MINUTES
    one figure or each run's, M1/M2/... (their mean the result's time,
    their largest distance from it its run-to-run spread)."""
    parsed = []
    for item in text.split(","):
        parts = item.split(":")
        try:
            if len(parts) != 4:
                raise ValueError
            gpus, batch = int(parts[0]), int(parts[1])
            runs = tuple(float(m) for m in parts[2].split("/"))
            minutes = sum(runs) / len(runs)
            if parts[3].startswith("steps="):
                examples = float(parts[3][len("steps="):]) * batch
            else:
                examples = float(parts[3])
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--results {item!r}: GPUS:GLOBAL_BATCH:MINUTES:EXAMPLES "
                "(or ...:steps=STEPS; MINUTES one figure or each run's, "
                "M1/M2/...), e.g. 8:448:16.46/16.88/17.50:2456496") from None
        if gpus < 1 or batch < 1 or not all(
                0 < m < math.inf for m in runs) or not (
                0 < examples < math.inf):
            raise argparse.ArgumentTypeError(
                f"--results {item!r}: GPUs >= 1, a global batch >= 1 "
                "example, minutes > 0 and examples > 0")
        parsed.append(time_to_train.Result(
            gpus, batch, minutes, examples, runs if len(runs) > 1 else ()))
    return parsed


def add_options(g) -> None:
    """--results and the batch to train at."""
    g.add_argument("--results", type=results,
                   help="results measured to the target, "
                   "GPUS:GLOBAL_BATCH:MINUTES:EXAMPLES (or "
                   "...:steps=STEPS),...: two or more give time to train "
                   "at --gpus (with --parameters, --gradient_dtype); "
                   "MINUTES as each run's, M1/M2/..., sets the band from "
                   "their spread")
    g.add_argument("--train_batch", type=int,
                   help="with --results: the global batch (examples) at "
                   "every GPU count")
    g.add_argument("--train_batch_per_gpu", type=int,
                   help="with --results: examples per GPU a step (the "
                   "global batch grows with the GPUs)")


def header(model, system, plan, measured) -> List[str]:
    """What the rows rest on: the system, the fitted terms with their
    units and sources, the measured range, the band's rules."""
    low_b, high_b = model.batches
    low_g, high_g = model.per_gpu
    noise = ("inf (the examples did not grow with the batch)"
             if math.isinf(model.b_noise) else f"{model.b_noise:,.0f} "
             "examples")
    if model.one_per_gpu is not None:
        step = (f"  a step: {1e3 * model.t0:.2f} ms of compute at "
                f"{model.one_per_gpu:g} examples a GPU (every result ran "
                "that batch per GPU: its fixed and per-example parts are "
                "not told apart, so only that batch per GPU is predicted)")
    else:
        step = (f"  a step: t0 {1e3 * model.t0:.2f} ms fixed + "
                f"{1e3 * model.t1:.3f} ms an example a GPU (least squares "
                "of each result's step time less its sync)")
    fit = (f"{len(measured)} results, 4 terms: an exact fit; nothing "
           "checked it" if model.exact else
           f"the fit's largest residual {model.residual:.1%} over "
           f"{len(measured)} results")
    return [
        f"system: {system.name} ({system.gpus_per_node} GPUs a node); "
        f"sync by the collective model, algorithm {plan.algorithm}, "
        f"{model.gradient_bytes} B a gradient element",
        f"fitted from {len(measured)} results (" + ", ".join(
            f"{r.gpus} GPUs at batch {r.global_batch}: {r.minutes:g} min, "
            f"{r.examples:,.0f} examples" for r in measured) + ")",
        step,
        f"  examples to the target: E(B) = E_min (1 + B / B_noise), E_min "
        f"{model.e_min:,.0f} examples, B_noise {noise} (McCandlish et "
        "al. 2018, arXiv:1812.06162)",
        f"  measured: global batch {low_b:,.0f}-{high_b:,.0f} examples, "
        f"per GPU {low_g:g}-{high_g:g}; {fit}",
        f"band: inside the measured range +-{model.floor:.1%} ("
        + _floor_words(model, measured) + "); past the largest batch, "
        "examples up to steps as at it (maximal data parallelism, Shallue "
        "et al. 2019, arXiv:1811.03600), below the smallest up to its "
        "examples; a step past the measured batch per GPU between the "
        "edge's time and the edge's time per example, likewise below; "
        "rows outside are marked extrapolated"]


def _floor_words(model, measured) -> str:
    """Where the band's floor inside the measured range comes from."""
    if model.residual > model.spread:
        return "the fit's largest residual, above the runs' spread"
    if model.spread_measured:
        return ("the results' run-to-run spread: the largest distance of "
                "one run from its result's mean")
    default = (f"{time_to_train.DEFAULT_SPREAD:.1%}, the median run-to-run "
               "spread of 161 MLPerf Training BERT results, v2.0-v4.0")
    bare = sum(r.spread is None for r in measured)
    if bare < len(measured):
        if model.spread > time_to_train.DEFAULT_SPREAD:
            return ("the results' run-to-run spread, wider than the "
                    f"{time_to_train.DEFAULT_SPREAD:.1%} the {bare} without "
                    "runs take")
        return (f"{bare} of {len(measured)} results gave no runs and take "
                f"{default}; give their minutes as runs, M1/M2/..., for "
                "your own")
    return (f"no result gave its runs: {default}; give each result's "
            "minutes as its runs, M1/M2/..., for your own")


def table(rows, price=None) -> str:
    lines = ["GPUs   batch  per GPU  step ms (band)          steps  "
             "examples (band)                 to target (band)"
             + ("  cost to target (price x GPU-hours)" if price else "")]
    for r in rows:
        step, examples, minutes = r.step, r.examples, r.minutes
        line = (f"{r.gpus:4d} {r.global_batch:7d} {r.global_batch / r.gpus:8.1f}"
                f"  {1e3 * step.value:7.1f} ({1e3 * step.low:.1f}-"
                f"{1e3 * step.high:.1f})  {r.steps:8,.0f}  "
                f"{examples.value:,.0f} ({examples.low:,.0f}-"
                f"{examples.high:,.0f})  {_minutes(minutes.value)} "
                f"({_minutes(minutes.low)}-{_minutes(minutes.high)})")
        if price:
            line += (f"  {r.gpus * minutes.value / 60 * price:,.2f} "
                     f"({r.gpus * minutes.low / 60 * price:,.2f}-"
                     f"{r.gpus * minutes.high / 60 * price:,.2f})")
        if r.extrapolated:
            line += f"  extrapolated: {', '.join(r.extrapolated)}"
        lines.append(line)
    return "\n".join(lines)


def _minutes(value: float) -> str:
    return f"{value:.1f} min" if value >= 1 else f"{60 * value:.0f} s"


def run(args, system, plan):
    """(header lines, rows) of `--results` (checked here, one line each).

    Raises:
        ValueError: A missing or inconsistent flag.
    """
    missing = [f"--{n}" for n in ("parameters", "gradient_dtype")
               if getattr(args, n) is None]
    if missing:
        raise ValueError(f"--results needs {' and '.join(missing)} (the "
                         "gradients' size on the wire)")
    if len(args.results) < 2:
        raise ValueError("--results needs two results or more: one cannot "
                         "tell a step's fixed part from its per-example "
                         "part, nor how the examples grow with the batch")
    for name in ("train_batch", "train_batch_per_gpu"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} {value}: must be >= 1 example")
    batches = time_to_train.batches_for(
        args.gpus, global_batch=args.train_batch,
        per_gpu=args.train_batch_per_gpu)
    for gpus, batch in zip(args.gpus, batches):
        if batch < gpus:
            raise ValueError(f"--train_batch {batch}: fewer examples than "
                             f"the {gpus} GPUs of that row")
    model = time_to_train.fit_results(
        system, args.parameters, DTYPE_BYTES[args.gradient_dtype],
        args.results, plan)
    one = model.one_per_gpu
    other = [b / g for g, b in zip(args.gpus, batches)
             if one is not None and abs(b / g - one) > 1e-9 * one]
    if other:
        raise ValueError(
            f"every result ran {one:g} examples a GPU: they predict other "
            f"GPU counts at that batch per GPU (--train_batch_per_gpu "
            f"{one:g}); {other[0]:g} a GPU needs a result at it")
    rows = [time_to_train.predict_row(model, system, gpus, batch, plan)
            for gpus, batch in zip(args.gpus, batches)]
    return header(model, system, plan, args.results), rows, model


def as_json(rows) -> list:
    return [{"gpus": r.gpus, "global_batch": r.global_batch,
             "step_seconds": [r.step.value, r.step.low, r.step.high],
             "examples": [r.examples.value, r.examples.low, r.examples.high],
             "minutes": [r.minutes.value, r.minutes.low, r.minutes.high],
             "steps": r.steps, "extrapolated": list(r.extrapolated)}
            for r in rows]
