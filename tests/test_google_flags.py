"""Google's and NVIDIA's run_pretraining.py command lines carry over.

Google's README pretraining command runs unchanged (on 2 workers) and
writes Google's `eval_results.txt` once; an eval-only run from the
checkpoint (with NVIDIA's flag names) reproduces the same metrics; a TF1 checkpoint with Google's names
evaluates exactly as a NumPy implementation of Google's model on the same
records; `--use_tpu=True` and a checkpoint of another vocabulary are one-line
errors.
"""

import sys

import numpy as np
import pytest

from tests.conftest import run_command, run_workers

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


def test_google_command_on_two_workers_then_eval_only_reproduces(
        corpus, tmp_path):  # noqa: F811
    """Google's command on 2 workers (over every record file) trains,
    evaluates and writes eval_results.txt once; the checkpoint evaluated
    alone, in one process with NVIDIA's flag names, gives the same
    metrics."""
    out = tmp_path / "google"
    command = google_command(corpus, out)
    command[command.index(
        f"--input_file={corpus}/records/train-00000-of-00004.tfrecord")] = (
        f"--input_file={corpus}/records/train-*.tfrecord")
    _, output = run_workers(2, ["run_pretraining", *command[2:]], timeout=400)
    assert output.count("tfscale run_pretraining done") == 1  # chief only
    # Google's reading: --train_batch_size is the global batch.
    assert ("Google semantics: --train_batch_size 32 is the global batch; "
            "learning rate 2e-05") in output
    assert "global batch 32 = 16 per replica x 2 x 1 accumulation" in output
    keys, trained = read_eval_results(out / "eval_results.txt")
    assert keys == GOOGLE_KEYS
    assert trained["global_step"] == 20
    assert 0 <= trained["masked_lm_accuracy"] <= 1
    assert trained["loss"] > trained["masked_lm_loss"] > 0

    # Evaluate the checkpoint alone, spelled with NVIDIA's flag names.
    again = tmp_path / "eval_only"
    code, output = run_command(
        [sys.executable, "run_pretraining.py",
         f"--input_files={corpus}/records/train-*.tfrecord",
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


def eval_records(path, max_seq_length=32, max_predictions_per_seq=5):
    import tensorflow as tf
    from input_pipelines import bert_records
    spec = bert_records.BertRecordSpec(max_seq_length, max_predictions_per_seq)
    parse = bert_records.make_parse_fn(spec)
    batches = []
    for serialized in tf.data.TFRecordDataset(path).batch(32):
        inputs, labels = parse(serialized)
        batches.append({k: v.numpy() for k, v in {**inputs, **labels}.items()})
    return batches


def test_google_tf1_checkpoint_evaluates_as_the_numpy_reference(
        corpus, tmp_path):  # noqa: F811
    from models import bert_config
    from tests import google_bert_reference as reference
    config = bert_config.BertConfig.from_json_file(
        str(corpus / "bert_config.json"))
    values = reference.random_google_weights(config, seed=3)
    prefix = reference.write_tf1_checkpoint(values,
                                            str(tmp_path / "bert_model.ckpt"))
    records = corpus / "records" / "train-00000-of-00004.tfrecord"
    out = tmp_path / "eval"
    code, output = run_command(
        [sys.executable, "run_pretraining.py", f"--input_file={records}",
         f"--output_dir={out}", "--do_train=False", "--do_eval=True",
         f"--init_checkpoint={prefix}",
         f"--bert_config_file={corpus}/bert_config.json",
         "--max_seq_length=32", "--max_predictions_per_seq=5",
         "--max_eval_steps=100000"], timeout=300)
    assert code == 0, output[-5000:]
    _, ours = read_eval_results(out / "eval_results.txt")
    expected = reference.eval_metrics(values, config, eval_records(records))
    for key, value in expected.items():
        assert ours[key] == pytest.approx(value, rel=1e-4), key

    # Another vocabulary: one line naming the variable and both shapes.
    other = dict(values)
    other["bert/embeddings/word_embeddings"] = np.zeros(
        (config.vocab_size + 8, config.hidden_size), "float32")
    wrong = reference.write_tf1_checkpoint(other, str(tmp_path / "other.ckpt"))
    code, output = run_command(
        google_command(corpus, tmp_path / "bad", f"--init_checkpoint={wrong}"),
        timeout=200)
    assert code != 0
    last = output.strip().splitlines()[-1]
    assert last.startswith("run_pretraining: error: --init_checkpoint: ")
    assert (f"bert/embeddings/word_embeddings has shape "
            f"[{config.vocab_size + 8}, {config.hidden_size}] in the checkpoint "
            f"but [{config.vocab_size}, {config.hidden_size}]") in last


def test_nvidia_tf1_command_line_runs(corpus, tmp_path):  # noqa: F811
    """NVIDIA DeepLearningExamples' TF1 run_pretraining.py flags (directory
    inputs, --amp, --use_xla, --horovod, accumulation, LAMB); epochs x steps
    per epoch from its TF2 script."""
    out = tmp_path / "nvidia"
    # --horovod: started as MPI ranks, as NVIDIA's scripts start it (mpirun).
    code, output = run_command(
        [sys.executable, "-m", "launch.local", "--backend", "mpi",
         "--num_workers", "2", "--threads_per_worker", "1", "--",
         sys.executable, "run_pretraining.py",
         f"--input_files_dir={corpus}/records",
         f"--eval_files_dir={corpus}/records", f"--output_dir={out}",
         f"--bert_config_file={corpus}/bert_config.json", "--do_train=True",
         "--do_eval=True", "--train_batch_size=8", "--eval_batch_size=32",
         "--max_seq_length=32", "--max_predictions_per_seq=5",
         "--num_train_epochs=2", "--num_steps_per_epoch=3",
         "--num_warmup_steps=2", "--num_accumulation_steps=2",
         "--save_checkpoints_steps=3", "--learning_rate=1e-3",
         "--optimizer_type=lamb", "--horovod", "--amp", "--use_xla",
         "--allreduce_post_accumulation=True", "--max_eval_steps=2",
         f"--dllog_path={tmp_path}/bert_dllog.json"],
        timeout=300)
    assert code == 0, output[-5000:]
    assert ("precision mixed_float16, XLA on (as asked), all-reduce "
            "MPI.Allreduce") in output
    assert "workers 2 (mpi)" in output
    # NVIDIA's reading: 8 per rank x 2 ranks x 2 micro-steps, rate x 2.
    assert ("NVIDIA semantics: --train_batch_size 8 per rank x 2 ranks x 2 "
            "accumulation = global batch 32; learning rate 0.001 x 2 ranks "
            "= 0.002") in output
    assert "global batch 32 = 8 per replica x 2 x 2 accumulation" in output
    keys, results = read_eval_results(out / "eval_results.txt")
    assert keys == GOOGLE_KEYS and results["global_step"] == 6
    assert (tmp_path / "bert_dllog.json").exists()  # TF1's --dllog_path
