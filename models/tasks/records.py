"""The part of a job that reads TFRecords, shared by the BERT and image jobs.

A `RecordsTask` checks its records before TensorFlow's cluster starts (the
files exist, the training files index, the tf.data service answers), reads
the first record of each set once the cluster is up (a wrong shape or
vocabulary is one line before the model is built), and names the file and
record when the pipeline fails later. Errors are `JobError`s naming the
flag.
"""

import contextlib
import dataclasses
from typing import List, Optional, Tuple

from input_pipelines import record_files, service, tfrecord
from input_pipelines.tfrecord import TFRecordConfig
from tfscale import jobs
from tfscale.step.feed import InputPipelineError


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordsJobConfig(jobs.JobConfig):
    """A `JobConfig` whose data are TFRecords.

    Attributes:
        train_records: Training records and how to read them.
        eval_records: Evaluate on these at the end (None: no evaluation).
    """

    train_records: TFRecordConfig
    eval_records: Optional[TFRecordConfig] = None

    @property
    def evaluates(self) -> bool:
        return self.eval_records is not None


class RecordsTask(jobs.Task):
    """A `Task` over `RecordsJobConfig` records; subclasses read them.

    Attributes:
        train_flag, eval_flag: The flags that name the two sets.
        bad_record_hint: Appended to a bad record's error line.
    """

    train_flag = "train_files"
    eval_flag = "eval_files"
    bad_record_hint = ""

    def check_first_record(self, files: List[str], records: TFRecordConfig
                           ) -> None:
        """Raises `record_files.InputError` naming the file when its first
        record does not fit the model."""

    def find_bad_record(self, files: List[str], records: TFRecordConfig
                        ) -> Optional[str]:
        """"file: record N: cause" of the first bad record, or None."""
        return None

    def check_files(self) -> None:
        config = self.config
        self.train_files, self.eval_files = check_records(
            config.train_records, config.eval_records,
            do_train=config.do_train, train_flag=self.train_flag,
            eval_flag=self.eval_flag)

    def check_inputs(self) -> None:
        for files, flag, records in (
                (self.train_files, self.train_flag, self.config.train_records),
                (self.eval_files, self.eval_flag, self.config.eval_records)):
            if files:
                with jobs.blame(flag, record_files.InputError):
                    self.check_first_record(files, records)

    @contextlib.contextmanager
    def reading(self, training: bool):
        flag = self.train_flag if training else self.eval_flag
        files = self.train_files if training else self.eval_files
        records = (self.config.train_records if training
                   else self.config.eval_records)
        try:
            yield
        except record_files.InputError as e:  # a file changed since the start
            raise jobs.JobError(flag, str(e)) from None
        except InputPipelineError as e:
            # The global order's reader names the file and record itself (a
            # CRC, a length, a file changed under the run); else the scan.
            said = record_files.reader_error(str(e.__cause__ or e))
            if said:
                raise jobs.JobError(flag, said) from e
            culprit = self.find_bad_record(files, records)
            message = (f"bad input record: {culprit}{self.bad_record_hint}"
                       if culprit else service.worker_message(str(e)))
            raise jobs.JobError(flag, message) from e

    def describe(self, model) -> List[str]:
        return [*super().describe(model),
                tfrecord.describe_input(self.config.train_records)]


def check_records(train: TFRecordConfig, evaluation: Optional[TFRecordConfig],
                  *, do_train: bool, train_flag: str, eval_flag: str
                  ) -> Tuple[List[str], Optional[List[str]]]:
    """(training files, evaluation files or None).

    Raises:
        JobError: A pattern matches nothing, a training file does not
            index (`train_flag`, `eval_flag`), or the service does not
            answer (--data_service).
    """
    with jobs.blame(train_flag, record_files.InputError):
        train_files = record_files.expand_files(
            train.input_files, train.allow_partial_shards)
        if do_train:
            tfrecord.check_index(train)
    if do_train and train.service:
        with jobs.blame("data_service", service.ServiceError,
                        restartable=True):
            service.check_reachable(train.service)
    eval_files = None
    if evaluation:
        with jobs.blame(eval_flag, record_files.InputError):
            eval_files = record_files.expand_files(
                evaluation.input_files, tfrecord.partial_shards(evaluation))
    return train_files, eval_files
