"""Trains each case of tests/test_gpu_layout.py under a single-worker
MultiWorkerMirroredStrategy, first on tf.distribute's CPU branch, then on
its GPU branch (`tests/gpu_branch.py`), and writes the weights of each:
<out>/<case>-cpu.npz, <case>-gpu.npz, and <out>/cases.json.

    python tests/workers/gpu_layout_worker.py --out DIR
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests import gpu_branch  # noqa: E402
from tests.test_gpu_layout import CASES, run_case  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    taken = {}
    for branch in ("cpu", "gpu"):
        if branch == "gpu":
            gpu_branch.take_gpu_branch()
        taken[branch] = (
            gpu_branch.merge_call_in_compiled_replica_function_fails(strategy))
        for case, (fields, optimizer_fn) in CASES.items():
            _, weights = run_case(strategy, fields, optimizer_fn)
            np.savez(os.path.join(args.out, f"{case}-{branch}.npz"), *weights)
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump({"cases": list(CASES),
                   "gpu_branch_taken": taken["gpu"] and not taken["cpu"]}, f)


if __name__ == "__main__":
    main()
