"""BERT pretraining as one library call.

    config = PretrainingConfig(...)      # frozen, validated
    results = train_and_evaluate(config)

`run_pretraining.py` turns flags into a `PretrainingConfig` and calls
`train_and_evaluate`; tests and notebooks call it directly. It is the job
skeleton (`tfscale.jobs.run`) around BERT's records and model: it trains
(from --init_checkpoint, Google's or tfscale's, or resuming from the latest
checkpoint in `output_dir`), evaluates, and writes Google's
`eval_results.txt`, the export and `summary.json`.

Errors the user can fix are `jobs.JobError`s: one line, naming the
setting (which is also the flag's name) and the file.
"""

import dataclasses
import os
from typing import List, Optional

import tensorflow as tf

from input_pipelines import bert_records
from input_pipelines.bert_records import BertRecordSpec, IdLimits
from models import bert, bert_checkpoints, bert_export
from models.bert_config import BertConfig
from models.tasks.records import RecordsJobConfig, RecordsTask
from tfscale import jobs
from models.tasks import dllogger
from tfscale.resume import checkpoints as checkpointing


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainingConfig(RecordsJobConfig):
    """Everything a pretraining run needs: the `JobConfig` and
    `RecordsJobConfig` fields, and

    Attributes:
        model: The BERT architecture.
        model_name: What the run summary calls it (config file or preset).
        spec: The records' shape (max_seq_length, max_predictions_per_seq).
        init_checkpoint: Initial weights when `output_dir` holds no
            checkpoint yet: Google's TF1 `bert_model.ckpt` or a tfscale
            checkpoint (prefix or directory).
        dllog_path: DLLogger's JSON-lines log, written by the chief
            (NVIDIA's --dllog_path); None: none.
        list_variables: The start banner lists every trainable variable
            (NVIDIA's --verbose_logging).
        pretrained_prefix: Where the chief also writes the trained model
            at the end, with Google's names (NVIDIA's sub-model export,
            `<model_dir>/pretrained/bert_model.ckpt-1`, which its phase-2
            command reads as --init_checkpoint); None: not written.
        recompute_activations: Each transformer layer's forward runs again
            in the backward pass instead of keeping its activations
            (`bert.BertEncoder`).
        dropout_bits: Random bits per dropout element: 32 or 16
            (`elementwise.dropout`).
    """

    model: BertConfig
    model_name: str
    spec: BertRecordSpec
    init_checkpoint: Optional[str] = None
    max_eval_steps: Optional[int] = 100
    dllog_path: Optional[str] = None
    list_variables: bool = False
    pretrained_prefix: Optional[str] = None
    recompute_activations: bool = False
    dropout_bits: int = 32

    def __post_init__(self):
        super().__post_init__()
        if self.dropout_bits not in (16, 32):
            raise ValueError(f"dropout_bits must be 16 or 32, got "
                             f"{self.dropout_bits}")

    @property
    def num_train_steps(self) -> int:
        return self.optim.total_steps


def train_and_evaluate(config: PretrainingConfig) -> dict:
    """Runs the whole job on this worker (every worker calls it).

    Returns:
        The results also written to `summary.json` (steps, wall time, log
        intervals, checkpoint, eval metrics, export).

    Raises:
        jobs.JobError: Bad records, files, checkpoint or cluster setup.
        Preempted: SIGTERM; the agreed step is saved (exit code 143).
    """
    return jobs.run(Pretraining(config))


class Pretraining(RecordsTask):
    """BERT's masked LM and next sentence prediction on Google's records."""

    title = "tfscale run_pretraining"
    train_flag = "input_file"
    eval_flag = "eval_input_file"
    eval_weights = "--init_checkpoint or a checkpoint in --output_dir"

    def __init__(self, config: PretrainingConfig):
        super().__init__(config)
        self.limits = IdLimits(config.model.vocab_size,
                               config.model.type_vocab_size)

    def check_first_record(self, files, records):
        bert_records.check_first_record(files, self.config.spec, self.limits,
                                        records.compression_type)

    def find_bad_record(self, files, records):
        return bert_records.find_bad_record(
            files, self.config.spec, self.limits, records.compression_type)

    def build(self) -> jobs.Built:
        config = self.config
        with jobs.blame("max_seq_length", ValueError):
            # --deterministic: a step with no scatter (XLA on a GPU runs a
            # deterministic scatter as a loop; `models/gathers.py`).
            model = bert.make_pretrainer(
                config.model, config.spec.max_seq_length,
                config.spec.max_predictions_per_seq,
                recompute_activations=config.recompute_activations,
                scatter_free=config.deterministic,
                dropout_bits=config.dropout_bits)
        return jobs.Built(model,
                          bert.make_pretraining_loss(config.deterministic),
                          bert.pretraining_metrics())

    def dataset_fn(self, per_replica_batch, training):
        records = (self.config.train_records if training
                   else self.config.eval_records)
        return bert_records.make_dataset_fn(records, self.config.spec,
                                            per_replica_batch, self.limits)

    def initial_weights(self, model) -> Optional[str]:
        """--init_checkpoint, when output_dir has no checkpoint yet."""
        config = self.config
        if not config.init_checkpoint or tf.train.latest_checkpoint(
                config.train.checkpoint_dir):
            return None
        with jobs.blame("init_checkpoint", checkpointing.RestoreError,
                        bert_checkpoints.GoogleCheckpointError):
            return load_initial_weights(model, config.init_checkpoint)

    def describe(self, model) -> List[str]:
        config = self.config
        variables = ([f"  {v.path} {list(v.shape)}"
                      for v in model.trainable_variables]
                     if config.list_variables else [])
        return [f"model {config.model_name}: "
                f"{config.model.num_hidden_layers} layers, hidden "
                f"{config.model.hidden_size}, vocab {config.model.vocab_size}, "
                f"{jobs.millions_of_parameters(model):.2f}M parameters",
                *variables, *super().describe(model)[1:]]

    def callbacks(self, trainer) -> list:
        return dllogger.make(self.config.dllog_path, trainer)

    def finish(self, results: dict, model) -> None:
        """Google's eval_results.txt and the encoder's export."""
        output_dir = self.config.output_dir
        if "eval" in results:
            write_eval_results(output_dir, results["steps"], results["eval"])
        if self.config.do_train:
            results["export"] = bert_export.export(
                model, os.path.join(output_dir, "export"))
            if self.config.pretrained_prefix:
                tf.io.gfile.makedirs(
                    os.path.dirname(self.config.pretrained_prefix))
                results["pretrained"] = bert_checkpoints.save_google_checkpoint(
                    model, self.config.pretrained_prefix)


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
