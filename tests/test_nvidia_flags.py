"""NVIDIA's BERT command lines mean what they mean there.

The reading rule (models/tasks/nvidia_flags.py) on parsed flags: which
dialect a command line is, the global batch and rate each reads, the
mixed-dialect error, every NVIDIA spelling. Then NVIDIA's TF2 phase-1 and
phase-2 commands, verbatim with small numbers, under `mpiexec -np 2`: the
global batch and scaled rate in the banner and summary.json, the
checkpoint cadence, the DLLogger file, and phase 2 starting from phase 1's
`pretrained/bert_model.ckpt-1`.
"""

import json
import os
import re
import shutil
import sys

import pytest
from absl import flags

from models.tasks import nvidia_flags
from tests.conftest import REPO, run_command
from models.tasks import dllogger


def parse(*argv):
    """A FlagValues with NVIDIA's flags and the Google/tfscale ones the
    rule reads, parsed from `argv`."""
    values = flags.FlagValues()
    for name in ("input_file", "output_dir"):
        flags.DEFINE_string(name, None, "", flag_values=values)
    for name, default in (("iterations_per_loop", 100),
                          ("save_checkpoints_steps", 1000),
                          ("num_warmup_steps", 100),
                          ("num_train_steps", 1000),
                          ("reference_batch_size", 0),
                          ("num_tpu_cores", 8)):
        flags.DEFINE_integer(name, default, "", flag_values=values)
    flags.DEFINE_bool("xla", False, "", flag_values=values)
    flags.DEFINE_bool("use_tpu", False, "", flag_values=values)
    for name in ("tpu_name", "tpu_zone", "gcp_project", "master"):
        flags.DEFINE_string(name, None, "", flag_values=values)
    flags.DEFINE_string("optimizer", "lamb", "", flag_values=values)
    flags.DEFINE_string("precision", "float32", "", flag_values=values)
    flags.DEFINE_string("lr_scaling", "none", "", flag_values=values)
    nvidia_flags.define_nvidia_flags(flags, flag_values=values)
    values(["prog", *argv])
    return values


def reading(values, batch=60, accumulation=128, rate=7.5e-4, ranks=8):
    horovod = values.horovod or values.use_horovod
    return nvidia_flags.batch_and_rate(
        nvidia_flags.dialect_of(values), batch, accumulation, rate, horovod,
        ranks)


def test_nvidia_recipe_reads_per_rank_batch_and_scaled_rate():
    """NVIDIA's phase-1 recipe on 8 ranks: 60 x 8 x 128 = 61,440 at
    7.5e-4 x 8."""
    values = parse("--input_files=x", "--model_dir=y", "--use_horovod",
                   "--optimizer_type=LAMB", "--save_checkpoint_steps=100")
    result = reading(values)
    assert result.dialect == "nvidia"
    assert result.global_batch_size == 61440
    assert result.learning_rate == pytest.approx(6e-3)
    assert result.line == (
        "NVIDIA semantics: --train_batch_size 60 per rank x 8 ranks x 128 "
        "accumulation = global batch 61,440; learning rate 0.00075 x 8 "
        "ranks = 0.006")


def test_nvidia_without_horovod_is_one_process_batch_times_accumulation():
    values = parse("--input_files_dir=x", "--output_dir=y", "--amp")
    result = reading(values, ranks=8)  # ranks count only with Horovod
    assert (result.global_batch_size, result.learning_rate) == (7680, 7.5e-4)
    assert "no --use_horovod" in result.line


def test_google_command_keeps_the_global_batch():
    values = parse("--input_file=x", "--output_dir=y",
                   "--save_checkpoints_steps=5", "--iterations_per_loop=5")
    result = reading(values)
    assert result.dialect == "google"
    assert (result.global_batch_size, result.learning_rate) == (60, 7.5e-4)
    assert result.line.startswith("Google semantics: --train_batch_size 60 "
                                  "is the global batch")


def test_an_alias_counts_as_nvidia_its_original_as_google():
    """absl counts --input_files (an alias) as --input_file too: the rule
    tells them apart."""
    assert nvidia_flags.named(parse("--input_files=x"),
                              ["input_file", "input_files"]) == (
        "input_files",)
    assert nvidia_flags.named(parse("--input_file=x"),
                              ["input_file", "input_files"]) == (
        "input_file",)


def test_mixed_dialects_where_they_disagree_name_both_flags():
    values = parse("--input_file=x", "--use_horovod")
    with pytest.raises(nvidia_flags.DialectError) as error:
        nvidia_flags.check_mixed(values, "nvidia", reading(values), 60,
                                 7.5e-4)
    message = str(error.value)
    assert message.startswith("--input_file (Google's")
    assert "--use_horovod (NVIDIA's" in message
    assert "--dialect=google or --dialect=nvidia" in message
    # Said explicitly, or where both readings agree: no error.
    explicit = parse("--input_file=x", "--use_horovod", "--dialect=nvidia")
    nvidia_flags.check_mixed(explicit, "nvidia", reading(explicit), 60,
                             7.5e-4)
    agree = parse("--input_file=x", "--steps_per_loop=5")
    nvidia_flags.check_mixed(agree, "nvidia",
                             reading(agree, accumulation=1), 60, 7.5e-4)


@pytest.mark.parametrize("given,expected", [
    ("LAMB", "lamb"), ("lamb", "lamb"), ("ADAM", "adamw"), ("Adam", "adamw")])
def test_optimizer_type_in_any_case(given, expected):
    values = parse(f"--optimizer_type={given}")
    assert nvidia_flags.optimizer_name(values, "lamb") == expected


def test_nvidia_spellings_of_precision_steps_and_loss_scale():
    assert nvidia_flags.precision_name(parse("--use_fp16"),
                                       "float32") == "mixed_float16"
    assert nvidia_flags.precision_name(parse("--manual_fp16"),
                                       "float32") == "mixed_float16"
    assert nvidia_flags.precision_name(parse("--dtype=bf16"),
                                       "float32") == "mixed_bfloat16"
    with pytest.raises(nvidia_flags.DialectError, match="--amp and "
                       "--dtype=fp32 disagree"):
        nvidia_flags.precision_name(parse("--amp", "--dtype=fp32"),
                                    "float32")
    # NVIDIA TF2's defaults for the one not given: 3 epochs, 1000 steps.
    assert nvidia_flags.train_steps(parse("--num_steps_per_epoch=7"),
                                    1000) == 21
    assert nvidia_flags.train_steps(parse("--num_train_epochs=2"),
                                    1000) == 2000
    assert nvidia_flags.loss_scale(parse("--loss_scale=128")) == (128.0,
                                                                   False)
    assert nvidia_flags.loss_scale(parse("--init_loss_scale=4294967296")) == (
        2.0**32, True)
    assert nvidia_flags.directory_globs("a, b") == "a/*,b/*"


@pytest.mark.parametrize("argv,named", [
    (["--num_gpus=2"], "--num_gpus=2"),
    (["--distribution_strategy=tpu"], "--distribution_strategy=tpu"),
    (["--distribution_strategy=mirrored", "--use_horovod"],
     "--distribution_strategy=mirrored and --use_horovod"),
    (["--run_eagerly"], "--run_eagerly=True"),
    (["--use_keras_compile_fit"], "--use_keras_compile_fit=True"),
    (["--hub_module_url=x"], "--hub_module_url"),
    (["--model_type=albert"], "--model_type=albert"),
    (["--tpu=grpc://x"], "--tpu"),
    (["--fp16_implementation=graph_rewrite"],
     "--fp16_implementation=graph_rewrite")])
def test_values_tfscale_cannot_honour_are_refused_naming_the_flag(argv,
                                                                  named):
    assert nvidia_flags.refused(parse(*argv)).startswith(named)
    assert nvidia_flags.refused(parse()) is None


def test_every_nvidia_flag_is_defined():
    """Every flag NVIDIA's TF1 and TF2 pretraining scripts (and the Model
    Garden flags its TF2 script defines) parse."""
    values = parse()
    nvidia = [  # TF2 run_pretraining.py + common_flags.py + flags core
        "input_files", "max_seq_length", "max_predictions_per_seq",
        "train_batch_size", "num_steps_per_epoch", "warmup_steps",
        "model_dir", "num_gpus", "distribution_strategy", "run_eagerly",
        "bert_config_file", "model_export_path", "tpu", "init_checkpoint",
        "use_horovod", "num_accumulation_steps", "num_train_epochs",
        "steps_per_loop", "learning_rate", "scale_loss",
        "use_keras_compile_fit", "hub_module_url", "model_type", "use_fp16",
        "optimizer_type", "save_checkpoint_steps", "dllog_path",
        "benchmark", "dtype", "loss_scale", "enable_xla",
        "fp16_implementation",
        # TF1 run_pretraining.py
        "input_files_dir", "eval_files_dir", "output_dir", "do_train",
        "do_eval", "eval_batch_size", "num_train_steps", "num_warmup_steps",
        "save_checkpoints_steps", "display_loss_steps",
        "iterations_per_loop", "max_eval_steps",
        "allreduce_post_accumulation", "verbose_logging", "horovod",
        "report_loss", "manual_fp16", "use_xla", "amp", "init_loss_scale"]
    code, output = run_command(
        [sys.executable, "-c", "import json; from absl import flags; "
         "from models.tasks import run_pretraining; "
         "print(json.dumps(sorted(flags.FLAGS)))"], timeout=120)
    assert code == 0, output
    defined = json.loads(output.strip().splitlines()[-1])
    assert [n for n in nvidia if n not in defined] == []
    assert "dt" in values and "ls" in values  # Model Garden's short names


def nvidia_phase1(corpus, results, *extra):  # noqa: F811
    """NVIDIA's TF2 scripts/run_pretraining_lamb_phase1.sh command, small
    numbers: 4 per rank x 2 ranks x 2 accumulation."""
    return ["mpiexec", "--allow-run-as-root", "-np", "2", sys.executable,
            os.path.join(REPO, "run_pretraining.py"),
            f"--input_files={corpus}/records/*",
            f"--model_dir={results}/phase_1",
            f"--bert_config_file={corpus}/bert_config.json",
            "--train_batch_size=4", "--max_seq_length=32",
            "--max_predictions_per_seq=5",
            "--num_steps_per_epoch=6", "--num_train_epochs=1",
            "--steps_per_loop=3", "--save_checkpoint_steps=3",
            "--warmup_steps=2", "--num_accumulation_steps=2",
            "--learning_rate=7.5e-4", "--optimizer_type=LAMB",
            "--use_horovod", *extra]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "mpiexec")),
    reason="Open MPI's mpiexec is not installed (pip install '.[mpi]' in "
           "tfscale's checkout)")
def test_nvidia_phase1_then_phase2_on_two_mpi_ranks(corpus, tmp_path):  # noqa: F811
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ["PATH"], "TF_CPP_MIN_LOG_LEVEL": "1"}
    results = tmp_path / "results"
    code, output = run_command(nvidia_phase1(corpus, results), env=env,
                               cwd=str(tmp_path), timeout=300)
    assert code == 0, output[-5000:]
    assert ("NVIDIA semantics: --train_batch_size 4 per rank x 2 ranks x 2 "
            "accumulation = global batch 16; learning rate 0.00075 x 2 "
            "ranks = 0.0015") in output
    assert "optimizer lamb, lr 0.0015 (polynomial, warmup 2" in output
    phase1 = results / "phase_1"
    summary = json.loads((phase1 / "summary.json").read_text())
    assert (summary["steps"], summary["global_batch_size"],
            summary["num_workers"]) == (6, 16, 2)
    # --save_checkpoint_steps=3: a checkpoint at steps 3 and 6.
    assert sorted(f for f in os.listdir(phase1 / "checkpoints")
                  if f.endswith(".index")) == ["ckpt-3.index", "ckpt-6.index"]
    # DLLogger in the run's folder (NVIDIA's default name), chief only.
    assert f"DLLogger's log: {phase1}/bert_dllogger.json" in output
    assert not (tmp_path / "bert_dllogger.json").exists()
    records = dllogger.read(str(phase1 / "bert_dllogger.json"))
    kinds = [r["type"] for r in records]
    assert kinds == ["METADATA"] * 5 + ["LOG"] * 3
    logs = [r for r in records if r["type"] == "LOG"]
    assert [r["step"] for r in logs] == [3, 6, []]
    for record in logs[:2]:
        assert record["data"]["throughput_train"] > 0
        assert record["data"]["avg_loss_step"] > 0
        assert "mlm_loss" in record["data"] and "nsp_loss" in record["data"]
    assert logs[2]["data"]["total_loss"] == logs[1]["data"]["avg_loss_step"]
    assert logs[2]["data"]["throughput_train"] > 0
    assert (phase1 / "pretrained" / "bert_model.ckpt-1.index").exists()

    # NVIDIA's phase-2 command: from phase 1's sub-model export.
    phase2 = nvidia_phase1(corpus, results, "--dllog_path=phase2.json",
                           "--verbose_logging")
    phase2[phase2.index(f"--model_dir={results}/phase_1")] = (
        f"--model_dir={results}/phase_2")
    phase2[phase2.index("--train_batch_size=4")] = "--train_batch_size=2"
    phase2[phase2.index("--num_accumulation_steps=2")] = (
        "--num_accumulation_steps=3")
    phase2.insert(6, f"--init_checkpoint={phase1}/pretrained/"
                     "bert_model.ckpt-1")
    code, output = run_command(phase2, env=env, cwd=str(tmp_path),
                               timeout=300)
    assert code == 0, output[-5000:]
    assert (f"model weights from {phase1}/pretrained/bert_model.ckpt-1"
            in output)
    # --verbose_logging: every trainable variable, with its shape.
    listed = re.findall(r"^    (\S+) \[\d+(?:, \d+)*\]$", output, re.M)
    assert len(listed) > 20 and len(set(listed)) == len(listed), listed
    assert "= global batch 12; learning rate 0.00075 x 2 ranks" in output
    assert json.loads((results / "phase_2" / "summary.json").read_text())[
        "global_batch_size"] == 12
    assert [r["step"] for r in dllogger.read(str(tmp_path / "phase2.json"))
            if r["type"] == "LOG"] == [3, 6, []]


def test_a_resumed_dllogger_file_holds_each_step_once(tmp_path):
    """A run logs steps 3, 6, 9 and is killed after its checkpoint at 6;
    the resumed run starts at 6. The file keeps the METADATA once and steps
    3 and 6, then the resumed run's 9 and 12 and one summary line, with
    elapsedtime going on (a resume appended [3, 6, 9, 9, 12] with the
    METADATA again and elapsedtime from 0)."""
    path = str(tmp_path / "bert_dllogger.json")
    numbers = {"examples_per_second": 100.0, "interval_loss": 2.0,
               "learning_rate": 1e-3}
    step = [0]
    first = dllogger.DLLogger(path, lambda: step[0])
    first.on_train_begin()
    for at in (3, 6, 9):
        first.on_interval_end(at, numbers)
    first._file.close()  # killed: no summary line
    step[0] = 6
    resumed = dllogger.DLLogger(path, lambda: step[0])
    resumed.on_train_begin()
    for at in (9, 12):
        resumed.on_interval_end(at, numbers)
    resumed.on_train_end()
    records = dllogger.read(path)
    assert [r["type"] for r in records] == ["METADATA"] * 5 + ["LOG"] * 5
    assert [r["step"] for r in records if r["type"] == "LOG"] == [
        3, 6, 9, 12, []]
    elapsed = [float(r["elapsedtime"]) for r in records]
    assert elapsed == sorted(elapsed)


def test_loss_scale_settings_reach_the_trainers_scale():
    """--init_loss_scale: dynamic from that scale; --loss_scale=N: fixed
    (neither grows nor falls)."""
    from tfscale import precision
    from tfscale.train_config import TrainConfig

    def scale_of(config):
        return precision.loss_scale(config.initial_loss_scale,
                                    config.dynamic_loss_scale)
    first = scale_of(TrainConfig(global_batch_size=8,
                                 initial_loss_scale=2.0**32))
    assert float(first.scale.numpy()) == 2.0**32
    first.update(False)
    assert float(first.scale.numpy()) == 2.0**31
    fixed = scale_of(TrainConfig(global_batch_size=8, initial_loss_scale=128.0,
                                 dynamic_loss_scale=False))
    for finite in (False, True, True):
        fixed.update(finite)
        assert float(fixed.scale.numpy()) == 128.0


def test_mixed_command_line_is_one_error_line_from_the_entry_point(tmp_path):
    """The real entry point: Google's --input_file beside NVIDIA's
    --use_horovod with accumulation stops before training, naming both."""
    code, output = run_command(
        [sys.executable, "run_pretraining.py", f"--input_file={tmp_path}/x",
         f"--output_dir={tmp_path}/out", "--use_horovod",
         "--num_accumulation_steps=2", "--train_batch_size=32"], timeout=120)
    assert code == 2, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("run_pretraining: error: --input_file (Google's"), last
    assert "--use_horovod (NVIDIA's" in last and "32 as 32 or 64" in last
    assert not (tmp_path / "out").exists()


def test_errors_name_the_flags_the_command_line_used(corpus, tmp_path):  # noqa: F811
    """An error found while the job runs (an input position that does not
    fit, a checkpoint) is raised for the setting `input_file`; on NVIDIA's
    command line it is named as typed, `--input_files` (it named
    `--input_file`, which that command line did not use)."""
    from tfscale.jobs import JobError
    error = JobError("input_file", "input position 12 is not a multiple")
    assert error.line() == "--input_file: input position 12 is not a multiple"
    code = ("import sys\n"
            "from absl import flags\n"
            "from models.tasks import run_pretraining\n"
            "flags.FLAGS(sys.argv)\n"
            "print(sorted(run_pretraining.config_from_flags()"
            ".flag_names.items()))\n")
    status, output = run_command(
        [sys.executable, "-c", code, f"--input_files={corpus}/records/*",
         f"--model_dir={tmp_path}/out",
         f"--bert_config_file={corpus}/bert_config.json",
         "--train_batch_size=4", "--max_seq_length=32",
         "--max_predictions_per_seq=5", "--steps_per_loop=3"], timeout=120)
    assert status == 0, output[-3000:]
    names = dict(eval(output.strip().splitlines()[-1]))
    assert names == {"input_file": "input_files", "output_dir": "model_dir",
                     "iterations_per_loop": "steps_per_loop"}
    assert error.line(names) == ("--input_files: input position 12 is not "
                                 "a multiple")
