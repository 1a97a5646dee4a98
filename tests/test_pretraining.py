"""run_pretraining.py end to end, on records made by our writer."""

import json
import os
import re
import shutil
import sys

import pytest

from tests.conftest import run_command, run_workers

pytestmark = pytest.mark.slow
# Without part-by-part timed steps, which trace the step a second time
# (about a fifth of a short run's CPU); a user's default run, with them, is
# test_two_workers_loss_falls_checkpoints_once_and_resume.
COMMON = ["--max_seq_length=32", "--max_predictions_per_seq=5",
          "--train_batch_size=32", "--learning_rate=5e-3",
          "--num_warmup_steps=5", "--log_steps=5", "--optimizer=lamb",
          "--timed_steps_per_log=0"]


def test_records_writer_rerun_keeps_complete_shards_same_bytes(corpus,
                                                                tmp_path):
    """create_pretraining_data in 2 writer processes; the state a crash
    leaves (a shard missing, one renamed but not indexed, a hidden partial
    file) is repaired by the same command: the shards end byte for byte as
    an uninterrupted run wrote them."""
    def write(folder, *extra):
        code, output = run_command(
            [sys.executable, "-m", "input_pipelines.create_pretraining_data",
             f"--input_file={corpus}/corpus.txt",
             f"--vocab_file={corpus}/vocab.txt",
             f"--output_file={folder}/train.tfrecord",
             "--num_output_shards=4", "--max_seq_length=32",
             "--max_predictions_per_seq=5", "--dupe_factor=2", *extra],
            timeout=300)
        assert code == 0, output
        return output
    whole = tmp_path / "whole"
    write(whole, "--num_processes=1")
    crashed = tmp_path / "crashed"
    output = write(crashed, "--num_processes=2")
    names = sorted(f for f in os.listdir(whole) if f.startswith("train-"))
    assert len(names) == 4
    for name in names:  # processes or not: the same bytes
        assert (crashed / name).read_bytes() == (whole / name).read_bytes()
    os.remove(crashed / names[3])
    os.remove(crashed / ".tfscale-index" / (names[1] + ".index.npz"))
    (crashed / f".{names[3]}.incomplete").write_bytes(b"half")
    # An index write killed before its rename (record_index.write).
    index_partial = (crashed / ".tfscale-index" /
                     f"{names[1]}.index.npz.{'0' * 32}.partial")
    index_partial.write_bytes(b"half")
    # A killed run of other settings left its bucket folder.
    (crashed / ".train.buckets-0123456789abcdef").mkdir()
    output = write(crashed, "--num_processes=2")
    assert "kept 2 complete shards of an earlier run" in output, output
    for name in names:
        assert (crashed / name).read_bytes() == (whole / name).read_bytes()
    assert not [f for f in os.listdir(crashed) if f.endswith(".incomplete")]
    assert not index_partial.exists()
    assert not [f for f in os.listdir(crashed) if ".buckets-" in f]
    # (Another plan keeps nothing: tests/test_images.py.)


def pretrain_args(corpus, output_dir, steps, *extra):
    return [f"--input_file={corpus}/records/train-*.tfrecord",
            f"--output_dir={output_dir}",
            f"--bert_config_file={corpus}/bert_config.json",
            f"--num_train_steps={steps}", "--save_checkpoints_steps=10",
            *COMMON, *extra]


def run_pretraining(num_workers, args, timeout=400):
    return run_workers(num_workers, ["run_pretraining", *args], timeout=timeout)


def test_two_workers_loss_falls_checkpoints_once_and_resume(corpus, tmp_path):
    out = tmp_path / "run"
    _, output = run_pretraining(2, pretrain_args(
        corpus, out, 40, "--timed_steps_per_log=4",  # the default's
        "--heartbeat_timeout=45"))
    # As TensorFlow's coordination service holds it, not the flag's text.
    assert ", all-reduce ring (auto), a worker silent 45 s is held lost" \
        in output, output[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_workers"] == 2 and summary["steps"] == 40
    losses = [row["interval_loss"] for row in summary["intervals"]]
    assert len(losses) == 8
    # Every worker's own split, gathered by the chief at each interval.
    assert all(sorted(row["workers"]) == ["0", "1"] and
               row["workers"]["1"]["compute"] > 0
               for row in summary["intervals"])
    assert losses[-1] < losses[0] - 0.3, losses
    checkpoints = sorted(f for f in os.listdir(out / "checkpoints")
                         if f.endswith(".index"))
    assert checkpoints == ["ckpt-10.index", "ckpt-20.index", "ckpt-30.index",
                           "ckpt-40.index"]
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator)
    events = EventAccumulator(str(out / "tensorboard" / "train"))
    events.Reload()
    tags = set(events.Tags()["tensors"])
    assert {"batch_loss", "batch_learning_rate", "batch_examples_per_second",
            "batch_sync", "batch_compute", "batch_worker1/compute"} <= tags
    assert output.count("tfscale run_pretraining done") == 1  # chief only
    # The closing lines say where the numbers are.
    assert (f"  numbers: {out}/summary.json (every log interval, each "
            f"worker's time split); curves: tensorboard --logdir "
            f"{out}/tensorboard") in output
    # Quiet: tfscale's lines, not TensorFlow's INFO per collective or per
    # checkpoint shard, and no abort line at a normal end.
    assert output.count("tfscale: saved checkpoint") == 4  # not twice at 40
    for noise in ("cross_device_ops.py", "Collective all_reduce tensors",
                  "Sharding callback duration", "coordination_service",
                  "heartbeat"):
        assert noise not in output, noise

    # Resumed on a record set with a shard more: the position of step 40
    # belongs to the old set's order, so the new order starts at its next
    # epoch, and the log says why.
    more = tmp_path / "more"
    shutil.copytree(corpus / "records", more)
    first = sorted(more.glob("train-*.tfrecord"))[0]
    shutil.copy(first, more / "train-extra.tfrecord")
    args = pretrain_args(corpus, out, 50)
    args[0] = f"--input_file={more}/train-*.tfrecord"
    _, output = run_pretraining(2, args)
    assert f"resumed from {out}/checkpoints/ckpt-40 at step 40" in output
    moved = re.search(
        r"at step 40; input differs from the checkpoint's \(1 file\(s\) added "
        r"\(train-extra.tfrecord\); records (\d+) -> (\d+)\): its position "
        r"1280 belongs to another order, so the new order starts at its "
        r"epoch (\d+), global record (\d+)", output)
    assert moved, output[-5000:]
    old_n, new_n, epoch, start = map(int, moved.groups())
    assert new_n > old_n and epoch == -(-1280 // old_n)
    assert start == -(-epoch * new_n // 32) * 32
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(out / "checkpoints" / "ckpt-50"))
    assert reader.get_tensor(
        "input_position/.ATTRIBUTES/VARIABLE_VALUE") == start + 10 * 32
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["steps"] == 50
    assert len(resumed["intervals"]) == 2  # steps 45 and 50 only
    # TensorBoard continues at the restored step (Keras would restart at 0).
    events = EventAccumulator(str(out / "tensorboard" / "train"))
    events.Reload()
    steps = [e.step for e in events.Tensors("batch_loss")]
    assert steps == list(range(5, 55, 5)), steps
    # The chief exported the trained model for fine-tuning.
    assert sorted(os.listdir(out / "export")) == [
        "bert_config.json", "bert_pretrainer.weights.h5", "encoder.weights.h5"]


def test_single_worker_with_eval_accumulation_and_profile(corpus, tmp_path):
    out = tmp_path / "single"
    code, output = run_command(
        [sys.executable, "run_pretraining.py",
         *pretrain_args(corpus, out, 10, "--num_accumulation_steps=2",
                        f"--eval_input_file={corpus}/records/train-00000-*",
                        "--max_eval_steps=3", "--precision=mixed_bfloat16",
                        "--profile_steps=3,5")],
        timeout=300)
    assert code == 0, output[-5000:]
    traces = list((out / "tensorboard").rglob("*.xplane.pb"))
    assert len(traces) == 1  # the profiler trace of steps 3-5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10
    assert summary["eval"]["loss"] > 0 and 0 <= summary["eval"]["mlm_accuracy"] <= 1


def test_two_workers_float16_with_loss_scaling(corpus, tmp_path):
    # With the optimizer state sharded (tests/test_zero.py): the skip
    # decision from the shards' non-finite counts, summed.
    out = tmp_path / "fp16"
    run_pretraining(2, pretrain_args(corpus, out, 12, "--precision=mixed_float16",
                                     "--log_steps=6",
                                     "--shard_optimizer_state"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["shard_optimizer_state"]
    for row in summary["intervals"]:
        assert row["loss_scale"] >= 1 and 0 <= row["skipped_steps"] <= 6
        assert row["interval_loss"] == row["interval_loss"]  # not NaN


def last_line(output):
    return output.strip().splitlines()[-1]


@pytest.mark.parametrize("flag, expected", [
    ("--model=bert_huge", "--model"),
    ("--num_accumulation_steps=3",
     "run_pretraining: error: --train_batch_size: global batch size 32 is "
     "not divisible by replicas (1) x accumulation steps (3)"),
    ("--input_file=/nonexistent/*.tfrecord",
     "run_pretraining: error: --input_file: no files match input pattern"),
    ("--bert_config_file=/nonexistent.json", "--bert_config_file: cannot read"),
    # Config fields are reported under their flags' names.
    ("--num_warmup_steps=50",
     "run_pretraining: error: --num_warmup_steps (50) must be in "
     "[0, --num_train_steps (5)]"),
    ("--cycle_length=0",
     "run_pretraining: error: --cycle_length must be >= 1, got 0"),
])
def test_bad_flags_exit_naming_the_flag(corpus, tmp_path, flag, expected):
    args = pretrain_args(corpus, tmp_path / "bad", 5)
    code, output = run_command([sys.executable, "run_pretraining.py",
                                *args, flag], timeout=200)
    assert code != 0
    assert expected in output
    if "error:" in expected:
        assert last_line(output).startswith("run_pretraining: error:")


def test_corrupt_record_is_named(corpus, tmp_path):
    bad = tmp_path / "records"
    bad.mkdir()
    good = (corpus / "records" / "train-00000-of-00004.tfrecord").read_bytes()
    (bad / "train-00000.tfrecord").write_bytes(good)
    (bad / "train-00001.tfrecord").write_bytes(good[:len(good) // 2])
    args = pretrain_args(corpus, tmp_path / "out", 50)
    args[0] = f"--input_file={bad}/*.tfrecord"
    code, output = run_command([sys.executable, "run_pretraining.py", *args],
                               timeout=300)
    assert code != 0
    # (Found when the global order indexes the files, before the model.)
    assert last_line(output).startswith(
        f"run_pretraining: error: --input_file: bad input record: "
        f"{bad}/train-00001.tfrecord: record "), last_line(output)
    assert "truncated" in last_line(output)
