r"""Time to accuracy: what each global batch costs in steps and examples.

    python -m benchmarks.time_to_accuracy --task fashion_mnist      # ~30 min
    python -m benchmarks.time_to_accuracy --task bert_tiny \
        --records='runs/demo/records/train-*.tfrecord'              # make demo

Each run is a job on tfscale's skeleton (`tfscale.jobs.run`, a `StudyRun`
task: the study's model and data, stopped at the target by a callback).
Steps to a target do not depend on the hardware, so every run is one process
with 2 accumulation steps (the global record order makes that the same run
as 2 workers; two micro-batches also let the Trainer measure the gradient
noise scale). For each optimizer (SGD with momentum, AdamW, LAMB; linear
warmup, then constant) and global batch (powers of 4), a small
learning-rate search (3 rates a factor 3 apart, and up to 2 more outward
when the best is at the grid's edge; one seed; a second for every rate of a
tie, which the sum over both seeds breaks, and at the batch nearest the
knee) runs until the target is reached or an example cap. The best rate
per batch gives steps S and examples E to the target; a fit of
S = S_min (1 + B_crit / B) gives S_min, E_min = S_min B_crit and B_crit
(McCandlish et al. 2018), with the range of leave-one-batch-out fits, against
the B_simple the Trainer measured in the same runs: at every evaluation
(with its 95% interval, and whether its EMA window had filled), so B_simple
at the target and along the run can both be set against B_crit. SGD runs
measure the plain noise scale; AdamW and LAMB the preconditioned one (the
direction they move in). The noise scale's window is WINDOW_EXAMPLES
examples at every batch, so the large batches fill it too.

A study's definition (`Study.definition`: the data's content, target, the
model in words and its code, the optimizers' settings and rate grid, the
data pipeline's and evaluation's code, the seeds, the window, the library
versions) has a digest; its runs go to `benchmarks/results/time_to_accuracy_<study>-<digest>
.jsonl` (one line per run, each with the definition's digest and the git
commit it ran on), and the markdown and plot next to it are built from that
file alone. A rerun reuses only runs of the same digest; another data
directory or target writes its own file. Data: Fashion-MNIST from Debian's
`dataset-fashion-mnist` (60,000 training and 10,000 test images, IDX files);
BERT-tiny masked-LM on the demo corpus's records, the last shard held out.
"""

import argparse
import dataclasses
import fcntl
import functools
import hashlib
import inspect
import json
import math
import os
import subprocess
import tempfile
import time
from typing import Callable, List, Optional

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from input_pipelines import idx  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.time_to_accuracy import behaviour as study_behaviour  # noqa: E402
from tfscale import jobs  # noqa: E402
from tfscale.noise import advice as noise_advice  # noqa: E402
from tfscale.cluster.environment import ClusterConfig  # noqa: E402
from tfscale.noise.scale import NoiseScaleConfig  # noqa: E402
from tfscale.optim import OptimConfig  # noqa: E402
from tfscale.train_config import TrainConfig  # noqa: E402

RESULTS = harness.RESULTS
OPTIMIZERS = ("sgd", "adamw", "lamb")
RATE_STEPS = (1 / 3, 1.0, 3.0)  # around the centre of the linear/sqrt rules
MAX_STEPS = 15_000  # a run's step cap, whatever its examples cap
EXTRA_RATES = 2  # rates tried beyond the grid's edge, when the best is there
GIVE_UP = 3  # a run stops at this many times its batch's best examples
SEEDS = (1, 2)  # the first for every run; the second for ties and the knee
NOISE_MODES = {"sgd": "plain", "adamw": "preconditioned",
               "lamb": "preconditioned"}
# The noise scale's window in examples, whatever the batch: its EMA decay is
# 1 - batch / WINDOW_EXAMPLES (a window of 100 steps at batch 64, 25 at
# 256, 6 at 1,024), so runs at every batch average the same number of
# examples, and runs long enough in examples fill it (with a window fixed at
# 100 steps, the large batches reached the target before it filled).
WINDOW_EXAMPLES = 6_400
SETTLED_WINDOWS = noise_advice.SETTLED_WINDOWS  # what the advice needs
# The code that defines what a run trains and measures, beside the study's
# own functions: the optimizers and their schedules (files), and the noise
# scale's estimator (its functions and classes, not the module: the advice
# in it is built from this study's results).
@functools.lru_cache(maxsize=None)
def engine_digests() -> dict:
    """The noise-scale estimator and the optimizers, by what they compute
    on fixed inputs (`study_behaviour.py`), not by their source: moving
    their code keeps a study's results, changing their numbers does not."""
    return {"estimator": study_behaviour.digest(
                study_behaviour.estimator_outputs()),
            "optimizers": study_behaviour.digest(
                study_behaviour.optimizer_outputs())}


ROOT = harness.REPO


def noise_decay(batch: int) -> float:
    """The EMA decay of a window of WINDOW_EXAMPLES examples at `batch`."""
    return max(0.0, 1.0 - batch / WINDOW_EXAMPLES)


def window_steps(batch: int) -> int:
    """That window in steps (`NoiseScale.window`)."""
    decay = noise_decay(batch)
    return max(1, round(1 / (1 - decay)))


def optimizer_settings(optimizer: str) -> dict:
    """Every OptimConfig setting of a run but its rate and step counts."""
    return {"optimizer": optimizer, "schedule": "constant",
            "weight_decay": 1e-4 if optimizer != "lamb" else 0.01}


@dataclasses.dataclass(frozen=True)
class Study:
    """What one study trains and when a run is done.

    Attributes:
        name: "fashion_mnist" or "bert_tiny".
        batches: Global batches swept.
        reference_batch: The batch `base_rates` are for.
        base_rates: {optimizer: learning rate at reference_batch}.
        target: The value to reach; `higher_is_better` says which way.
        metric: Its name in the table.
        cap_examples: A run that has not reached the target by then (or
            by MAX_STEPS) stops.
        warmup_examples: Linear warmup over this many examples.
        evaluation_growth: Evaluations every step up to 20, then each this
            factor after the last (the steps to the target are known to it).
        data: {"fingerprint": sha256 of the data files, "files": their
            names} (the folder they were read from is `source`, not part
            of the definition: the same bytes elsewhere are the same study).
        model: The model, in words (part of the definition, beside the
            source of `build_model`).
        source: The folder or pattern the data was read from.
        code_files: Files whose content defines the model (the engine's
            noise scale and optimizers count by their outputs:
            `engine_digests`).
    """

    name: str
    batches: tuple
    reference_batch: int
    base_rates: dict
    target: float
    higher_is_better: bool
    metric: str
    cap_examples: int
    warmup_examples: int
    build_model: Callable
    loss_fn: object
    dataset_fn: Callable  # (per-replica batch, seed) -> dataset_fn
    evaluate: Callable  # model -> metric value
    evaluation_growth: float = 1.05
    data: dict = dataclasses.field(default_factory=dict)
    model: str = ""
    source: str = ""
    code_files: tuple = ()

    @property
    def data_label(self) -> str:
        """The data as read: its folder (or pattern) and fingerprint."""
        return (f"{self.source or '?'} (sha256 "
                f"{self.data.get('fingerprint', '?')[:12]})")

    def definition(self) -> dict:
        """Everything that defines the study's runs, for its digest: the
        data's content, the target, the model (in words, its builder's
        source and its modules' content), the optimizers' settings and
        rate grid, the data pipeline's and the evaluation's code, the
        seeds, the noise scale's window, and the library versions."""
        return {"study": self.name, "data": self.data,
                "target": self.target, "metric": self.metric,
                "higher_is_better": self.higher_is_better,
                "model": self.model,
                "code": {
                    "build_model": source_digest(self.build_model),
                    "loss": source_digest(self.loss_fn),
                    "dataset": source_digest(self.dataset_fn),
                    "evaluate": source_digest(self.evaluate),
                    "until_target": source_digest(UntilTarget),
                    "evaluation_steps": source_digest(evaluation_steps),
                    "run_one": source_digest(run_one),
                    **engine_digests(),
                    "files": {path: file_digest(path) for path in
                              sorted(self.code_files)}},
                "optimizers": {o: optimizer_settings(o)
                               for o in sorted(self.base_rates)},
                "base_rates": self.base_rates,
                "reference_batch": self.reference_batch,
                "batches": list(self.batches),
                "rate_grid": {"steps": list(RATE_STEPS),
                              "extra": EXTRA_RATES, "give_up": GIVE_UP,
                              "rule": "base * (batch / reference) ** 0.75"},
                "seeds": list(SEEDS),
                "warmup_examples": self.warmup_examples,
                "cap_examples": self.cap_examples, "max_steps": MAX_STEPS,
                "noise_modes": NOISE_MODES,
                "window_examples": WINDOW_EXAMPLES, "accumulation": 2,
                "evaluation_growth": self.evaluation_growth,
                "versions": {"tensorflow": tf.__version__,
                             "keras": keras.__version__}}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(
            self.definition(), sort_keys=True).encode()).hexdigest()[:10]


def source_digest(thing) -> str:
    """sha256 of a function's or class's source (a loss object: its
    class's source and config)."""
    if not (inspect.isfunction(thing) or inspect.isclass(thing)):
        config = getattr(thing, "get_config", lambda: {})()
        return hashlib.sha256((inspect.getsource(type(thing)) + json.dumps(
            config, sort_keys=True, default=str)).encode()).hexdigest()
    return hashlib.sha256(inspect.getsource(thing).encode()).hexdigest()


def file_digest(path: str) -> str:
    """sha256 of a file of the repository (path relative to its root)."""
    return fingerprint([os.path.join(ROOT, path)])


def fingerprint(paths) -> str:
    """sha256 over the files' bytes, in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _data(paths) -> dict:
    return {"files": [os.path.basename(p) for p in paths],
            "fingerprint": fingerprint(paths)}


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
            text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
            check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---- Fashion-MNIST -------------------------------------------------------------


def fashion_task(directory: str, target: float) -> Study:
    def load(split):
        images, labels = idx.load_fashion_mnist(directory, split)
        return images.reshape(len(images), -1), labels
    train_x, train_y = load("train")
    test_x, test_y = load("test")
    test_x = tf.constant(test_x.astype(np.float32) / 255.0)

    def build_model():
        return keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10)])

    def dataset_fn(per_replica_batch, seed):
        def make(context):
            ds = tf.data.Dataset.from_tensor_slices((train_x, train_y))
            ds = ds.shuffle(len(train_y), seed=seed,
                            reshuffle_each_iteration=True).repeat()
            ds = ds.batch(per_replica_batch, drop_remainder=True)
            return ds.map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y))
        return make

    def evaluate(model):
        logits = model(test_x, training=False)
        predicted = tf.argmax(logits, axis=1).numpy()
        return float(np.mean(predicted == test_y))

    return Study(
        name="fashion_mnist", batches=(16, 64, 256, 1024, 4096),
        reference_batch=256,
        base_rates={"sgd": 0.05, "adamw": 1e-3, "lamb": 4e-3},
        target=target, higher_is_better=True,
        metric="test accuracy", cap_examples=1_500_000,
        warmup_examples=5_000, build_model=build_model,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        dataset_fn=dataset_fn, evaluate=evaluate,
        data=_data([os.path.join(directory, name) for name in sorted(
            os.listdir(directory)) if "idx" in name]),
        model="MLP 784-256-10, relu, from logits",
        source=os.path.abspath(directory))


# ---- scikit-learn's digits ---------------------------------------------------------


def digits_task(target: float) -> Study:
    """The 1,797 8x8 handwritten digits scikit-learn ships (UCI's optical
    digits test set): a second real image set for the same kind of model,
    500 of them held out (a fixed permutation)."""
    try:
        from sklearn import datasets
    except ImportError as e:
        raise SystemExit("--task digits: needs scikit-learn (pip install "
                         "scikit-learn)") from e
    path = os.path.join(os.path.dirname(datasets.__file__), "data",
                        "digits.csv.gz")
    digits = datasets.load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype(np.float32)
    y = digits.target[order].astype(np.int64)
    train_x, train_y, test_x, test_y = x[500:], y[500:], x[:500], y[:500]

    def build_model():
        return keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10)])

    def dataset_fn(per_replica_batch, seed):
        def make(context):
            ds = tf.data.Dataset.from_tensor_slices((train_x, train_y))
            ds = ds.shuffle(len(train_y), seed=seed,
                            reshuffle_each_iteration=True).repeat()
            return ds.batch(per_replica_batch, drop_remainder=True)
        return make

    def evaluate(model):
        logits = model(test_x, training=False)
        predicted = tf.argmax(logits, axis=1).numpy()
        return float(np.mean(predicted == test_y))

    return Study(
        name="digits", batches=(16, 64, 256, 1024),
        reference_batch=256,
        base_rates={"sgd": 0.05, "adamw": 1e-3, "lamb": 4e-3},
        target=target, higher_is_better=True,
        metric="test accuracy", cap_examples=1_500_000,
        warmup_examples=5_000, build_model=build_model,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        dataset_fn=dataset_fn, evaluate=evaluate,
        data=_data([path]), model="MLP 64-128-10, relu, from logits",
        source=path)


# ---- BERT-tiny masked LM -----------------------------------------------------------


def bert_task(records: str, bert_config: str, target: float) -> Study:
    from input_pipelines import bert_records, record_files, tfrecord
    from models import bert
    from models.bert_config import BertConfig

    files = record_files.expand_files(records)
    if len(files) < 2:
        raise SystemExit(f"--records: {records} must match >= 2 files (the "
                         "last is held out)")
    config = BertConfig.from_json_file(bert_config)
    config = dataclasses.replace(config, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    spec = bert_records.BertRecordSpec(64, 10)
    limits = bert_records.IdLimits(config.vocab_size, config.type_vocab_size)
    held_out = bert_records.make_dataset_fn(
        tfrecord.TFRecordConfig(files[-1:], training=False), spec, 256,
        limits)(None).take(2).cache()

    def build_model():
        return bert.make_pretrainer(config, 64, 10)

    def dataset_fn(per_replica_batch, seed):
        return bert_records.make_dataset_fn(
            tfrecord.TFRecordConfig(files[:-1], training=True, seed=seed),
            spec, per_replica_batch, limits)

    def evaluate(model):
        metric = bert.MaskedLMLoss()
        for features, labels in held_out:
            outputs = model(features, training=False)
            metric.update_state(labels, outputs)
        return float(metric.result())

    return Study(
        name="bert_tiny", batches=(16, 64, 256, 1024),
        reference_batch=64,
        base_rates={"sgd": 0.1, "adamw": 2e-3, "lamb": 4e-3},
        target=target, higher_is_better=False, metric="held-out MLM loss",
        # Warmup ends long before the target (study version 1 warmed up
        # over 2,000 examples: the best runs reached the target inside it).
        cap_examples=200_000, warmup_examples=320,
        build_model=build_model, loss_fn=bert.pretraining_loss,
        dataset_fn=dataset_fn, evaluate=evaluate, evaluation_growth=1.1,
        data=_data(files + [bert_config]),
        model=f"BERT pretrainer {json.dumps(dataclasses.asdict(config), sort_keys=True)}, seq 64, 10 predictions",
        source=records,
        code_files=("models/bert.py", "models/bert_config.py",
                    "input_pipelines/bert_records.py"))


# ---- one run ----------------------------------------------------------------------


def evaluation_steps(limit: int, growth: float) -> List[int]:
    """Every step up to 20, then `growth` apart: steps to the target are
    known to that factor."""
    steps, step = [], 1
    while step <= limit:
        steps.append(step)
        step = step + 1 if step < 20 else int(math.ceil(step * growth))
    return steps


class UntilTarget(keras.callbacks.Callback):
    """Evaluates at `evaluation_steps` and stops at the target (or on a
    non-finite loss); records the measured noise scale at every evaluation
    (`trajectory`) and keeps the one at the target."""

    def __init__(self, study: Study, trainer, limit: int):
        super().__init__()
        self.study, self.trainer = study, trainer
        self.due = set(evaluation_steps(limit, study.evaluation_growth))
        self.step = 0
        self.reached_at = None
        self.at_target = None
        self.last_value = None
        self.trajectory = []

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if not math.isfinite(logs.get("loss", 0.0)):
            self.model.stop_training = True
            return
        if self.step not in self.due:
            return
        value = self.study.evaluate(self.model)
        self.last_value = value
        estimate = self.trainer.noise_scale.estimate()
        interval = estimate.interval
        point = {"step": self.step, "value": value,
                 "loss": float(logs.get("loss", math.nan)),
                 "b_simple": estimate.b_simple,
                 "low": interval[0] if interval else None,
                 "high": (interval[1] if interval and math.isfinite(
                     interval[1]) else None),
                 "steps_averaged": estimate.steps,
                 "warmed_up": estimate.warmed_up}
        self.trajectory.append(point)
        better = (value >= self.study.target if self.study.higher_is_better
                  else value <= self.study.target)
        if better:
            self.reached_at = self.step
            self.at_target = point
            self.model.stop_training = True


class StudyRun(jobs.Task):
    """One run of a study through the job skeleton: the study's model and
    data, stopped by `UntilTarget`."""

    def __init__(self, config: jobs.JobConfig, study: Study, limit: int):
        super().__init__(config)
        self.study, self.limit = study, limit
        self.until = None

    def build(self) -> jobs.Built:
        return jobs.Built(self.study.build_model(), self.study.loss_fn)

    def dataset_fn(self, per_replica_batch, training):
        return self.study.dataset_fn(per_replica_batch, self.config.seed)

    def callbacks(self, trainer):
        self.until = UntilTarget(self.study, trainer, self.limit)
        return [self.until]


def run_one(study: Study, optimizer: str, batch: int, rate: float,
            seed: int, budget: Optional[int] = None) -> dict:
    """One run to the target; it gives up after `budget` examples (default:
    the study's cap) or MAX_STEPS steps."""
    examples = min(study.cap_examples, budget or study.cap_examples)
    cap_steps = max(1, min(examples // batch, MAX_STEPS))
    warmup = min(cap_steps, max(1, study.warmup_examples // batch))
    with tempfile.TemporaryDirectory(prefix="tta-") as output_dir:
        run = StudyRun(jobs.JobConfig(
            optim=OptimConfig(
                learning_rate=rate, warmup_steps=warmup, total_steps=cap_steps,
                **optimizer_settings(optimizer)),
            cluster=ClusterConfig(),
            train=TrainConfig(
                global_batch_size=batch, num_accumulation_steps=2,
                log_steps=10**9, verbose=0, timed_steps_per_log=0,
                checkpoint_dir=os.path.join(output_dir, "checkpoints"),
                save_checkpoints_steps=10**9,
                noise_scale=NoiseScaleConfig(mode=NOISE_MODES[optimizer],
                                             decay=noise_decay(batch))),
            output_dir=output_dir, seed=seed), study, cap_steps)
        start = time.perf_counter()
        jobs.run(run)
    until = run.until
    steps = until.reached_at
    at = until.at_target or {}
    return {"definition": study.digest(), "commit": git_commit(),
            "optimizer": optimizer, "batch": batch, "rate": rate,
            "seed": seed, "noise_mode": NOISE_MODES[optimizer],
            "reached": steps is not None, "steps": steps,
            "examples": steps * batch if steps else None,
            "b_simple": at.get("b_simple"),
            "b_simple_interval": [at.get("low"), at.get("high")] if at else None,
            "b_simple_warmed_up": at.get("warmed_up"),
            "b_simple_steps_averaged": at.get("steps_averaged"),
            "window_steps": window_steps(batch),
            "trajectory": until.trajectory, "last_value": until.last_value,
            "steps_run": until.step, "seconds": time.perf_counter() - start}


# ---- the sweep and its analysis -------------------------------------------------


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("fashion_mnist", "digits",
                                           "bert_tiny"),
                        default="fashion_mnist",
                        help="the study's task")
    parser.add_argument("--fashion_dir", default=idx.FASHION_MNIST_DIR,
                        help="Fashion-MNIST's IDX files (Debian's dataset-"
                             "fashion-mnist)")
    parser.add_argument("--records", default="runs/demo/records/train-*",
                        help="BERT records of the bert_tiny task (a glob)")
    parser.add_argument("--bert_config",
                        default="runs/demo/corpus/bert_config.json",
                        help="BERT config JSON of the bert_tiny task")
    parser.add_argument("--target", type=float, default=None,
                        help="default: 0.85 accuracy (Fashion-MNIST), 0.97 "
                             "(digits) / 5.6 MLM loss")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                        help="optimizers studied, comma-separated")
    parser.add_argument("--batches", default=None,
                        help="comma list (default: the study's)")
    parser.add_argument("--analyse_only", action="store_true",
                        help="only analyse the results already written")
    args = parser.parse_args()
    if args.task == "fashion_mnist":
        if not os.path.isdir(args.fashion_dir):
            raise SystemExit(f"--fashion_dir: {args.fashion_dir} not found "
                             "(apt-get install dataset-fashion-mnist)")
        study = fashion_task(args.fashion_dir, args.target or 0.85)
    elif args.task == "digits":
        study = digits_task(args.target or 0.97)
    else:
        study = bert_task(args.records, args.bert_config, args.target or 5.6)
    if args.batches:
        study = dataclasses.replace(
            study, batches=tuple(int(b) for b in args.batches.split(",")))
    stem = os.path.join(RESULTS, f"time_to_accuracy_{study.name}-"
                                 f"{study.digest()}")
    with open(stem + ".definition.json", "w") as f:
        json.dump(dict(study.definition(), digest=study.digest(),
                       read_from=study.source), f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"definition {study.digest()}: {stem}.jsonl", flush=True)
    results = load_results(stem + ".jsonl", study.digest())
    optimizers = args.optimizers.split(",")
    if not args.analyse_only:
        def run(optimizer, batch, rate, seed):
            for r in results:
                if (r["optimizer"], r["batch"], r["rate"], r["seed"]) == (
                        optimizer, batch, rate, seed):
                    return r
            # A rate that needs GIVE_UP times the examples of this batch's
            # best so far is not the tuned one: stop it there.
            best = best_per_batch(results, optimizer, seed).get(batch)
            budget = GIVE_UP * best["examples"] if best else None
            result = run_one(study, optimizer, batch, rate, seed,
                             budget)
            results.append(result)
            append_result(stem + ".jsonl", result)
            print(json.dumps(result), flush=True)
            return result

        for optimizer in optimizers:
            for batch in study.batches:
                low, middle, high = rates_for(study, optimizer, batch)
                runs = [run(optimizer, batch, rate, SEEDS[0])
                        for rate in (middle, high, low)]
                # The best rate at an edge of the grid: one more step
                # outward (at most EXTRA_RATES), so a tuned rate is never
                # just the grid's end.
                for _ in range(EXTRA_RATES):
                    reached = [r for r in runs if r["reached"]]
                    if not reached:
                        break
                    best = min(reached, key=lambda r: r["steps"])
                    ordered = sorted(runs, key=lambda r: r["rate"])
                    if best is ordered[-1]:
                        rate = float(f"{best['rate'] * RATE_STEPS[-1]:.3g}")
                    elif best is ordered[0]:
                        rate = float(f"{best['rate'] * RATE_STEPS[0]:.3g}")
                    else:
                        break
                    runs.append(run(optimizer, batch, rate, SEEDS[0]))
            # The second seed: every rate of a tie (the tuned rate is the one
            # with the fewest steps over both seeds), and the tuned rate at
            # the batch nearest the knee.
            for batch, rate in ties(results, optimizer):
                run(optimizer, batch, rate, SEEDS[1])
            best = best_per_batch(results, optimizer)
            fit = fit_curve(sorted(best), [best[b]["steps"]
                                           for b in sorted(best)])
            if fit:
                batch = min(best, key=lambda b: abs(math.log(b / fit[1])))
                run(optimizer, batch, best[batch]["rate"], SEEDS[1])
    section = analyse(study, results, stem + ".png")
    with open(stem + ".md", "w") as f:
        f.write(section + "\n")
    print(section)


if __name__ == "__main__":
    main()
