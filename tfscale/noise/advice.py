"""What a run's gradient noise scale says about its batch, in the lines a
run ends with (`closing_sentence`): the value with its 95% interval, then
at most two lines of advice for this run's optimizer and noise mode.

The advice prices halving or doubling the batch by McCandlish et al.'s
S = S_min (1 + B_noise / B) and E = E_min (1 + B / B_noise) over every
B_noise the interval allows, times the range of B_crit / B_simple that the
time-to-accuracy studies measured for this optimizer and noise mode
(`STUDY_RANGES`, docs/batch-size.md). A combination the studies give no
range for gets none, and so does a run whose estimate is not yet settled,
unbounded, or averaged over a window unlike the studies'.
"""

import dataclasses
import math
from typing import Optional, Tuple


def _range(low: float, high: float) -> str:
    return (f"{low:,.0f}-{high:,.0f}" if math.isfinite(high)
            else f">= {low:,.0f}, no upper bound yet")


def relative_cost(b_noise: float, batch: float, other: float
                  ) -> Tuple[float, float]:
    """(steps, examples) to the same target at batch `other`, relative to
    `batch`, by S = S_min (1 + B_noise/B) and E = E_min (1 + B/B_noise)."""
    steps = (1 + b_noise / other) / (1 + b_noise / batch)
    examples = (1 + other / b_noise) / (1 + batch / b_noise)
    return steps, examples


@dataclasses.dataclass(frozen=True)
class StudyRange:
    """B_crit / B_simple at the target over a study's settled runs (each
    had averaged at least `SETTLED_WINDOWS` windows), B_crit widened by its
    leave-one-batch-out range.

    Attributes:
        low, high: The range of the ratio.
        study: Which study, in words.
        window_examples: The examples its noise scale averaged over (the
            EMA's window times the batch): B_simple grows along a run, so a
            longer window reads a smaller value, and the range holds for
            windows near this one.
    """

    low: float
    high: float
    study: str
    window_examples: int


# (optimizer, noise scale mode) -> the range `python -m
# benchmarks.time_to_accuracy` measured for it (docs/batch-size.md): SGD
# with momentum on Fashion-MNIST (definition 45cee23f1d: settled runs at
# batches 16-1,024, both seeds, 1.99-6.68) widened to scikit-learn's digits
# (251b4816d5: no run settles there; those with a bounded interval,
# 1.53-10.4), each with its B_crit's leave-one-batch-out range. A
# combination not here gets no range: the studies measure AdamW and LAMB
# with the preconditioned noise scale only, and no ratio of theirs held on
# two data sets (LAMB: 0.99-3.12 on Fashion-MNIST, 0.38-0.88 on digits;
# AdamW: no filled-window value on digits), so none is printed.
STUDY_RANGES = {
    ("sgd", "plain"): StudyRange(
        1.53, 10.4, "the Fashion-MNIST and digits MLP studies",
        window_examples=6_400),
}
SETTLED_WINDOWS = 5
WINDOW_SLACK = 2  # a run's window in examples within 2x of the study's


def closing_sentence(summary: Optional[dict], step: int) -> str:
    """The lines a run ends with (empty without a measurement): the value
    with its interval, then what halving or doubling the batch would cost
    over the range the study measured for this optimizer and noise mode,
    or that there is none."""
    if not summary:
        return ""
    batch = summary["global_batch_size"]
    window = summary.get("window_steps") or round(1 / (1 - summary["decay"]))
    interval = summary.get("b_simple_interval")
    if not summary.get("warmed_up", True) or interval is None:
        if summary.get("steps_averaged"):
            return (f"  gradient noise scale: warming up "
                    f"({summary['steps_averaged']} of the {window} steps "
                    "its average needs): no value yet")
        return ("  gradient noise scale: not measured (it needs >= 2 "
                "micro-batches per step and a few steps)")
    low, high = interval[0], interval[1] or math.inf
    kind = (" (preconditioned)" if summary["mode"] == "preconditioned"
            else "")
    b_simple = summary.get("b_simple")
    if b_simple is None:
        return (f"  gradient noise scale{kind}: |G|^2 is not above 0 yet "
                f"(at step {step}): B_simple {_range(low, high)}; it prices "
                "no change of batch.")
    return (f"  gradient noise scale{kind}: B_simple {b_simple:,.0f} "
            f"examples, 95% interval {_range(low, high)} (the last ~{window}"
            f" steps, at step {step}); this run's global batch {batch} is "
            f"{batch / b_simple:.2g}x it. It grows as the loss falls.\n"
            "  (Measured from the gradients of each step's micro-batches: "
            "about the batch past which a larger one stops cutting the "
            "steps to a given loss in proportion.)\n"
            + _advice(summary, low, high, window))


def _advice(summary: dict, low: float, high: float, window: int) -> str:
    """At most two lines: the critical batch the study's range puts this
    interval at, and the cost of halving or doubling the batch; or why
    there is no such range."""
    optimizer = (summary.get("optimizer") or "this optimizer").lower()
    mode = summary["mode"]
    found = STUDY_RANGES.get((optimizer, mode))
    retune = "retune the learning rate at any new batch."
    if found is None:
        return (f"  critical batch: no study range for {optimizer} with the "
                f"{mode} noise scale: tfscale's studies have not measured "
                "how far past B_simple a larger batch still pays with this "
                "optimizer, so no batch is advised (docs/batch-size.md); "
                f"{retune}")
    if not math.isfinite(high):
        return ("  critical batch: B_simple has no upper bound yet, so no "
                f"change of batch is priced; {retune}")
    batch = summary["global_batch_size"]
    examples = window * batch
    if not (found.window_examples / WINDOW_SLACK <= examples
            <= found.window_examples * WINDOW_SLACK):
        decay = max(0.0, 1 - batch / found.window_examples)
        return (f"  critical batch: {found.study} measured "
                f"{found.low:g}-{found.high:g}x B_simple over a window of "
                f"{found.window_examples:,} examples; this run's is "
                f"{examples:,} (--noise_scale_decay={decay:.4g} matches it), "
                f"so no range; {retune}")
    averaged = summary.get("steps_averaged", 0)
    if averaged < SETTLED_WINDOWS * window:
        return (f"  critical batch: {found.study} measured it at "
                f"{found.low:g}-{found.high:g}x B_simple in runs that had "
                f"averaged >= {SETTLED_WINDOWS} windows; this one has "
                f"{averaged} steps, so no range yet; {retune}")
    lo, hi = low * found.low, high * found.high

    def span(other, i):
        a, b = sorted(relative_cost(v, batch, other)[i] for v in (lo, hi))
        return f"{a:.2f}-{b:.2f}x"
    return (f"  critical batch {lo:,.0f}-{hi:,.0f} ({found.low:g}-"
            f"{found.high:g}x the interval: {optimizer}, {mode} noise scale, "
            f"{found.study}, docs/batch-size.md): half the batch takes "
            f"{span(batch / 2, 0)} the steps, {span(batch / 2, 1)} the "
            f"examples;\n  double takes {span(batch * 2, 0)} the steps, "
            f"{span(batch * 2, 1)} the examples; {retune}")
