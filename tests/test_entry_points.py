"""Every entry point answers a missing flag in one line before TensorFlow
loads: run with a `tensorflow` that refuses to import, each still names
the flag it needs (and a run that gives them would reach the refusal)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, corpus  # noqa: F401  (a fixture)

# (module, its flags, the line it answers)
MISSING = [
    ("models.tasks.run_pretraining", [],
     "run_pretraining: error: --input_file or --input_files_dir is required"),
    ("models.tasks.run_pretraining", ["--input_files_dir=/data"],
     "run_pretraining: error: --output_dir is required"),
    ("models.tasks.train_image_classifier", ["--output_dir=/tmp/x"],
     "train_image_classifier: error: --train_files or --nodo_train is "
     "required"),
    ("models.tasks.train_image_classifier", ["--nodo_train"],
     "train_image_classifier: error: --output_dir is required"),
    ("models.tasks.export_bert", ["--checkpoint=c"],
     "export_bert: error: --bert_config_file is required"),
    ("input_pipelines.create_pretraining_data", ["--input_file=a"],
     "create_pretraining_data: error: --output_file is required"),
    ("input_pipelines.build_image_records", [],
     "build_image_records: error: --image_dir is required"),
]


@pytest.fixture(scope="module")
def no_tensorflow(tmp_path_factory):
    """A PYTHONPATH whose `tensorflow` refuses to import."""
    root = tmp_path_factory.mktemp("no_tf")
    (root / "tensorflow").mkdir()
    (root / "tensorflow" / "__init__.py").write_text(
        "raise ImportError('TensorFlow was imported')\n")
    return str(root)


def run(module, args, no_tensorflow):
    return subprocess.run(
        [sys.executable, "-c", f"from {module} import run; run()", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": f"{no_tensorflow}:{REPO}", "PATH": "/usr/bin"})


@pytest.mark.parametrize("module,args,line", MISSING,
                         ids=[f"{m.split('.')[-1]}-{len(a)}"
                              for m, a, _ in MISSING])
def test_a_missing_flag_is_one_line_before_tensorflow(module, args, line,
                                                      no_tensorflow):
    done = run(module, args, no_tensorflow)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [line], done.stderr


def test_the_refusing_tensorflow_is_reached_once_the_flags_are_given(
        no_tensorflow, tmp_path):
    done = run("models.tasks.run_pretraining",
               [f"--input_file={tmp_path}/x", f"--output_dir={tmp_path}"],
               no_tensorflow)
    assert "TensorFlow was imported" in done.stderr, done.stderr


EXTRAS_MODULES = ("tqdm", "distributed", "dask", "tensorflow_datasets",
                  "tensorflow_text", "matplotlib", "mpi4py", "tf_keras")


@pytest.mark.slow
def test_the_core_install_runs_the_job(corpus, tmp_path):  # noqa: F811
    """The job and the Trainer on the core dependencies alone: with every
    extra's module refusing to import, run_pretraining trains, saves and
    writes its summary. With `--timed_steps_per_log=0` no step runs part by
    part, and the log lines name no split."""
    from tests.test_pretraining import pretrain_args
    refuse = tmp_path / "refuse"
    for name in EXTRAS_MODULES:
        (refuse / name).mkdir(parents=True)
        (refuse / name / "__init__.py").write_text(
            f"raise ImportError('{name} is an extra')\n")
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "run_pretraining",
         *pretrain_args(corpus, out, 6, "--log_steps=3",
                        "--timed_steps_per_log=0")],
        cwd=REPO, capture_output=True,
        text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": f"{refuse}:{REPO}"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6
    # What tfscale-plan needs to say a CPU run is not a GPU's.
    assert summary["device"]["kind"] == "cpu"
    assert summary["gradient_tensors"] > 10
    assert [row["timed_steps"] for row in summary["intervals"]] == [0, 0]
    lines = [line for line in done.stderr.splitlines() if "examples/s" in line]
    assert len(lines) == 2 and not any("timed steps" in l for l in lines)


def refusing_extras(root):
    """A folder whose modules stand in for every extra's, each refusing to
    import (a core install)."""
    for name in EXTRAS_MODULES:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(
            f"raise ImportError('{name} is an extra')\n")
    return root


HELP = ["models.tasks.run_pretraining", "models.tasks.train_image_classifier",
        "models.tasks.export_bert", "input_pipelines.create_pretraining_data",
        "input_pipelines.build_image_records", "input_pipelines.index_records"]


@pytest.mark.parametrize("module", HELP)
def test_help_works_on_the_core_install(module, tmp_path):
    # The writers' --help printed a 27-line chained traceback ending in
    # [prepare]: tqdm was imported when the module loaded.
    refuse = refusing_extras(tmp_path / "refuse")
    done = subprocess.run(
        [sys.executable, "-c", f"from {module} import run; run()", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": f"{refuse}:{REPO}"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "flags:" in done.stdout


def test_a_missing_extra_is_one_line_naming_it(corpus, tmp_path):  # noqa: F811
    """A writer run and `tfscale-plan --plot` on the core install: one line
    naming the extra and the pip command, no traceback, exit 2."""
    refuse = refusing_extras(tmp_path / "refuse")
    env = {**os.environ, "PYTHONPATH": f"{refuse}:{REPO}"}
    runs = {
        "prepare": [sys.executable, "-m",
                    "input_pipelines.create_pretraining_data",
                    f"--input_file={corpus}/corpus.txt",
                    f"--vocab_file={corpus}/vocab.txt",
                    f"--output_file={tmp_path}/out/train.tfrecord",
                    "--max_seq_length=32", "--max_predictions_per_seq=5"],
        "plot": [sys.executable, "-m", "planning.cli", "--parameters",
                 "110e6", "--micro_batch", "32", "--micro_ms", "100",
                 "--gpus", "8,16", "--plot", str(tmp_path / "p.png")],
    }
    for extra, command in runs.items():
        done = subprocess.run(command, cwd=REPO, capture_output=True,
                              text=True, timeout=180, env=env)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (extra, done.stderr[-3000:])
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert f"tfscale's [{extra}] extra: pip install \".[{extra}]\"" in \
            lines[-1], (extra, lines[-3:])
        assert done.stdout.strip() == "", done.stdout  # no table first


def test_the_demo_corpus_without_the_text_extra_is_one_line(tmp_path):
    """`python -m input_pipelines.make_demo_corpus` where tensorflow-text
    is missing (its `[text]` extra not installed): one line naming the
    extra, exit 2, no traceback."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "tensorflow_text.py").write_text(
        "raise ImportError(\"No module named 'tensorflow_text'\")\n")
    done = subprocess.run(
        [sys.executable, "-m", "input_pipelines.make_demo_corpus",
         f"--output_dir={tmp_path / 'corpus'}"], cwd=REPO,
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=f"{hidden}:{REPO}",
                 TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "make_demo_corpus: error: tensorflow_text.tools.wordpiece_vocab."
        "bert_vocab_from_dataset is not installed; it comes with tfscale's "
        "[text] extra: pip install \".[text]\" in the checkout")
