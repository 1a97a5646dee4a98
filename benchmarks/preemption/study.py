r"""From a SIGTERM to the checkpoint, at any steps per call.

    python -m benchmarks.preemption --output_dir runs/preemption \
        --steps_per_call 10,100,1000 --bounds 0,2

Runs the real job (`run_pretraining.py`, BERT-tiny on the demo's records,
`--workers` workers through `launch.local`) once per steps-per-call and
`--max_call_seconds` bound (0: none, a call runs all its steps), sends
SIGTERM to the last worker `--signal_after` seconds after the start banner
(past tracing and compilation), and times the signal to the line of the
saved preemption checkpoint. With no bound, a signal waits for the call in
flight: up to steps-per-call steps. A last run per steps-per-call without a
signal gives the step time (summary.json), which turns seconds into steps.
Output: report.md and results.json in --output_dir.

    python -m benchmarks.preemption --output_dir runs/preemption --phases

`--phases`: SIGTERM to the launcher (which passes it to every worker, as a
scheduler does) in each phase of a run, the time from the signal to the
line of the complete checkpoint and to the launcher's exit: in the first
call (at the start banner: restoring, tracing, compiling), in training (at
1,000 steps a call, the default 2 s bound), in the evaluation at the end
(`--do_eval`, once the final checkpoint is saved). The first call's own
length (banner to the first interval) is measured beside it. Output:
phases.md and phases.json in --output_dir.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from benchmarks import harness


def launch_command(pattern, corpus, out, *, workers, backend, steps,
                   per_call, bound, extra=()):
    mpi = ["--backend", "mpi"] if backend == "mpi" else []
    return harness.on_workers(workers, [
        sys.executable, "run_pretraining.py", f"--input_file={pattern}",
        f"--output_dir={out}", f"--bert_config_file={corpus}/bert_config.json",
        "--max_seq_length=64", "--max_predictions_per_seq=10",
        "--train_batch_size=32", f"--num_train_steps={steps}",
        "--num_warmup_steps=10", f"--save_checkpoints_steps={steps}",
        f"--iterations_per_loop={per_call}", f"--max_call_seconds={bound}",
        "--timed_steps_per_log=0", f"--backend={backend}", *extra],
        threads=max(1, (os.cpu_count() or 2) // workers), launcher=mpi)


def worker_pids(marker: str) -> list:
    """The workers (or mpirun's ranks) whose command line holds `marker`,
    oldest first."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if (b"run_pretraining.py" in command and marker.encode() in command
                and b"launch" not in command):
            found.append((int(fields[19]), int(name)))  # start time, pid
    return [pid for _, pid in sorted(found)]


def preempted_run(command, signal_after: float, marker: str) -> dict:
    """Runs `command`; SIGTERM to its last worker `signal_after` s after the
    banner; returns the saved step and the seconds from signal to save."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    sent, saved, lines = [], [], []

    def send():
        pids = worker_pids(marker)
        if pids:
            os.kill(pids[-1], signal.SIGTERM)
            sent.append(time.monotonic())

    for line in proc.stdout:
        lines.append(line)
        if "calls: up to" in line and not sent:
            timer = threading.Timer(signal_after, send)
            timer.daemon = True
            timer.start()
        found = re.search(r"preempted: checkpoint at step (\d+) saved", line)
        if found and not saved:
            saved.append((int(found.group(1)), time.monotonic()))
    code = proc.wait()
    result = {"exit_code": code, "signalled": bool(sent),
              # A peer's collective aborted after a clean preemption.
              "abort_lines": sum("StartAbort" in line or "have crashed" in line
                                 for line in lines)}
    if sent and saved:
        result.update(saved_step=saved[0][0],
                      signal_to_save_seconds=saved[0][1] - sent[0])
    elif sent:
        result["tail"] = "".join(lines[-15:])
    return result


def phase_run(command, phase: str, marker: str, signal_after: float) -> dict:
    """Runs `command` (a `launch.local` command line), SIGTERM to the
    launcher when `phase` begins: "first_call" at the start banner,
    "training" `signal_after` s after it, "evaluation" 1 s after the final
    checkpoint's line (`marker`). Times the signal to the complete
    checkpoint's line and to the launcher's exit."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    sent, lines, stamps = [], [], {}

    def send():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            sent.append(time.monotonic())

    def later(seconds):
        timer = threading.Timer(seconds, send)
        timer.daemon = True
        timer.start()

    for line in proc.stdout:
        lines.append(line)
        now = time.monotonic()
        if "calls: up to" in line and "banner" not in stamps:
            stamps["banner"] = now
            if phase == "first_call":
                send()
            elif phase == "training":
                later(signal_after)
        if re.search(r"step \d+: loss", line) and "first" not in stamps:
            stamps["first"] = now
        if phase == "evaluation" and marker in line and not sent:
            later(1.0)
        if "preemption checkpoint complete:" in line and "saved" not in stamps:
            stamps["saved"] = now
    code = proc.wait()
    ended = time.monotonic()
    row = {"phase": phase, "exit_code": code, "signalled": bool(sent),
           "abort_lines": sum("StartAbort" in line or "have crashed" in line
                              for line in lines)}
    if sent:
        row["signal_to_exit_seconds"] = ended - sent[0]
        if "saved" in stamps:
            row["signal_to_complete_seconds"] = stamps["saved"] - sent[0]
    else:
        row["tail"] = "".join(lines[-15:])
    if "banner" in stamps and "first" in stamps:
        row["first_call_seconds"] = stamps["first"] - stamps["banner"]
    return row


def phases(args, root: str, pattern: str) -> None:
    """--phases: one run per phase; phases.md and phases.json."""
    corpus = os.path.join(root, "corpus")
    rows = []
    for phase in ("first_call", "training", "evaluation"):
        out = os.path.join(root, f"phase-{phase}")
        shutil.rmtree(out, ignore_errors=True)
        steps = 40 if phase == "evaluation" else args.steps
        extra = (["--do_eval", "--eval_batch_size=8",
                  "--max_eval_steps=100000"] if phase == "evaluation" else [])
        command = launch_command(
            pattern, corpus, out, workers=args.workers, backend=args.backend,
            steps=steps, per_call=1000, bound=2, extra=extra)
        row = phase_run(command, phase, f"ckpt-{steps}", args.signal_after)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(root, "phases.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [f"# SIGTERM in each phase: {args.workers} worker(s), "
             f"{args.backend}, BERT-tiny (seq 64, batch 32), 1,000 steps a "
             "call, 2 s bound", ""]

    def seconds(row, key):
        return "-" if key not in row else f"{row[key]:.1f}"

    lines.append(harness.table(
        ["phase", "exit code", "signal -> checkpoint complete (s)",
         "signal -> every worker gone (s)", "first call (s)"],
        ([row["phase"], row["exit_code"],
          seconds(row, "signal_to_complete_seconds"),
          seconds(row, "signal_to_exit_seconds"),
          seconds(row, "first_call_seconds")] for row in rows)))
    write_report(root, "phases.md", lines)


def write_report(root: str, name: str, lines) -> None:
    """The table's lines into `root/name`, and on stdout."""
    report = "\n".join(lines) + "\n"
    with open(os.path.join(root, name), "w") as f:
        f.write(report)
    print(report)


def step_seconds(command) -> float:
    """The steady step time of an uninterrupted run (its summary.json)."""
    out = command[command.index("--") + 1:]
    output_dir = next(a.split("=", 1)[1] for a in out
                      if a.startswith("--output_dir="))
    harness.run(command, what="the uninterrupted run")
    summary = harness.summary(output_dir)
    return summary["global_batch_size"] / summary["examples_per_second"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="runs/preemption",
                        help="folder for report.md and results.json")
    parser.add_argument("--steps_per_call", default="10,100,1000",
                        help="--steps_per_execution values timed, comma-"
                             "separated")
    parser.add_argument("--bounds", default="0,2",
                        help="--max_call_seconds values (0: no bound)")
    parser.add_argument("--workers", type=int, default=2,
                        help="workers of each run")
    parser.add_argument("--backend", default="mwms", choices=["mwms", "mpi"],
                        help="how workers sum gradients: mwms "
                             "(MultiWorkerMirroredStrategy) or mpi "
                             "(MPI.Allreduce)")
    parser.add_argument("--steps", type=int, default=3000,
                        help="steps a run would train (the signal ends it "
                             "first)")
    parser.add_argument("--signal_after", type=float, default=20.0,
                        help="seconds after the start when SIGTERM is sent")
    parser.add_argument("--step_time_steps", type=int, default=200,
                        help="steps of the run that measures the step time")
    parser.add_argument("--phases", action="store_true",
                        help="SIGTERM in each phase of a run instead (see "
                             "the module docstring)")
    args = parser.parse_args()
    root = os.path.abspath(args.output_dir)
    os.makedirs(root, exist_ok=True)
    pattern = harness.demo_records(root)
    if args.phases:
        phases(args, root, pattern)
        return
    corpus = os.path.join(root, "corpus")
    results = []
    for per_call in [int(v) for v in args.steps_per_call.split(",")]:
        for bound in [float(v) for v in args.bounds.split(",")]:
            out = os.path.join(root, f"call{per_call}-bound{bound:g}")
            shutil.rmtree(out, ignore_errors=True)
            command = launch_command(
                pattern, corpus, out, workers=args.workers,
                backend=args.backend, steps=args.steps, per_call=per_call,
                bound=bound)
            row = {"steps_per_call": per_call, "max_call_seconds": bound,
                   **preempted_run(command, args.signal_after, out)}
            results.append(row)
            print(json.dumps(row), flush=True)
        timing_dir = os.path.join(root, f"call{per_call}-timing")
        shutil.rmtree(timing_dir, ignore_errors=True)
        # Log intervals of 50 steps: the steady ones leave compilation out.
        seconds = step_seconds(launch_command(
            pattern, corpus, timing_dir, workers=args.workers,
            backend=args.backend, steps=args.step_time_steps,
            per_call=min(per_call, 50), bound=0))
        for row in results:
            if row["steps_per_call"] == per_call:
                row["step_seconds"] = seconds
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"# SIGTERM to checkpoint: {args.workers} worker(s), "
             f"{args.backend}, BERT-tiny (seq 64, batch 32)", "",
             harness.table(
                 ["steps per call", "--max_call_seconds", "saved at step",
                  "signal -> save (s)",
                  "in steps (at the measured step time)"],
                 ([row["steps_per_call"], f"{row['max_call_seconds']:g}",
                   "-", f"no save (exit {row['exit_code']})", "-"]
                  if "signal_to_save_seconds" not in row else
                  [row["steps_per_call"], f"{row['max_call_seconds']:g}",
                   row["saved_step"], f"{row['signal_to_save_seconds']:.1f}",
                   f"{row['signal_to_save_seconds'] / row['step_seconds']:.0f}"]
                  for row in results), align="rrrrr")]
    write_report(root, "report.md", lines)


if __name__ == "__main__":
    main()
