"""The node's layout, the jobs each phase of the check starts, and the
phases run in order within the budget (`run_phases`)."""

import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

from launch.gpu_check.figures import (BERT_BASE, ESTIMATES, PHASES, TINY,
                                      bus_bandwidth, flops_per_sequence,
                                      link_between, sigterm_row)
from launch.gpu_check.report import Budget, Results
from launch.runs import Job

class Node:
    """What the check runs on, and how it starts the jobs.

    Attributes:
        gpus: The GPUs used (CUDA_VISIBLE_DEVICES entries), [] on a CPU.
        workers: N, the multi-worker runs' worker count.
        shared: Workers share one GPU (a one-GPU node).
        launcher: "local" (launch.local on this host) or "srun".
        tiny: BERT-tiny on a CPU.
    """

    def __init__(self, gpus: Sequence[str], launcher: str, tiny: bool):
        self.gpus = list(gpus)
        self.shared = len(self.gpus) == 1
        self.workers = len(self.gpus) if len(self.gpus) > 1 else 2
        self.launcher = launcher
        self.tiny = tiny

    def layout(self) -> str:
        if not self.gpus:
            return f"{self.workers} workers on the CPU, gRPC ring"
        if self.shared:
            return (f"{self.workers} workers sharing GPU {self.gpus[0]} "
                    "over the gRPC ring (one GPU: NCCL refuses two ranks "
                    "on it)")
        return f"{self.workers} workers, one GPU each, all-reduce auto (NCCL)"

    def env(self, first_only: bool = False) -> dict:
        if not self.gpus:
            return {}
        return {"CUDA_VISIBLE_DEVICES": (self.gpus[0] if first_only else
                                         ",".join(self.gpus))}

    def launched(self, command: list) -> list:
        """`command` as N workers."""
        if self.launcher == "srun":
            return ["srun", "--ntasks", str(self.workers),
                    *(["--gpus-per-task", "1"] if self.gpus else []),
                    *command]
        binding = (["--share_gpus"] if self.shared else
                   ["--gpus_per_worker", "1"] if self.gpus else [])
        return [sys.executable, "-m", "launch.local", "--num_workers",
                str(self.workers), *binding, "--", *command]


def job_command(args, run_dir: str, steps: int, config: str,
                batch: int, extra=()) -> list:
    """The BERT job on the check's records."""
    precision = [] if args.tiny else ["--precision=mixed_bfloat16"]
    return [sys.executable, "-m", "models.tasks.run_pretraining",
            f"--input_file={args.records}/bert-*.tfrecord",
            f"--output_dir={run_dir}", f"--bert_config_file={config}",
            "--max_seq_length=128", "--max_predictions_per_seq=20",
            f"--train_batch_size={batch}", "--optimizer=lamb",
            "--learning_rate=1e-4", f"--num_train_steps={steps}",
            "--num_warmup_steps=10", *precision, *extra]


def compare_runs(a: str, b: str) -> dict:
    """`python -m tfscale.resume.compare a b` (in its own process: this
    module never loads TensorFlow)."""
    out = subprocess.run([sys.executable, "-m", "tfscale.resume.compare",
                          a, b], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def steady_rate(job: Job, log_steps: int) -> Optional[float]:
    """Mean examples/s of the intervals after the first (compilation)."""
    steady = [v[1] for s, v in sorted(job.intervals().items())
              if s > log_steps]
    return sum(steady) / len(steady) if steady else None


def run_row(job: Job) -> dict:
    row = {"exit": job.code, "seconds": round(job.seconds or 0, 1)}
    found = job.intervals()
    if found:
        row["last_loss"] = found[max(found)][0]
    return row


class Check:
    """One check's settings, folders and what the phases hand on."""

    def __init__(self, args, node: Node, budget: Budget):
        self.args = args
        self.node = node
        self.budget = budget
        self.logs = os.path.join(args.output_dir, "logs")
        os.makedirs(self.logs, exist_ok=True)
        n = node.workers
        # One global batch for 1 and N workers: a multiple of N.
        self.batch = -(-args.batch // n) * n
        self.configs = {}
        for name, config in (("base", TINY if args.tiny else BERT_BASE),):
            still = dict(config, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
            for key, value in (("base", config), ("still", still)):
                self.configs[key] = os.path.join(args.output_dir,
                                                 f"bert_{key}.json")
                with open(self.configs[key], "w") as f:
                    json.dump(value, f)
        self.flops = flops_per_sequence(TINY if args.tiny else BERT_BASE)
        self.sigterm = None  # equivalence -> resume
        self.speed = None  # speed -> speed-1

    def run(self, name: str) -> str:
        return os.path.join(self.args.output_dir, "runs", name)

    def job(self, name: str, command, env=None) -> Job:
        return Job(name, command, self.logs, env)


def records(check: Check) -> dict:
    job = check.job("records", [
        sys.executable, "-m", "input_pipelines.synthetic_bert",
        "--output_dir", check.args.records, "--num_records", "4096",
        "--num_files", "4"]).start()
    job.wait(check.budget.left())
    return {"records": {"exit": job.code, "passed": job.code == 0,
                        "folder": check.args.records}}


def equivalence(check: Check) -> dict:
    a, node = check.args, check.node
    same = ["--deterministic", "--seed=7",
            f"--iterations_per_loop={a.log_steps}",
            f"--save_checkpoints_steps={a.save_steps}"]
    growth = {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}  # three jobs at once

    def command(name):
        return job_command(a, check.run(name), a.steps,
                           check.configs["still"], check.batch, same)
    one = check.job("w1", command("w1"), {**node.env(True), **growth})
    many = check.job("wN", node.launched(command("wN")),
                     {**node.env(), **growth})
    sig = (check.job("sigterm", node.launched(command("sigterm")),
                     {**node.env(), **growth})
           if node.launcher == "local" else None)
    for job in (one, many, sig):
        if job is not None:
            job.start()
    check.sigterm = (sig, signal_worker_one(sig, a.save_steps, check.budget)
                     if sig else None)
    for job in (one, many):
        job.wait(check.budget.left())
    rows = {"1 worker": dict(run_row(one), placement=one.placements()),
            f"{node.workers} workers": dict(run_row(many),
                                           placement=many.placements())}
    if one.code == 0 and many.code == 0:
        found = compare_runs(check.run("w1"), check.run("wN"))
        rows[f"{node.workers} workers against 1"] = dict(
            found, passed=found.get("max_relative_difference", 1.0)
            <= a.tolerance)
    else:
        rows[f"{node.workers} workers against 1"] = {
            "passed": False, "why": f"exits {one.code} and {many.code}"}
    return rows


def signal_worker_one(job: Job, save_steps: int, budget: Budget) -> dict:
    """SIGTERM to worker 1 of `job` once checkpoint `save_steps` is
    written: whether it was delivered, seconds to the complete preemption
    checkpoint and to the exit, the exit code."""
    found = {"delivered": False, "complete": None, "exit": None}
    if job.wait_for(f"ckpt-{save_steps}", budget.left()) is not None:
        sent = time.monotonic()
        found["delivered"] = job.signal_worker(1, signal.SIGTERM)
        if found["delivered"]:
            found["complete"] = job.wait_for(
                "preemption checkpoint complete:", max(budget.left(), 1))
            job.wait(budget.left())
            found["exit"] = round(time.monotonic() - sent, 2)
    if job.code is None:
        job.wait(budget.left())
    found["code"] = job.code
    return found


def resume(check: Check) -> dict:
    if check.sigterm is None or check.sigterm[0] is None:
        return {"SIGTERM to worker 1, resumed": {
            "passed": False, "verdict": "not run: the workers are not "
            "on this host (--launcher srun)"}}
    sig, said = check.sigterm
    rerun_exit, comparison = None, None
    if said["delivered"] and said["code"] == 143:
        rerun = check.job("sigterm-rerun", sig.command, sig.env).start()
        rerun_exit = rerun.wait(check.budget.left())
        if rerun_exit == 0 and os.path.isdir(check.run("wN")):
            comparison = compare_runs(check.run("wN"), check.run("sigterm"))
    return {"SIGTERM to worker 1, resumed": sigterm_row(
        said["delivered"], said["code"], said["complete"], said["exit"],
        rerun_exit, comparison)}


def speed(check: Check, workers: Optional[int] = None) -> dict:
    """Examples/s of the job as trained (dropout, not deterministic)."""
    a, node = check.args, check.node
    n = workers or node.workers
    batch = a.batch * n
    command = job_command(a, check.run(f"speed{n}"), a.timed_steps,
                          check.configs["base"], batch,
                          [f"--iterations_per_loop={a.log_steps}"])
    job = check.job(f"speed{n}", command if workers == 1 else
                    node.launched(command),
                    node.env(first_only=workers == 1)).start()
    job.wait(check.budget.left())
    rate = steady_rate(job, a.log_steps)
    row = dict(run_row(job), global_batch=batch, passed=rate is not None)
    if rate:
        gpus = 1 if workers == 1 else max(len(node.gpus), 1)
        row.update(examples_per_second=round(rate, 1),
                   steps_per_second=round(rate / batch, 2))
        peak = check.args.peak_tflops
        if peak and node.gpus:
            row["share_of_peak"] = round(
                rate * check.flops / (gpus * peak * 1e12), 4)
    name = "1 worker" if workers == 1 else f"{n} workers"
    rows = {name: row}
    if workers == 1 and rate and check.speed and not node.shared:
        rows["scaling efficiency"] = round(
            check.speed / (node.workers * rate), 3)
    if workers != 1:
        check.speed = rate
    return rows


def speed_one(check: Check) -> dict:
    return speed(check, workers=1)


def all_reduce(check: Check) -> dict:
    a, node = check.args, check.node
    sizes = ("65536,1048576,4194304" if a.tiny else
             "4194304,67108864,268435456")
    path = os.path.join(a.output_dir, "link.json")
    job = check.job("all-reduce", node.launched([
        sys.executable, "-m", "tfscale.cluster.link_probe", "--output", path,
        "--sizes", sizes, "--repeats", "5"]), node.env()).start()
    job.wait(check.budget.left())
    if job.code != 0 or not os.path.exists(path):
        return {"all-reduce": {"exit": job.code, "passed": False}}
    with open(path) as f:
        sweep = json.load(f)
    link = ("host memory (the workers share one GPU)" if node.shared else
            "host memory and loopback (no GPU)" if not node.gpus else
            link_between(a.topology) or "unknown (no nvidia-smi topo -m)")
    rows = {"link": link}
    for size, seconds in zip(sweep["sizes"], sweep["seconds"]):
        rows[f"{size / 2**20:g} MiB"] = {
            "seconds": round(seconds, 5),
            "algbw_GBps": round(size / seconds / 1e9, 3),
            "busbw_GBps": round(bus_bandwidth(size, seconds,
                                              sweep["ranks"]) / 1e9, 3)}
    rows["ranks"] = sweep["ranks"]
    return rows


RUNS = {"records": records, "equivalence": equivalence, "speed": speed,
        "all-reduce": all_reduce, "resume": resume, "speed-1": speed_one}
# A phase that cannot run when another was skipped.
NEEDS = {"equivalence": "records", "speed": "records", "resume":
         "equivalence", "speed-1": "records"}


def run_phases(check: Check, results: Results, phases=None) -> bool:
    """Each phase in order that fits in the budget (else skipped and
    named); results written after each. Whether every phase that ran
    passed."""
    passed = True
    results.write()
    for name, _, _, _ in PHASES:
        if phases and name not in phases:
            continue
        gpu, tiny = ESTIMATES[name]
        estimate = tiny if check.args.tiny else gpu
        if NEEDS.get(name) in results.data["skipped"]:
            results.skip(name, f"needs {NEEDS[name]}, skipped")
            continue
        if not check.budget.fits(estimate):
            results.skip(name, f"estimated {estimate} s, "
                         f"{max(check.budget.left(), 0):.0f} s left of "
                         f"--budget_seconds {check.args.budget_seconds:g}")
            continue
        started = time.monotonic()
        print(f"[gpu_check] {name} ({estimate} s estimated, "
              f"{check.budget.left():.0f} s left)", flush=True)
        try:
            rows = RUNS[name](check)
        except Exception as e:  # a phase's fault is its row, not the end
            rows = {"error": {"passed": False, "why": f"{type(e).__name__}: "
                              f"{e}"}}
        rows["seconds"] = round(time.monotonic() - started, 1)
        results.phase(name, rows)
        passed &= all(row.get("passed", True) for row in rows.values()
                      if isinstance(row, dict))
    return passed
