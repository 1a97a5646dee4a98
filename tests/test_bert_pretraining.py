"""`train_and_evaluate` in process, and bad input on the flagship path.

Fast: a few steps of a tiny BERT on tiny records, no worker processes (the
multi-process runs are in test_pretraining.py and test_google_flags.py).
"""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from input_pipelines import bert_records, tfrecord
from input_pipelines.bert_records import BertRecordSpec, IdLimits
from input_pipelines.tfrecord import TFRecordConfig
from models import bert_config
from models.tasks.pretraining import PretrainingConfig, train_and_evaluate
from tests.conftest import run_command
from tfscale.cluster.environment import ClusterConfig
from tfscale.jobs import JobError
from tfscale.optim import OptimConfig
from tfscale.train_config import TrainConfig

SPEC = BertRecordSpec(max_seq_length=16, max_predictions_per_seq=3)
VOCAB = 64


def write_records(path, n=64, spec=SPEC, max_id=VOCAB - 1, seed=0):
    rng = np.random.default_rng(seed)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for _ in range(n):
            length = int(rng.integers(8, spec.max_seq_length + 1))
            ids = rng.integers(5, max_id + 1, length).tolist()
            positions = sorted(rng.choice(np.arange(1, length), size=min(
                spec.max_predictions_per_seq, length - 1), replace=False))
            writer.write(bert_records.serialize_instance(
                ids, [0] * length, [int(p) for p in positions],
                [ids[p] for p in positions], bool(rng.integers(2)), spec))
    return str(path)


def make_config(tmp_path, input_file, **overrides):
    model = bert_config.preset("bert_tiny", vocab_size=VOCAB,
                               max_position_embeddings=32)
    out = str(tmp_path / "out")
    values = dict(
        model=model, model_name="bert_tiny", spec=SPEC,
        train_records=TFRecordConfig(input_file, shuffle_buffer_size=64,
                                     seed=1, block_length=8),
        optim=OptimConfig(optimizer="adamw", learning_rate=1e-3,
                          warmup_steps=1, total_steps=4),
        cluster=ClusterConfig(),
        train=TrainConfig(global_batch_size=8, log_steps=2,
                          checkpoint_dir=os.path.join(out, "checkpoints"),
                          save_checkpoints_steps=2, verbose=0),
        output_dir=out,
        eval_records=TFRecordConfig(input_file, training=False),
        eval_batch_size=8, max_eval_steps=2)
    values.update(overrides)
    return PretrainingConfig(**values)


@pytest.fixture
def records(tmp_path):
    return write_records(tmp_path / "train.tfrecord")


def test_train_and_evaluate_in_process(tmp_path, records):
    config = make_config(tmp_path, records)
    results = train_and_evaluate(config)
    assert results["steps"] == 4 and len(results["intervals"]) == 2
    out = tmp_path / "out"
    lines = (out / "eval_results.txt").read_text().splitlines()
    assert [line.split(" = ")[0] for line in lines] == [
        "global_step", "loss", "masked_lm_accuracy", "masked_lm_loss",
        "next_sentence_accuracy", "next_sentence_loss"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    assert (out / "export" / "encoder.weights.h5").exists()
    # Evaluating only: the latest checkpoint, the same metrics.
    again = train_and_evaluate(dataclasses.replace(config, do_train=False))
    assert again["steps"] == 4
    assert again["eval"] == pytest.approx(results["eval"], rel=1e-6)


def test_config_is_frozen_and_validated(tmp_path, records):
    config = make_config(tmp_path, records)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.output_dir = "elsewhere"
    with pytest.raises(ValueError, match="both False"):
        make_config(tmp_path, records, do_train=False, eval_records=None)
    with pytest.raises(ValueError, match="cycle_length must be >= 1"):
        TFRecordConfig(records, cycle_length=-1)


def test_ids_beyond_the_vocabulary_are_named(tmp_path):
    # Records made with a 100-token vocabulary, model of 64: the first record
    # is checked before anything is built.
    bad = write_records(tmp_path / "other-vocab.tfrecord", max_id=99)
    with pytest.raises(JobError) as info:
        train_and_evaluate(make_config(tmp_path, bad))
    message = str(info.value)
    assert message.startswith(f"--input_file: {bad}: record 0: ")
    assert "outside [0, 64) of the model's vocab_size" in message


def test_ids_beyond_the_vocabulary_later_in_the_files_are_named(tmp_path):
    # A good first file passes the start-up check; the pipeline's own check
    # catches the second file, and the scan names it and the record.
    good = write_records(tmp_path / "a.tfrecord")
    bad = write_records(tmp_path / "b.tfrecord", max_id=99)
    config = make_config(tmp_path, f"{good},{bad}", eval_records=None)
    with pytest.raises(JobError) as info:
        train_and_evaluate(config)
    message = str(info.value)
    assert message.startswith(f"--input_file: bad input record: {bad}: record ")
    assert "input_ids holds id " in message
    assert "outside [0, 64) of the model's vocab_size" in message


def test_pipeline_checks_ids_in_every_batch(tmp_path):
    bad = write_records(tmp_path / "b.tfrecord", max_id=99)
    parse = bert_records.make_parse_fn(SPEC, IdLimits(VOCAB, 2))
    with pytest.raises(tf.errors.InvalidArgumentError, match="vocab_size"):
        list(tfrecord.make_dataset(TFRecordConfig(bad, training=False), 8,
                                   parse))
    # Records within range pass the same parse untouched.
    good = write_records(tmp_path / "a.tfrecord")
    plain = list(tfrecord.make_dataset(TFRecordConfig(good, training=False), 8,
                                       bert_records.make_parse_fn(SPEC)))
    checked = list(tfrecord.make_dataset(TFRecordConfig(good, training=False),
                                         8, parse))
    for (x1, y1), (x2, y2) in zip(plain, checked):
        for key in x1:
            np.testing.assert_array_equal(x1[key], x2[key])


@pytest.mark.parametrize("spec, expected", [
    (BertRecordSpec(32, 3), "input_ids has 16 values per record, but "
                            "--max_seq_length=32 expects 32"),
    (BertRecordSpec(16, 5), "masked_lm_positions has 3 values per record, but "
                            "--max_predictions_per_seq=5 expects 5"),
])
def test_records_of_another_length_are_named(tmp_path, records, spec,
                                             expected):
    with pytest.raises(JobError) as info:
        train_and_evaluate(make_config(tmp_path, records, spec=spec))
    assert str(info.value) == f"--input_file: {records}: record 0: {expected} " \
        f"(records written for another {expected.split('--')[1].split('=')[0]}?)"


def test_a_directory_as_input_file_is_rejected_first(tmp_path, records):
    with pytest.raises(match=(
            rf"^--input_file: {tmp_path} is a directory, not a record file; "
            rf"name the files, e\.g\. '{tmp_path}/\*\.tfrecord'$")):
        train_and_evaluate(make_config(tmp_path, str(tmp_path)))


def test_a_model_bug_is_not_blamed_on_the_records(tmp_path, records,
                                                  monkeypatch):
    # An error in the step (not the input pipeline) keeps its traceback and
    # does not start a scan of the input files.
    from models import bert
    from input_pipelines import bert_records as records_module

    def broken_loss(labels, outputs):
        tf.debugging.assert_less(tf.constant(1), tf.constant(0),
                                 message="model bug")
        return bert.pretraining_loss(labels, outputs)

    def no_scan(*args, **kwargs):
        raise AssertionError("the records were scanned for a model error")

    monkeypatch.setattr(bert, "pretraining_loss", broken_loss)
    monkeypatch.setattr(records_module, "find_bad_record", no_scan)
    with pytest.raises(tf.errors.InvalidArgumentError, match="model bug"):
        train_and_evaluate(make_config(tmp_path, records, eval_records=None))


@pytest.mark.slow
def test_command_line_vocab_mismatch_is_one_line(tmp_path):
    bad = write_records(tmp_path / "other-vocab.tfrecord", max_id=99)
    code, output = run_command(
        [sys.executable, "run_pretraining.py", f"--input_file={bad}",
         f"--output_dir={tmp_path / 'out'}", "--vocab_size=64",
         "--max_seq_length=16", "--max_predictions_per_seq=3",
         "--train_batch_size=8", "--num_train_steps=2",
         "--num_warmup_steps=1"], timeout=200)
    assert code == 2  # no restart repeats it
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"run_pretraining: error: --input_file: {bad}: "
                           "record 0: input_ids holds id ")
    assert "outside [0, 64) of the model's vocab_size" in last


def corrupt_one_token(path, record):
    """One byte of one token id of `record` changed, its CRC left stale
    (a flipped bit on a disk or a copy)."""
    from input_pipelines.record_order import index as record_index
    offsets = record_index.load([path])[0]
    end = int(offsets[record + 1])
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        start = int(offsets[record]) + 12
        # The first input_ids byte: the payload holds the features by name.
        at = data.index(b"input_ids", start) + 20
        assert at < end - 4
        data[at] ^= 0x01
        f.seek(0)
        f.write(data)


def test_a_record_with_a_stale_crc_is_named_and_not_trained_on(tmp_path):
    """A byte of one token changed (TensorFlow's reader: "corrupted
    record"): the run stops at the batch that holds it, naming the file
    and the record (before: exit 0, 138 of 139 variables different from a
    clean run). --verify_records=false reads it, and the banner says so."""
    bad = write_records(tmp_path / "train.tfrecord")
    corrupt_one_token(bad, 40)
    config = make_config(tmp_path, bad, eval_records=None,
                         optim=OptimConfig(optimizer="adamw",
                                           learning_rate=1e-3, warmup_steps=1,
                                           total_steps=8))
    with pytest.raises(JobError) as info:
        train_and_evaluate(config)
    message = str(info.value)
    assert "\n" not in message
    assert f"{bad}: record 40 is corrupt: its CRC-32C does not match" in \
        message
    unchecked = dataclasses.replace(config, train_records=dataclasses.replace(
        config.train_records, verify_records=False),
        output_dir=str(tmp_path / "unchecked"))
    assert tfrecord.describe_input(unchecked.train_records).endswith(
        "; CRCs not checked (--verify_records=false)")


def test_a_corrupt_record_on_the_command_line_is_exit_2_and_one_line(
        tmp_path):
    bad = write_records(tmp_path / "train.tfrecord")
    corrupt_one_token(bad, 40)
    code, output = run_command(
        [sys.executable, "run_pretraining.py", f"--input_file={bad}",
         f"--output_dir={tmp_path / 'out'}", "--vocab_size=64",
         "--max_seq_length=16", "--max_predictions_per_seq=3",
         "--train_batch_size=8", "--num_train_steps=8",
         "--num_warmup_steps=1"], timeout=200)
    assert code == 2, output[-3000:]  # launchers do not restart it
    last = output.strip().splitlines()[-1]
    assert last.startswith("run_pretraining: error: --input_file: ")
    assert f"{bad}: record 40 is corrupt: its CRC-32C" in last


def test_four_of_eight_shards_are_refused_and_trained_with_the_flag(
        tmp_path):
    for i in range(4):
        write_records(tmp_path / f"train-{i:05d}-of-00008.tfrecord", n=16,
                      seed=i)
    pattern = str(tmp_path / "train-*")
    config = make_config(tmp_path, pattern, eval_records=None)
    with pytest.raises(JobError) as info:
        train_and_evaluate(config)
    assert str(info.value).startswith(
        "--input_file: 4 shard(s) of train-00004-of-00008.tfrecord's set are "
        "missing: train-00004-of-00008.tfrecord, ")
    partial = dataclasses.replace(config, train_records=dataclasses.replace(
        config.train_records, allow_partial_shards=True))
    assert train_and_evaluate(partial)["steps"] == 4
