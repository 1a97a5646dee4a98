"""BERT pretraining as one library call.

    config = PretrainingConfig(...)      # frozen, validated
    results = train_and_evaluate(config)

`run_pretraining.py` turns flags into a `PretrainingConfig` and calls
`train_and_evaluate`; tests and notebooks call it directly. It wires
cluster -> records -> model -> Trainer, trains (resuming from the latest
checkpoint in `output_dir`), evaluates, writes Google's `eval_results.txt`,
the export and `summary.json`.

Errors the user can fix are `PretrainingError`s: one line, naming the
setting (which is also the flag's name) and the file.
"""

import dataclasses
import json
import os
import time
from typing import Optional, Tuple

import tensorflow as tf

from input_pipelines import bert_records, service, tfrecord
from input_pipelines.bert_records import BertRecordSpec, IdLimits
from input_pipelines.tfrecord import TFRecordConfig
from models import bert, bert_checkpoints, bert_export
from models.bert_config import BertConfig
from models.tasks.records import check_records
from tfscale import checkpointing, jobs
from tfscale.cluster import ClusterConfig
from tfscale.input_feed import InputPipelineError
from tfscale.optim import OptimConfig, make_optimizer
from tfscale.timing import IntervalLog
from tfscale.train_config import TrainConfig


# A problem the user can fix, in one line naming the setting (and flag).
PretrainingError = jobs.JobError


@dataclasses.dataclass(frozen=True)
class PretrainingConfig:
    """Everything a pretraining run needs.

    Attributes:
        model: The BERT architecture.
        model_name: What the run summary calls it (config file or preset).
        spec: The records' shape (max_seq_length, max_predictions_per_seq).
        train_records: Training records and how to read them.
        optim: Optimizer and schedule; `total_steps` is the run's length.
        cluster: Collective settings and timeouts.
        train: The Trainer's settings; `checkpoint_dir` must be set.
        output_dir: Checkpoints, TensorBoard, export, eval_results.txt,
            summary.json.
        do_train: Train (else only evaluate a checkpoint).
        eval_records: Evaluate on these at the end (None: no evaluation).
        eval_batch_size: Global evaluation batch.
        max_eval_steps: Evaluation batches at most.
        init_checkpoint: Initial weights when `output_dir` holds no
            checkpoint yet: Google's TF1 `bert_model.ckpt` or a tfscale
            checkpoint (prefix or directory).
        profile_steps: (first, last) steps to profile into TensorBoard.
        seed: Seed of weights, dropout and shuffling.
        deterministic: Deterministic ops and input order.
    """

    model: BertConfig
    model_name: str
    spec: BertRecordSpec
    train_records: TFRecordConfig
    optim: OptimConfig
    cluster: ClusterConfig
    train: TrainConfig
    output_dir: str
    do_train: bool = True
    eval_records: Optional[TFRecordConfig] = None
    eval_batch_size: int = 32
    max_eval_steps: int = 100
    init_checkpoint: Optional[str] = None
    profile_steps: Optional[Tuple[int, int]] = None
    seed: int = 12345
    deterministic: bool = False

    def __post_init__(self):
        jobs.check_job_config(output_dir=self.output_dir, train=self.train,
                              do_train=self.do_train,
                              evaluates=self.eval_records is not None)
        if self.optim.total_steps < 1:
            raise ValueError(f"num_train_steps must be >= 1, got "
                             f"{self.optim.total_steps}")
        if self.eval_batch_size < 1 or self.max_eval_steps < 1:
            raise ValueError("eval_batch_size and max_eval_steps must be >= 1")
        if self.profile_steps and not (
                1 <= self.profile_steps[0] <= self.profile_steps[1]):
            raise ValueError(f"profile_steps must be 'first,last' with "
                             f"1 <= first <= last, got {self.profile_steps}")

    @property
    def num_train_steps(self) -> int:
        return self.optim.total_steps


def train_and_evaluate(config: PretrainingConfig) -> dict:
    """Runs the whole job on this worker (every worker calls it).

    Returns:
        The results also written to `summary.json` (steps, wall time, log
        intervals, checkpoint, eval metrics).

    Raises:
        PretrainingError: Bad records, files, checkpoint or cluster setup.
        Preempted: SIGTERM; the agreed step is saved (exit code 143).
    """
    train_files, eval_files = check_records(
        config.train_records, config.eval_records, do_train=config.do_train,
        train_flag="input_file", eval_flag="eval_input_file")
    info, strategy = jobs.start_worker(
        config.cluster, output_dir=config.output_dir,
        precision=config.train.precision, seed=config.seed,
        deterministic=config.deterministic)

    limits = IdLimits(config.model.vocab_size, config.model.type_vocab_size)
    # One record of each set, before the model is built (after the strategy:
    # collectives must be configured before TensorFlow's first op): a wrong
    # length or vocabulary is a one-line error now, not a parse error later.
    for files, setting, records in (
            (train_files, "input_file", config.train_records),
            (eval_files, "eval_input_file", config.eval_records)):
        if files:
            try:
                bert_records.check_first_record(
                    files, config.spec, limits, records.compression_type)
            except tfrecord.InputError as e:
                raise PretrainingError(setting, str(e)) from None
    with strategy.scope():
        try:
            model = bert.make_pretrainer(config.model,
                                         config.spec.max_seq_length,
                                         config.spec.max_predictions_per_seq)
        except ValueError as e:
            raise PretrainingError("max_seq_length", str(e)) from None
        optimizer = make_optimizer(config.optim, config.train.global_batch_size,
                                   model.trainable_variables)
        metrics = bert.pretraining_metrics()
    trainer = jobs.make_trainer(
        model=model, optimizer=optimizer, loss_fn=bert.pretraining_loss,
        strategy=strategy, metrics=metrics, cluster=config.cluster,
        train=config.train)
    if info.is_chief:
        print(run_summary(config, info, trainer, model), flush=True)

    start = time.perf_counter()
    initial = _initial_weights(config, model)
    if initial and info.is_chief:
        print(f"tfscale: model weights from {initial}", flush=True)
    intervals = IntervalLog()
    if config.do_train:
        dataset_fn = bert_records.make_dataset_fn(
            config.train_records, config.spec, trainer.per_replica_batch_size,
            limits)
        try:
            intervals = jobs.fit(trainer, dataset_fn, config.num_train_steps,
                                 config.output_dir, config.profile_steps)
        except tfrecord.InputError as e:  # a file changed since the start
            raise PretrainingError("input_file", str(e)) from None
        except InputPipelineError as e:
            raise PretrainingError("input_file", _diagnose(
                train_files, config.train_records, config, limits, e)) from e
    else:
        trainer.step.assign(checkpointing.checkpoint_step(initial))
    results = jobs.run_results(trainer, info, config.cluster.backend,
                               time.perf_counter() - start, intervals)
    results["checkpoint"] = trainer.checkpoint_path or initial
    if config.eval_records:
        results["eval"] = _evaluate(config, trainer, eval_files, limits)
        if info.is_chief:
            write_eval_results(config.output_dir, results["steps"],
                               results["eval"])
    if info.is_chief:
        if config.do_train:
            results["export"] = bert_export.export(
                model, os.path.join(config.output_dir, "export"))
        with open(os.path.join(config.output_dir, "summary.json"), "w") as f:
            json.dump(results, f, indent=2)
        print(jobs.done_summary("tfscale run_pretraining", results),
              flush=True)
    # Exit together, once the chief's files are written.
    trainer.leave_together()
    return results


def _initial_weights(config: PretrainingConfig, model) -> Optional[str]:
    """Loads --init_checkpoint (when output_dir has no checkpoint yet) or,
    evaluating only, the latest checkpoint; returns what was loaded."""
    checkpoint_dir = config.train.checkpoint_dir
    try:
        if config.init_checkpoint and not tf.train.latest_checkpoint(
                checkpoint_dir):
            return load_initial_weights(model, config.init_checkpoint)
        if not config.do_train:
            return checkpointing.restore_model(model, checkpoint_dir)
    except (checkpointing.RestoreError,
            bert_checkpoints.GoogleCheckpointError) as e:
        if config.init_checkpoint:
            raise PretrainingError("init_checkpoint", str(e)) from None
        raise PretrainingError(
            "do_train", f"evaluating only needs --init_checkpoint or a "
            f"checkpoint in --output_dir: {e}") from None
    return None


def load_initial_weights(model, path: str) -> str:
    """Google's TF1 name-based checkpoint (bert_model.ckpt) or a tfscale
    checkpoint (prefix or directory) -> `model`'s weights; returns the
    prefix read. Step and optimizer are not touched."""
    prefix = tf.train.latest_checkpoint(path) if tf.io.gfile.isdir(path) else path
    try:
        name_based = bool(prefix) and bert_checkpoints.is_name_based(prefix)
    except (tf.errors.OpError, ValueError):
        raise checkpointing.RestoreError(f"no checkpoint at {path}") from None
    if name_based:
        return bert_checkpoints.load_google_checkpoint(model, prefix)
    return checkpointing.restore_model(model, path)


def _evaluate(config, trainer, files, limits) -> dict:
    replicas = trainer.collectives.num_replicas
    eval_fn = bert_records.make_dataset_fn(
        config.eval_records, config.spec,
        max(1, config.eval_batch_size // replicas), limits)
    try:
        return trainer.evaluate(eval_fn, steps=config.max_eval_steps)
    except InputPipelineError as e:
        raise PretrainingError("eval_input_file", _diagnose(
            files, config.eval_records, config, limits, e)) from e


def _diagnose(files, records, config, limits, error) -> str:
    """Names the file, record and cause of an input pipeline failure
    (`records`: the failing set's TFRecordConfig)."""
    culprit = bert_records.find_bad_record(
        files, config.spec, limits, records.compression_type)
    if culprit:
        return f"bad input record: {culprit}"
    return service.worker_message(str(error))


# Google's eval_results.txt keys <- tfscale's evaluation logs.
GOOGLE_EVAL_KEYS = {"loss": "loss", "masked_lm_accuracy": "mlm_accuracy",
                    "masked_lm_loss": "mlm_loss",
                    "next_sentence_accuracy": "nsp_accuracy",
                    "next_sentence_loss": "nsp_loss"}


def write_eval_results(output_dir: str, global_step: int, logs: dict) -> str:
    """`eval_results.txt` as Google's run_pretraining.py writes it."""
    values = {"global_step": global_step}
    values.update({google: logs[ours]
                   for google, ours in GOOGLE_EVAL_KEYS.items()})
    path = os.path.join(output_dir, "eval_results.txt")
    with open(path, "w") as f:
        for key in sorted(values):
            f.write(f"{key} = {values[key]}\n")
    return path


def run_summary(config: PretrainingConfig, info, trainer, model) -> str:
    optim = config.optim
    params = sum(int(v.numpy().size) for v in model.trainable_variables)
    return "\n".join([
        "tfscale run_pretraining",
        jobs.workers_line(info, trainer),
        f"  model {config.model_name}: {config.model.num_hidden_layers} "
        f"layers, hidden {config.model.hidden_size}, vocab "
        f"{config.model.vocab_size}, {params / 1e6:.2f}M parameters",
        jobs.numerics_line(config.train, config.cluster),
        "  " + tfrecord.describe_input(config.train_records),
        f"  optimizer {optim.optimizer}, lr {optim.learning_rate:g} "
        f"({optim.schedule}, warmup {optim.warmup_steps}, scaling "
        f"{optim.scaling_rule}), {optim.total_steps} steps"])
