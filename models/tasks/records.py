"""What every job checks of its records before it starts TensorFlow's
cluster: the files exist, the training files index, the tf.data service
answers. Errors are `JobError`s naming the flag."""

from typing import List, Optional, Tuple

from input_pipelines import service, tfrecord
from input_pipelines.tfrecord import TFRecordConfig
from tfscale import jobs


def check_records(train: TFRecordConfig, evaluation: Optional[TFRecordConfig],
                  *, do_train: bool, train_flag: str, eval_flag: str
                  ) -> Tuple[List[str], Optional[List[str]]]:
    """(training files, evaluation files or None).

    Raises:
        JobError: A pattern matches nothing, a training file does not
            index (`train_flag`, `eval_flag`), or the service does not
            answer (--data_service).
    """
    with jobs.blame(train_flag, tfrecord.InputError):
        train_files = tfrecord.expand_files(train.input_files)
        if do_train:
            tfrecord.check_index(train)
    if do_train and train.service:
        with jobs.blame("data_service", service.ServiceError):
            service.check_reachable(train.service)
    eval_files = None
    if evaluation:
        with jobs.blame(eval_flag, tfrecord.InputError):
            eval_files = tfrecord.expand_files(evaluation.input_files)
    return train_files, eval_files
