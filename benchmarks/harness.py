"""Start a job, read what it said, write the table: the benchmarks' one
harness.

    out = run(on_workers(2, python("benchmarks.scaling.worker", ...)))
    summary(output_dir), steady(summary(output_dir))  # a job's summary.json
    last_json(out)                     # a worker's one-line JSON result
    demo_records(folder)               # the demo's corpus as BERT records
    table = Table(["model", "steps/s"]); table.row("mlp", "41.2")
    job = Job("w1", command, out_dir, env={...}).start()
    job.wait(timeout)                  # exit code, or "timeout" (killed)
    job.intervals()                    # {step: (loss, examples/s, step ms)}
    job.signal_worker(1, SIGTERM)      # a worker of a launch.local job
    weights(run_dir), compare(a, b)    # the latest checkpoint's weights

Every command runs in the checkout with it on PYTHONPATH (the benchmarks
are not installed). A command that fails ends the study with one line
naming it, its exit code and its last output (`Failed`).
"""

import json
import os
import subprocess
import sys
from typing import Iterable, Optional, Sequence

from launch import runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the studies keep the results they write, and BERT-base's config.
RESULTS = os.path.join(REPO, "benchmarks", "results")
BERT_BASE = os.path.join(REPO, "benchmarks", "gpu", "bert_base.json")


class Failed(SystemExit):
    """A study's command failed: its line is the study's exit message."""


def checkout_env(env: Optional[dict] = None, checkout: str = REPO) -> dict:
    """`env` (or this process's) with `checkout` first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = checkout + os.pathsep + env.get("PYTHONPATH", "")
    return env


def python(module: str, *args) -> list:
    """`python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *map(str, args)]


def on_workers(workers: int, program: Sequence[str], *,
               threads: Optional[int] = 1,
               launcher: Sequence[str] = ()) -> list:
    """`program` on `workers` local workers (launch.local), each with
    `threads` threads (None: launch.local's share of the cores);
    `launcher`: more of launch.local's flags."""
    share = () if threads is None else ("--threads_per_worker", threads)
    return [*python("launch.local", "--num_workers", workers, *share),
            *launcher, "--", *program]


def run(command: Sequence[str], *, timeout: Optional[float] = None,
        env: Optional[dict] = None, what: Optional[str] = None,
        tail: int = 3000, checkout: str = REPO) -> str:
    """Runs `command` in `checkout` (this one by default); its output
    (stdout and stderr).

    Raises:
        Failed: It exited non-zero or ran past `timeout`: one line naming
            `what` (the command by default), then its last `tail`
            characters.
    """
    name = what or " ".join(map(str, command[:6]))
    try:
        done = subprocess.run(list(map(str, command)), cwd=checkout,
                              env=checkout_env(env, checkout), text=True,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        output = e.output or ""
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        raise Failed(f"{name}: still running after {timeout:g} s, "
                     f"killed\n{output[-tail:]}") from None
    if done.returncode:
        raise Failed(f"{name}: exit {done.returncode}\n"
                     f"{done.stdout[-tail:]}")
    return done.stdout


def last_json(text: str) -> dict:
    """The last line of `text` that is a JSON object (a worker's result)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError(f"no JSON line in the output: {text[-500:]!r}")


def summary(output_dir: str) -> dict:
    """A job's summary.json."""
    with open(os.path.join(output_dir, "summary.json")) as f:
        return json.load(f)


def steady(found: dict, skip: int = 1) -> list:
    """A summary's intervals past the first `skip` (the first traces and
    compiles)."""
    return found["intervals"][skip:]


def demo_records(directory: str) -> str:
    """The demo's corpus as BERT records in `directory` (made once, by the
    demo's own tools); their file pattern."""
    pattern = os.path.join(directory, "records", "train-*.tfrecord")
    if not os.path.exists(os.path.join(directory, "corpus", "vocab.txt")):
        run(python("input_pipelines.make_demo_corpus",
                   f"--output_dir={directory}/corpus"))
        run(python("input_pipelines.create_pretraining_data",
                   f"--input_file={directory}/corpus/corpus.txt",
                   f"--vocab_file={directory}/corpus/vocab.txt",
                   f"--output_file={directory}/records/train.tfrecord",
                   "--num_output_shards=4", "--max_seq_length=64",
                   "--max_predictions_per_seq=10", "--dupe_factor=1"))
    return pattern


class Table:
    """A markdown table, printed a row at a time as a study measures it
    (flushed, so a long study shows its rows as they come).

    `align`: one letter a column, "l" or "r" (default: the first left,
    the rest right)."""

    def __init__(self, columns: Sequence[str], align: Optional[str] = None,
                 file=None):
        self.columns = list(columns)
        self.align = align or "l" + "r" * (len(columns) - 1)
        if len(self.align) != len(self.columns):
            raise ValueError(f"{len(self.columns)} columns, alignment "
                             f"{self.align!r}")
        self.file = file
        self.lines = [_line(self.columns), "|" + "|".join(
            "---:" if a == "r" else "---" for a in self.align) + "|"]
        for line in self.lines:
            print(line, file=self.file, flush=True)

    def row(self, *cells) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} "
                             f"columns: {cells}")
        self.lines.append(_line(map(str, cells)))
        print(self.lines[-1], file=self.file, flush=True)

    def text(self) -> str:
        return "\n".join(self.lines)


def table(columns: Sequence[str], rows: Iterable[Sequence],
          align: Optional[str] = None) -> str:
    """The markdown of a whole table (`Table`'s layout), not printed."""
    import io
    built = Table(columns, align, file=io.StringIO())
    for cells in rows:
        built.row(*cells)
    return built.text()


def _line(cells) -> str:
    return "| " + " | ".join(cells) + " |"


class Job(runs.Job):
    """`launch.runs.Job` run in the checkout, which it puts on PYTHONPATH."""

    def __init__(self, name: str, command, out_dir: str, env=None):
        env = dict(env or {})
        env["PYTHONPATH"] = REPO + os.pathsep + env.get(
            "PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        super().__init__(name, command, out_dir, env, cwd=REPO)


def weights(run_dir: str) -> dict:
    """The model's weights in `run_dir`'s latest checkpoint."""
    from tfscale.resume import compare as compare_lib
    return compare_lib.weights(run_dir)


def compare(a: dict, b: dict) -> dict:
    """The largest difference relative to each tensor's largest value, and
    whether every tensor is bit-identical."""
    from tfscale.resume import compare as compare_lib
    found = compare_lib.compare(a, b)
    found.pop("tensors")
    return found
