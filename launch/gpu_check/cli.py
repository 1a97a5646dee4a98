"""tfscale-gpu-check's command line: the flags, the node it runs on, main."""

import argparse
import os
import subprocess
import sys
import time
from typing import Optional

import launch.gpu_check as package
from launch import gpus as gpus_lib
from launch.gpu_check.figures import PEAK_TFLOPS
from launch.gpu_check.phases import Check, Node, run_phases
from launch.gpu_check.report import Budget, Results

def gpu_name(nvidia_smi: str = "nvidia-smi") -> Optional[str]:
    try:
        out = subprocess.run([nvidia_smi, "--query-gpu=name",
                              "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return names[0].strip() if names else None


def topology(nvidia_smi: str = "nvidia-smi") -> str:
    try:
        out = subprocess.run([nvidia_smi, "topo", "-m"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="tfscale-gpu-check", description=package.__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True,
                        help="where results.json, table.md, the logs and the runs go")
    parser.add_argument("--gpus", type=int, default=None,
                        help="use the first N GPUs this node sees (default: all)")
    parser.add_argument("--tiny", action="store_true",
                        help="BERT-tiny in float32, few steps: the same phases on a CPU")
    parser.add_argument("--launcher", choices=["local", "srun"], default=None,
                        help="how the N workers start: launch.local on this node, or srun "
                        "over the SLURM allocation (default: srun inside an "
                        "allocation of several nodes, else local)")
    parser.add_argument("--budget_seconds", type=float, default=None,
                        help="phases that cannot finish within it are skipped and named "
                        "(default: 530, a 10-minute call less the setup; --tiny: 900)")
    parser.add_argument("--batch", type=int, default=None,
                        help="global batch of the 1-vs-N runs, rounded up to a multiple of "
                        "N; per GPU in the speed runs (default: 64; --tiny: 16)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps of the 1-vs-N and SIGTERM runs (default: 40; --tiny: 24)")
    parser.add_argument("--save_steps", type=int, default=None,
                        help="their checkpoint interval; the SIGTERM goes after the first "
                        "(default: 20; --tiny: 8)")
    parser.add_argument("--timed_steps", type=int, default=None,
                        help="steps of each speed run (default: 100; --tiny: 24)")
    parser.add_argument("--log_steps", type=int, default=None,
                        help="log interval of every run; the first is left out of the "
                        "speed (default: 10; --tiny: 8)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest relative difference of N workers' weights and slots "
                        "from 1 worker's that passes (tfscale.resume.compare; "
                        "default: 1e-2 in bfloat16, a few of its roundings; --tiny, "
                        "float32: 1e-4)")
    parser.add_argument("--records", default=None,
                        help="the records folder (default: OUTPUT_DIR/records; written "
                        "when it has none)")
    args = parser.parse_args(argv)
    defaults = dict(budget_seconds=(900, 530), batch=(16, 64), steps=(24, 40),
                    save_steps=(8, 20), timed_steps=(24, 100),
                    log_steps=(8, 10), tolerance=(1e-4, 1e-2))
    for key, (tiny, gpu) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else gpu)
    for key in ("batch", "steps", "save_steps", "timed_steps", "log_steps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.save_steps >= args.steps:
        parser.error(f"--save_steps {args.save_steps} must be below --steps "
                     f"{args.steps} (the SIGTERM goes after the first save)")
    if args.gpus is not None and args.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {args.gpus}")
    return args


def node_of(args, env) -> Node:
    """The GPUs used and the launcher (raises ValueError: --gpus beyond
    what the node has)."""
    seen = gpus_lib.host_gpus(env)
    if args.gpus is not None:
        if args.gpus > len(seen):
            raise ValueError(f"--gpus {args.gpus}: this node sees "
                             f"{len(seen)} GPU(s)"
                             + (f" ({','.join(seen)})" if seen else ""))
        seen = seen[:args.gpus]
    if args.tiny:
        seen = []
    launcher = args.launcher or (
        "srun" if env.get("SLURM_JOB_ID") and
        int(env.get("SLURM_NNODES", "1") or 1) > 1 else "local")
    node = Node(seen, launcher, args.tiny)
    if launcher == "srun" and env.get("SLURM_NTASKS", "").isdigit():
        node.workers = int(env["SLURM_NTASKS"])
    return node


def main(argv=None) -> int:
    args = parse_args(argv)
    args.output_dir = os.path.abspath(args.output_dir)
    args.records = os.path.abspath(args.records or os.path.join(
        args.output_dir, "records"))
    os.makedirs(args.output_dir, exist_ok=True)
    budget = Budget(args.budget_seconds)
    try:
        node = node_of(args, os.environ)
    except ValueError as e:
        print(f"tfscale-gpu-check: error: {e}", file=sys.stderr)
        return 2
    name = None if args.tiny else gpu_name()
    args.peak_tflops = next((peak for key, peak in PEAK_TFLOPS.items()
                             if name and key in name), None)
    args.topology = "" if args.tiny else topology()
    results = Results(args.output_dir, {
        "title": ("--tiny, CPU" if args.tiny else
                  f"{len(node.gpus)} x {name or 'GPU'}"),
        "layout": node.layout(), "launcher": node.launcher,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "budget_seconds": args.budget_seconds,
        "peak_tflops_per_gpu": args.peak_tflops,
        "command": " ".join(["tfscale-gpu-check", *(
            sys.argv[1:] if argv is None else argv)])})
    check = Check(args, node, budget)
    passed = run_phases(check, results)
    print(results.table(), flush=True)
    return 0 if passed else 1
