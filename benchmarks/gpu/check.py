r"""The GPU node check (`tfscale-gpu-check`, launch/gpu_check/), and BERT on
one GPU with its levers.

    python -m benchmarks.gpu.check --output_dir OUT           # = tfscale-gpu-check
    python -m benchmarks.gpu.check --output_dir OUT --tiny    # the same, small, on a CPU
    python -m benchmarks.gpu.check --output_dir OUT --levers  # benchmarks/gpu/levers.py

Every flag but `--levers` and its own (`--lever_batch`, `--parallel`,
`--warmup_steps`) is `tfscale-gpu-check`'s; see its `--help`.
"""

import argparse
import os
import sys

from launch.gpu_check import cli


def parse_lever_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.check --levers",
        description="BERT on one GPU: each lever alone, all together "
                    "(benchmarks/gpu/levers.py)")
    parser.add_argument("--levers", action="store_true",
                        help="run the levers' study (this page)")
    parser.add_argument("--output_dir", required=True,
                        help="where the runs, their logs and the table go")
    parser.add_argument("--tiny", action="store_true",
                        help="BERT-tiny, few steps: a CPU try of the study")
    parser.add_argument("--lever_batch", type=int, default=256,
                        help="the global batch (default: 256)")
    parser.add_argument("--parallel", type=int, default=4,
                        help="runs compiling at once (default: 4)")
    parser.add_argument("--warmup_steps", type=int, default=60,
                        help="steps before a run is timed (default: 60)")
    parser.add_argument("--timed_steps", type=int, default=300,
                        help="steps timed (default: 300)")
    parser.add_argument("--records", default=None,
                        help="the records folder (default: "
                             "OUTPUT_DIR/records; written when empty)")
    parser.add_argument("--timeout", type=float, default=420,
                        help="seconds a run may take before it is killed "
                             "(default: 420)")
    return parser.parse_args(argv)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--levers" not in argv:
        return cli.main(argv)
    args = parse_lever_args(argv)
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    args.records = args.records or os.path.join(out, "records")
    from benchmarks.gpu import levers as gpu_levers
    return gpu_levers.main(args, out)


if __name__ == "__main__":
    sys.exit(main())
