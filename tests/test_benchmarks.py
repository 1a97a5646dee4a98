"""Every benchmark still runs: each script answers `--help` (its module and
its flags load), and every name it imports, at its top or inside a
function, still exists where it imports it from. (A package move once left
four benchmarks importing a name that was gone, with no test failing.)"""

import ast
import importlib
import importlib.util
import pathlib
import re
import runpy
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (REPO / "benchmarks").rglob("*.py")
                 if p.name not in ("__init__.py", "__main__.py"))
# The concerns benchmarks/ is split by: no study sits at its top.
PACKAGES = ("gpu", "pipelines", "scaling", "preemption", "planning",
            "time_to_accuracy", "overhead")


def module_of(path: pathlib.Path) -> str:
    """benchmarks/gpu/check.py -> benchmarks.gpu.check"""
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def imports(path: pathlib.Path):
    """(line, module, name or None) of every import in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.level == 0:
            for alias in node.names:
                yield node.lineno, node.module, alias.name


def project_import(module: str) -> bool:
    return module.split(".")[0] in ("tfscale", "models", "input_pipelines",
                                    "launch", "planning", "benchmarks",
                                    "tests")


def defined_names(module: str) -> set:
    """The names a module's source defines at its top level."""
    import ast
    source = importlib.util.find_spec(module).origin
    names = set()
    for node in ast.parse(open(source).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("path", SCRIPTS, ids=module_of)
def test_every_name_a_benchmark_imports_exists(path):
    from absl import flags
    missing = []
    for line, module, name in imports(path):
        if not project_import(module):
            continue
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{path.name}:{line}: {module}: {e}")
            continue
        except flags.DuplicateFlagError:
            # Two entry points' flags in one process (each runs in its
            # own): the module is there; its names read from its source.
            if name is not None and name not in defined_names(module):
                missing.append(f"{path.name}:{line}: {module} has no {name}")
            continue
        if name is not None and not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{path.name}:{line}: {module} has no {name}")
            except flags.DuplicateFlagError:
                pass  # the submodule is there (its flags, as above)
    assert missing == []


@pytest.mark.parametrize("path", [p for p in SCRIPTS
                                  if "__main__" in p.read_text()],
                         ids=module_of)
def test_every_benchmark_answers_help(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(module_of(path), run_name="__main__")
    assert done.value.code in (0, None)
    text = capsys.readouterr().out
    assert "usage:" in text
    assert undescribed(text) == []


def undescribed(help_text: str) -> list:
    """The options argparse's `--help` lists with no words after them
    (absl's flags always have theirs)."""
    lines = help_text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        if not re.match(r"^  -", line) or re.match(r"^  -h, --help", line):
            continue
        said = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        following = lines[i + 1] if i + 1 < len(lines) else ""
        # (Options sit 2 spaces in; a description wrapped below, deeper.)
        continued = re.match(r"^\s{6,}\S", following)
        if len(said) < 2 and not continued:
            bare.append(said[0])
    return bare


@pytest.mark.parametrize("module", ["launch.local", "launch.horovodrun",
                                    "launch.gpu_check", "planning"])
def test_every_command_line_tool_describes_every_flag(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"],
                          capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert undescribed(done.stdout) == []


def test_the_help_check_finds_a_flag_with_no_words():
    import argparse
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--records")
    parser.add_argument("--steps", type=int, help="steps to run")
    parser.add_argument("--a_very_long_flag_name_indeed", help="wrapped")
    assert undescribed(parser.format_help()) == ["--records RECORDS"]


def test_the_check_finds_a_name_that_is_gone(tmp_path):
    stale = tmp_path / "stale.py"
    stale.write_text("def f():\n    from tfscale.step.train_step import "
                     "unreduced\n")
    found = [(m, n) for _, m, n in imports(stale)]
    assert found == [("tfscale.step.train_step", "unreduced")]
    module = importlib.import_module("tfscale.step.train_step")
    assert not hasattr(module, "unreduced")


@pytest.mark.parametrize("path", sorted((REPO / "benchmarks").rglob("*.sh")),
                         ids=module_of)
def test_every_shell_benchmark_answers_help(path, tmp_path):
    done = subprocess.run(["bash", str(path), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "bash benchmarks/gpu/bert.sh" in done.stdout
    assert list(tmp_path.iterdir()) == []  # it ran nothing


@pytest.mark.parametrize("package", PACKAGES + ("",))
def test_each_benchmark_package_says_what_it_holds(package):
    """benchmarks/ is split by concern: its top holds the harness (and
    one moved script's redirect) only, and each package's docstring names
    every file it holds."""
    folder = REPO / "benchmarks" / package
    doc = (folder / "__init__.py").read_text()
    held = {p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
            if p.name not in ("__init__.py", "__main__.py", "__pycache__")}
    if not package:
        held -= {"README.md", "history.md", "results/", "gpu_bert.sh"}
        assert {p for p in held if p.endswith(".py")} == {"harness.py"}
    assert held and not {h for h in held if f"`{h}`" not in doc}, held


@pytest.mark.parametrize("old,new", [("gpu_check", "gpu.check"),
                                     ("watch_cost", "overhead.watch_cost")])
def test_an_old_flat_name_still_runs_and_names_the_new_one(old, new):
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{old}",
                           "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
    assert (f"benchmarks.{old} is now benchmarks.{new}; the old name goes "
            "in the next release") in done.stderr
    import benchmarks
    assert benchmarks.MOVED == dict(
        line.split() for line in MOVED_NAMES.strip().splitlines())


# The flat names of release 2026-12 (old name, new module).
MOVED_NAMES = """
gpu_check gpu.check
gpu_levers gpu.levers
lever_worker gpu.lever_worker
model_step gpu.model_step
step_calls gpu.step_calls
step_graph gpu.step_graph
step_kernels gpu.step_kernels
head_transpose gpu.head_transpose
xplane_top gpu.xplane_top
input_pipeline pipelines.input_pipeline
image_pipeline pipelines.image_pipeline
record_reader pipelines.record_reader
data_service_trainer pipelines.data_service_trainer
data_service pipelines.data_service
iterator_deletion_worker pipelines.iterator_deletion_worker
iterator_deletion pipelines.iterator_deletion
writer_memory pipelines.writer_memory
writers pipelines.writers
scaling_worker scaling.worker
allreduce_worker scaling.allreduce_worker
allreduce scaling.allreduce
horovod_synthetic scaling.horovod_synthetic
hvd_agreement scaling.hvd_agreement
memory scaling.memory
exit_time preemption.exit_time
resume_cost preemption.resume_cost
plan_check planning.plan_check
mlperf_rows planning.mlperf_rows
study_behaviour time_to_accuracy.behaviour
trainer_overhead overhead.trainer
fit_comparison overhead.fit_comparison
fit_worker overhead.fit_worker
watch_cost overhead.watch_cost
noise_scale_overhead overhead.noise_scale
"""


@pytest.mark.parametrize("parallel", [1, 3, 4, 7, 9])
def test_the_lever_runs_are_each_timed_once(parallel):
    """Every (model, lever) in exactly one wave, none larger than
    `parallel` but BERT-large's pair: a run twice would leave its gate
    open for the second, timed while the others compile."""
    from benchmarks.gpu import levers as gpu_levers
    waves = gpu_levers.run_waves(parallel)
    runs = [run for wave in waves for run in wave]
    expected = ([("base", lever) for lever in gpu_levers.LEVERS]
                + [("large", "default"), ("large", "all")])
    assert sorted(runs) == sorted(expected)
    assert all(len(wave) <= max(parallel, 2) for wave in waves)


def test_the_harness_writes_tables_and_names_a_failed_command(capsys):
    from benchmarks import harness
    table = harness.Table(["model", "steps/s", "note"], align="lrl")
    table.row("mlp", "41.2", "warm")
    assert capsys.readouterr().out.splitlines() == [
        "| model | steps/s | note |", "|---|---:|---|",
        "| mlp | 41.2 | warm |"]
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        table.row("mlp", "1")
    assert harness.table(["a", "b"], [[1, 2]]) == (
        "| a | b |\n|---|---:|\n| 1 | 2 |")
    assert harness.on_workers(2, ["prog"], launcher=["--backend", "mpi"])[
        2:] == ["launch.local", "--num_workers", "2", "--threads_per_worker",
                "1", "--backend", "mpi", "--", "prog"]
    out = harness.run([sys.executable, "-c",
                       "import benchmarks.harness; print('{\"a\": 1}')"])
    assert harness.last_json("noise\n" + out) == {"a": 1}
    with pytest.raises(harness.Failed) as failed:
        harness.run([sys.executable, "-c", "print('the cause'); exit(3)"],
                    what="the probe")
    message = str(failed.value)
    assert message.splitlines()[0] == "the probe: exit 3"
    assert "the cause" in message and isinstance(failed.value, SystemExit)


def test_no_study_writes_a_table_or_starts_workers_by_hand():
    """The studies share the harness: a markdown table (`Table`, `table`)
    and a launch.local command line (`on_workers`) are built there only."""
    by_hand = []
    for path in SCRIPTS:
        if path.name == "harness.py":
            continue
        text = path.read_text()
        for needle in ('"|---', '|---|', '"launch.local"'):
            if needle in text:
                by_hand.append(f"{module_of(path)}: {needle}")
    assert by_hand == []
