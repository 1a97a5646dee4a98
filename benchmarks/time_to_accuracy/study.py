"""What a time-to-accuracy study is, and one run of it: the study's
definition and its digest (`Study`), the callback that stops a run at the
target (`UntilTarget`), and the run itself through the job skeleton
(`run_one`). The sweep over batches and rates is `sweep.py`; the tasks
`tasks.py`; the tables and fits `analysis.py`."""

import dataclasses
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

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.time_to_accuracy import behaviour as study_behaviour  # noqa: E402
from tfscale import jobs  # noqa: E402
from tfscale.noise import advice as noise_advice  # noqa: E402
from tfscale.cluster.environment import ClusterConfig  # noqa: E402
from tfscale.noise.scale import NoiseScaleConfig  # noqa: E402
from tfscale.optim import OptimConfig  # noqa: E402
from tfscale.train_config import TrainConfig  # noqa: E402


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


def data_of(paths) -> dict:
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
