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
SCRIPTS = sorted(p for p in (REPO / "benchmarks").glob("*.py")
                 if p.name != "__init__.py")


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


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
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
                         ids=lambda p: p.stem)
def test_every_benchmark_answers_help(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(f"benchmarks.{path.stem}", run_name="__main__")
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


@pytest.mark.parametrize("path", sorted((REPO / "benchmarks").glob("*.sh")),
                         ids=lambda p: p.stem)
def test_every_shell_benchmark_answers_help(path, tmp_path):
    done = subprocess.run(["bash", str(path), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert f"bash benchmarks/{path.name}" in done.stdout
    assert list(tmp_path.iterdir()) == []  # it ran nothing


@pytest.mark.parametrize("parallel", [1, 3, 4, 7, 9])
def test_the_lever_runs_are_each_timed_once(parallel):
    """Every (model, lever) in exactly one wave, none larger than
    `parallel` but BERT-large's pair: a run twice would leave its gate
    open for the second, timed while the others compile."""
    from benchmarks import gpu_levers
    waves = gpu_levers.run_waves(parallel)
    runs = [run for wave in waves for run in wave]
    expected = ([("base", lever) for lever in gpu_levers.LEVERS]
                + [("large", "default"), ("large", "all")])
    assert sorted(runs) == sorted(expected)
    assert all(len(wave) <= max(parallel, 2) for wave in waves)
