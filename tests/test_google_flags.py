"""Google's and NVIDIA's run_pretraining.py command lines carry over.

Google's README pretraining command (minus its TF1 `--init_checkpoint`) runs
unchanged and writes Google's `eval_results.txt`; an eval-only run from the
checkpoint (with NVIDIA's flag names) reproduces the same metrics; TPU flags
and TF1 checkpoints are one-line errors.
"""

import sys

import pytest

from tests.conftest import run_command
from tests.test_pretraining import corpus  # noqa: F401

pytestmark = pytest.mark.slow
GOOGLE_KEYS = ["global_step", "loss", "masked_lm_accuracy", "masked_lm_loss",
               "next_sentence_accuracy", "next_sentence_loss"]


def read_eval_results(path):
    lines = path.read_text().strip().splitlines()
    pairs = [line.split(" = ") for line in lines]
    return [k for k, _ in pairs], {k: float(v) for k, v in pairs}


def google_command(corpus, out, *extra):  # noqa: F811
    # Google's README command, with a tiny model and our small records.
    return [sys.executable, "run_pretraining.py",
            f"--input_file={corpus}/records/train-00000-of-00004.tfrecord",
            f"--output_dir={out}", "--do_train=True", "--do_eval=True",
            f"--bert_config_file={corpus}/bert_config.json",
            "--train_batch_size=32", "--max_seq_length=32",
            "--max_predictions_per_seq=5", "--num_train_steps=20",
            "--num_warmup_steps=10", "--learning_rate=2e-5", *extra]


def test_google_command_trains_evaluates_and_eval_only_reproduces(
        corpus, tmp_path):  # noqa: F811
    out = tmp_path / "google"
    code, output = run_command(google_command(corpus, out), timeout=300)
    assert code == 0, output[-5000:]
    keys, trained = read_eval_results(out / "eval_results.txt")
    assert keys == GOOGLE_KEYS
    assert trained["global_step"] == 20
    assert 0 <= trained["masked_lm_accuracy"] <= 1
    assert trained["loss"] > trained["masked_lm_loss"] > 0

    # Evaluate the checkpoint alone, spelled with NVIDIA's flag names.
    again = tmp_path / "eval_only"
    code, output = run_command(
        [sys.executable, "run_pretraining.py",
         f"--input_files={corpus}/records/train-00000-of-00004.tfrecord",
         f"--model_dir={again}", "--do_train=False", "--do_eval=True",
         f"--init_checkpoint={out}/checkpoints",
         f"--bert_config_file={corpus}/bert_config.json",
         "--max_seq_length=32", "--max_predictions_per_seq=5",
         "--optimizer_type=adam", "--steps_per_loop=5", "--warmup_steps=10",
         "--enable_xla=false"], timeout=300)
    assert code == 0, output[-5000:]
    assert "model weights from" in output
    keys, evaluated = read_eval_results(again / "eval_results.txt")
    assert keys == GOOGLE_KEYS
    for key in GOOGLE_KEYS:
        assert evaluated[key] == pytest.approx(trained[key], rel=1e-5), key


def test_use_tpu_is_a_one_line_error(corpus, tmp_path):  # noqa: F811
    code, output = run_command(
        google_command(corpus, tmp_path, "--use_tpu=True", "--tpu_name=x",
                       "--num_tpu_cores=8"), timeout=120)
    assert code != 0
    assert output.strip().splitlines()[-1].startswith(
        "run_pretraining: error: --use_tpu=True: TPUs are not supported")


def test_tf1_init_checkpoint_is_a_one_line_error(corpus, tmp_path):  # noqa: F811
    import tensorflow as tf
    prefix = str(tmp_path / "bert_model.ckpt")
    with tf.Graph().as_default():
        tf.compat.v1.get_variable("bert/embeddings/word_embeddings", [8, 4])
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            saver.save(session, prefix)
    code, output = run_command(
        google_command(corpus, tmp_path / "out", f"--init_checkpoint={prefix}"),
        timeout=200)
    assert code != 0
    last = output.strip().splitlines()[-1]
    assert last.startswith("run_pretraining: error: --init_checkpoint: ")
    assert "name-based (TF1) checkpoint" in last
