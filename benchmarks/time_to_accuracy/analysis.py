"""A sweep's results: the file they are appended to, the best rate per
batch, the fit of S = S_min (1 + B_crit / B), and the tables and plot."""

import fcntl
import json
import math
import os
from typing import List, Optional

import numpy as np

from benchmarks import harness
from benchmarks.time_to_accuracy.study import (
    NOISE_MODES, OPTIMIZERS, RATE_STEPS, SETTLED_WINDOWS, WINDOW_EXAMPLES,
    Study)


def append_result(path: str, result: dict) -> None:
    """One run's line, appended under an exclusive lock: studies of the same
    definition may run side by side (one per optimizer) into one file."""
    line = json.dumps(result) + "\n"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(line)
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def rates_for(study: Study, optimizer: str, batch: int) -> List[float]:
    """3 rates around the middle of the linear and sqrt rules (k^0.75)."""
    k = batch / study.reference_batch
    centre = study.base_rates[optimizer] * k ** 0.75
    return [float(f"{centre * f:.3g}") for f in RATE_STEPS]


def load_results(path: str, digest: str) -> List[dict]:
    """The runs of definition `digest` in `path`.

    Raises:
        SystemExit: The file holds a run of another definition.
    """
    if not os.path.exists(path):
        return []
    with open(path) as f:
        results = [json.loads(line) for line in f if line.strip()]
    other = [r for r in results if r.get("definition") != digest]
    if other:
        raise SystemExit(f"{path}: {len(other)} run(s) of another definition "
                         f"({other[0].get('definition')}, not {digest}); "
                         "a study's runs are never mixed: move the file")
    return results


def best_per_batch(results: List[dict], optimizer: str, seed: int = 1
                   ) -> dict:
    """{batch: the tuned run}: the fastest of `seed`'s runs that reached the
    target; where several rates tie, the one with the fewest steps summed
    over every seed that ran all the tied rates (`tied_rates` lists the
    ties; a tie that the second seed also leaves is broken by the lower
    rate)."""
    best = {}
    for batch in sorted({r["batch"] for r in results
                         if r["optimizer"] == optimizer}):
        runs = [r for r in results if r["optimizer"] == optimizer
                and r["batch"] == batch and r["reached"]]
        first = [r for r in runs if r["seed"] == seed]
        if not first:
            continue
        fewest = min(r["steps"] for r in first)
        tied = sorted((r for r in first if r["steps"] == fewest),
                      key=lambda r: r["rate"])

        def total(run):
            return sum(r["steps"] for r in runs if r["rate"] == run["rate"])
        counted = [r for r in tied if all(
            any(x["rate"] == r["rate"] and x["seed"] != seed for x in runs)
            for r in tied)]
        chosen = min(counted or tied[:1], key=total)
        best[batch] = dict(chosen, tied_rates=[r["rate"] for r in tied])
    return best


def ties(results: List[dict], optimizer: str) -> List[tuple]:
    """(batch, rate) of every rate that ties for the fewest steps at its
    batch (seed 1), when more than one does: each needs the second seed."""
    return [(batch, rate) for batch, run in
            best_per_batch(results, optimizer).items()
            if len(run["tied_rates"]) > 1 for rate in run["tied_rates"]]


def fit_curve(batches, steps) -> Optional[tuple]:
    """(S_min, B_crit) of S = S_min (1 + B_crit / B), least squares in
    relative error (weights 1/S); None with fewer than 2 points."""
    if len(batches) < 2:
        return None
    b = np.asarray(batches, float)
    s = np.asarray(steps, float)
    design = np.stack([np.ones_like(b), 1.0 / b], axis=1) / s[:, None]
    coef, *_ = np.linalg.lstsq(design, np.ones_like(s), rcond=None)
    s_min, slope = coef
    if s_min <= 0 or slope <= 0:
        return None
    return float(s_min), float(slope / s_min)


def leave_one_out(best: dict) -> Optional[tuple]:
    """(lowest, highest) B_crit of the fits that leave one batch out (with
    at least 3 batches); None otherwise."""
    batches = sorted(best)
    if len(batches) < 3:
        return None
    values = []
    for left in batches:
        kept = [b for b in batches if b != left]
        fit = fit_curve(kept, [best[b]["steps"] for b in kept])
        if fit:
            values.append(fit[1])
    return (min(values), max(values)) if values else None


def _interval(run: dict) -> str:
    low, high = run.get("b_simple_interval") or (None, None)
    if low is None:
        return ""
    return f" ({low:,.0f}-{high:,.0f})" if high else f" (>= {low:,.0f})"


def settled(run: dict) -> bool:
    """The run's B_simple at the target averaged SETTLED_WINDOWS windows
    and its interval is bounded: what the closing advice needs before it
    prices anything (`noise_advice.closing_sentence`). A window of 2
    steps, batch 4,096's, has n_eff under 3 and no interval at all."""
    interval = run.get("b_simple_interval") or [None, None]
    return bool(run.get("b_simple_steps_averaged") and run.get("window_steps")
                and run["b_simple_steps_averaged"]
                >= SETTLED_WINDOWS * run["window_steps"]
                and interval[0] is not None and interval[1] is not None)


def _mark(run: dict) -> str:
    return ("w" if not run.get("b_simple_warmed_up")
            else "s" if settled(run) else "")


def along_the_run(run: dict, fractions=(0.25, 0.5, 0.75, 1.0)) -> str:
    """B_simple at the evaluations nearest these fractions of the steps to
    the target ("w" marks a value whose window had not filled)."""
    points = run.get("trajectory") or []
    if not points or not run["steps"]:
        return ""
    cells = []
    for fraction in fractions:
        point = min(points, key=lambda p: abs(p["step"] - fraction
                                               * run["steps"]))
        value = point["b_simple"]
        cells.append("-" if value is None else
                     f"{value:,.0f}{'' if point['warmed_up'] else 'w'}")
    return " / ".join(cells)


def analyse(study: Study, results: List[dict], plot_path: str) -> str:
    """The markdown section: per optimizer the tuned runs, the fit with its
    leave-one-out range, B_simple at the target and along the run, and
    what the ratio B_crit / B_simple spans."""
    lines = [f"Data: {study.data_label}. Target: {study.metric} "
             f"{'>=' if study.higher_is_better else '<='} {study.target}. "
             f"Definition {study.digest()}; runs: {len(results)}. B_simple: "
             "SGD plain, AdamW and LAMB preconditioned, over a window of "
             f"{WINDOW_EXAMPLES:,} examples (EMA decay 1 - batch / "
             f"{WINDOW_EXAMPLES:,}); 'w' marks a value whose window had not "
             f"filled, 's' one whose run had averaged {SETTLED_WINDOWS} "
             "windows with a bounded interval (settled).", ""]
    fits, ratios, ranges = {}, [], {}
    for optimizer in [o for o in OPTIMIZERS
                      if any(r["optimizer"] == o for r in results)]:
        best = best_per_batch(results, optimizer)
        if not best:
            lines.append(f"{optimizer}: no batch reached the target.")
            continue
        batches = sorted(best)
        fit = fit_curve(batches, [best[b]["steps"] for b in batches])
        loo = leave_one_out(best)
        fits[optimizer] = (best, fit)
        ranges[optimizer] = loo
        reference = best.get(study.reference_batch)
        head = f"**{optimizer}**"
        if fit:
            head += (f": S_min {fit[0]:.0f} steps, B_crit {fit[1]:.0f}"
                     + (f" (leave one batch out: {loo[0]:.0f}-{loo[1]:.0f})"
                        if loo else "") +
                     f", E_min {fit[0] * fit[1]:,.0f} examples")
        else:
            head += ": no fit"
        rows = []
        for b in study.batches:
            r = best.get(b)
            if r is None:
                tried = [x for x in results if x["optimizer"] == optimizer
                         and x["batch"] == b]
                rows.append([b, f"not reached ({len(tried)} rates)",
                             *[""] * 7])
                continue
            linear = sqrt = ""
            if reference:
                k = b / study.reference_batch
                linear = f"{reference['rate'] * k:.3g}"
                sqrt = f"{reference['rate'] * math.sqrt(k):.3g}"
            ratio = ""
            if fit and r["b_simple"]:
                ratio = f"{fit[1] / r['b_simple']:.2f}"
            # Every seed's run at the tuned rate counts in the ranges.
            for x in [x for x in results if x["optimizer"] == optimizer
                      and (x["batch"], x["rate"]) == (b, r["rate"])
                      and x["reached"]]:
                if fit and x["b_simple"] and x.get("b_simple_warmed_up"):
                    low, high = loo or (fit[1], fit[1])
                    ratios.append((optimizer, b, fit[1] / x["b_simple"],
                                   low / x["b_simple"], high / x["b_simple"],
                                   settled(x)))
            b_simple = (f"{r['b_simple']:,.0f}{_mark(r)}{_interval(r)}"
                        if r["b_simple"] else "")
            rate = f"{r['rate']:.3g}" + (
                " (tie: " + ", ".join(f"{x:.3g}" for x in r["tied_rates"])
                + ")" if len(r["tied_rates"]) > 1 else "")
            rows.append([b, r["steps"], f"{r['examples']:,}", rate, linear,
                         sqrt, b_simple, ratio, along_the_run(r)])
        lines += [head, "", harness.table(
            ["batch", "steps", "examples", "tuned lr", "linear rule",
             "sqrt rule", "B_simple at target (95%)", "B_crit / B_simple",
             "B_simple at 1/4, 1/2, 3/4, all of the steps"], rows,
            align="rrrrrrrrl")]
        for r in sorted((x for x in results if x["optimizer"] == optimizer
                         and x["seed"] != 1), key=lambda x: (
                             x["batch"], x["rate"])):
            first = [x for x in results if x["optimizer"] == optimizer
                     and x["seed"] == 1 and (x["batch"], x["rate"]) == (
                         r["batch"], r["rate"])]
            if not first:
                continue

            def seed_text(x):
                if not x["reached"]:
                    return "not reached"
                value = (f", B_simple {x['b_simple']:,.0f}{_mark(x)}"
                         f"{_interval(x)}" if x["b_simple"] else "")
                return f"{x['steps']} steps{value}"
            lines.append(f"\nSeed {r['seed']} at batch {r['batch']}, lr "
                         f"{r['rate']:.3g}: {seed_text(r)} (seed 1: "
                         f"{seed_text(first[0])}).")
        lines.append("")
    if ratios:
        point = [r[2] for r in ratios]
        lines.append(
            f"B_crit / B_simple at the target, over the {len(ratios)} runs "
            "at a tuned rate (either seed) whose window had filled: "
            f"{min(point):.2f}-{max(point):.2f}"
            f" (median {float(np.median(point)):.2f}); with B_crit's "
            f"leave-one-out range: {min(r[3] for r in ratios):.2f}-"
            f"{max(r[4] for r in ratios):.2f}.")
        calm = [r for r in ratios if r[5]]
        for optimizer in [o for o in OPTIMIZERS if any(
                r[0] == o for r in calm)]:
            own = [r for r in calm if r[0] == optimizer]
            lines.append(
                f"{optimizer} ({NOISE_MODES[optimizer]}), the {len(own)} "
                f"settled run(s): {min(r[2] for r in own):.2f}-"
                f"{max(r[2] for r in own):.2f}; with the leave-one-out "
                f"range: {min(r[3] for r in own):.2f}-"
                f"{max(r[4] for r in own):.2f}.")
        if calm:
            lines.append(
                f"In all {len(calm)} settled runs ({SETTLED_WINDOWS} "
                "windows averaged, so the average is of recent steps, not of "
                "the start; a bounded interval): "
                f"{min(r[2] for r in calm):.2f}-"
                f"{max(r[2] for r in calm):.2f}; with the leave-one-out "
                f"range: {min(r[3] for r in calm):.2f}-"
                f"{max(r[4] for r in calm):.2f}.")
    known = {o: r for o, r in ranges.items() if r}
    if len(known) > 1:
        overlap = max(r[0] for r in known.values()) <= min(
            r[1] for r in known.values())
        lines.append(
            "Leave-one-out B_crit ranges: " + ", ".join(
                f"{o} {r[0]:.0f}-{r[1]:.0f}" for o, r in known.items())
            + (": they overlap, so this study does not tell the optimizers'"
               " critical batches apart." if overlap else
               ": not all overlap."))
    _plot(study, fits, plot_path)
    return "\n".join(lines)


def _plot(study: Study, fits: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5))
    for (optimizer, (best, fit)), color in zip(fits.items(),
                                               ("C0", "C1", "C2")):
        batches = sorted(best)
        steps = [best[b]["steps"] for b in batches]
        ax.loglog(batches, steps, "o", color=color, label=optimizer)
        if fit:
            grid = np.geomspace(min(study.batches), max(study.batches), 100)
            ax.loglog(grid, fit[0] * (1 + fit[1] / grid), "-", color=color,
                      alpha=0.6, label=f"{optimizer} fit, B_crit {fit[1]:.0f}")
            ax.axvline(fit[1], color=color, linestyle=":", alpha=0.6)
            measured = [best[b]["b_simple"] for b in batches
                        if best[b]["b_simple"]]
            if measured:
                ax.axvline(float(np.median(measured)), color=color,
                           linestyle="--", alpha=0.6,
                           label=f"{optimizer} in-run B_simple "
                                 f"{np.median(measured):.0f}")
        # Perfect scaling through the smallest batch's point.
        first = batches[0]
        ax.loglog([first, max(study.batches)],
                  [best[first]["steps"],
                   best[first]["steps"] * first / max(study.batches)],
                  color=color, linestyle=(0, (1, 3)), alpha=0.4)
    ax.set_xlabel("global batch (examples)")
    ax.set_ylabel(f"steps to {study.metric} "
                  f"{'>=' if study.higher_is_better else '<='} {study.target}")
    ax.set_title(f"{study.data_label}: steps to target vs batch (dotted: "
                 "perfect scaling)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
