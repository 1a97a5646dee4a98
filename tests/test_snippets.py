"""The code in README.md and docs/ runs as written: every ```python block
is run as a program of its own, in an empty folder, on the CPU (a block the
page marks `<!-- fragment: why -->` on the line before it is a piece of a
program, not one); a ```bash block marked `<!-- runs -->` runs too."""

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
            marker = re.match(r"<!-- (fragment|runs)\b", before)
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


@pytest.mark.parametrize("where, language, code", PROGRAMS,
                         ids=[p[0] for p in PROGRAMS])
def test_a_program_on_the_pages_runs_as_written(where, language, code,
                                                 tmp_path):
    command = ([sys.executable, "-c", code] if language == "python"
               else ["bash", "-euo", "pipefail", "-c", code])
    proc = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin",
             "HOME": str(tmp_path), "PYTHONPATH": str(REPO),
             "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, (
        f"{where}:\n{code}\n--- exit {proc.returncode}:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
