"""The code in README.md and docs/ runs as written: every ```python block
is run as a program of its own, in an empty folder, on the CPU (a block the
page marks `<!-- fragment: why -->` on the line before it is a piece of a
program, not one; one marked `<!-- workers: 2 -->`, a multi-worker
program, runs as 2 workers under `launch.local`, as its page says to start
it); a ```bash block marked `<!-- runs -->` runs too."""

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def blocks():
    """(page:line, language, code, marker) of every fenced block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = re.match(r"<!-- (fragment|runs|workers: 2)\b", before)
            found.append((f"{page.relative_to(REPO)}:{line}", match.group(1),
                          match.group(2), marker.group(1) if marker else None))
    return found


PROGRAMS = [(where, language, code) for where, language, code, marker
            in blocks() if (language == "python" and marker != "fragment")
            or (language == "bash" and marker == "runs")]


def test_the_pages_hold_programs_and_say_which_blocks_are_pieces():
    # The check can fail: the pages' programs are found, and a fragment
    # says why it is one.
    assert len(PROGRAMS) >= 6, [p[0] for p in PROGRAMS]
    fragments = [b for b in blocks() if b[3] == "fragment"]
    text = "".join(page.read_text() for page in PAGES)
    assert len(re.findall(r"<!-- fragment: \S", text)) == len(fragments)


TWO_WORKERS = [(where, code) for where, language, code, marker in blocks()
               if marker == "workers: 2"]


def run_program(code, folder, language="python", workers=1):
    """(exit code, output) of `code` run in `folder` as a user would: by
    itself, or as `workers` processes under `launch.local`."""
    if language == "python":
        (folder / "program.py").write_text(code)
        command = [sys.executable, "program.py"]
    else:
        command = ["bash", "-euo", "pipefail", "-c", code]
    if workers > 1:
        command = [sys.executable, "-m", "launch.local", "--num_workers",
                   str(workers), "--threads_per_worker", "1", "--", *command]
    proc = subprocess.run(
        command, cwd=folder, capture_output=True, text=True, timeout=300,
        env={"PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin",
             "HOME": str(folder), "PYTHONPATH": str(REPO),
             "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("where, language, code", PROGRAMS,
                         ids=[p[0] for p in PROGRAMS])
def test_a_program_on_the_pages_runs_as_written(where, language, code,
                                                 tmp_path):
    code_, output = run_program(code, tmp_path, language)
    assert code_ == 0, f"{where}:\n{code}\n--- exit {code_}:\n{output[-6000:]}"


def test_the_multi_worker_programs_are_marked():
    assert sorted(where.split(":")[0] for where, _ in TWO_WORKERS) == [
        "README.md", "docs/keras-fit.md", "docs/trainer.md",
        "docs/trainer.md"]


@pytest.mark.slow
@pytest.mark.parametrize("where, code", TWO_WORKERS,
                         ids=[p[0] for p in TWO_WORKERS])
def test_a_multi_worker_program_on_the_pages_runs_on_two_workers(
        where, code, tmp_path):
    code_, output = run_program(code, tmp_path, workers=2)
    assert code_ == 0, f"{where}:\n{code}\n--- exit {code_}:\n{output[-6000:]}"
    assert "[launcher] exit 0: every worker finished" in output
    assert "[worker 1]" in output
    # Piped to the launcher, Keras's progress bar would be one line of
    # carriage returns and escape codes: an epoch a line instead.
    # (Carriage returns read as line ends here; the codes stay.)
    assert "\x1b[" not in output, output[-3000:]


@pytest.mark.slow
def test_the_keras_fit_page_as_it_was_fails_on_two_workers_in_one_line(
        tmp_path):
    # docs/keras-fit.md's script once built its dataset before the strategy:
    # fine on one process, "Collective ops must be configured at program
    # startup" and a TensorFlow traceback on two.
    (where, code), = [p for p in TWO_WORKERS if "keras-fit" in p[0]]
    lines = code.splitlines()
    strategy = next(i for i, line in enumerate(lines)
                    if line.startswith("strategy = "))
    dataset_end = next(i for i, line in enumerate(lines)
                       if "(images, labels)).batch(64)" in line)
    as_it_was = (lines[:strategy] + lines[strategy + 1:dataset_end + 1]
                 + [lines[strategy]] + lines[dataset_end + 1:])
    assert as_it_was != lines
    assert run_program("\n".join(as_it_was), tmp_path)[0] == 0  # one process
    code_, output = run_program("\n".join(as_it_was), tmp_path, workers=2)
    assert code_ == 2, output[-5000:]
    # Either worker may reach the strategy first; the launcher then stops
    # the other, which may not have printed its own line.
    assert re.search(r"tfscale: worker [01]: TensorFlow started before the "
                     r"strategy \(a dataset, a tensor or a model came first\)",
                     output), output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    assert output.rstrip().endswith(
        "[launcher] exit 2: worker 1 stopped on a setting, its data or its "
        "disk (named above): fix it and rerun") or output.rstrip().endswith(
        "[launcher] exit 2: worker 0 stopped on a setting, its data or its "
        "disk (named above): fix it and rerun")
