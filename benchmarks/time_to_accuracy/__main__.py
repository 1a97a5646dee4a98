"""`python -m benchmarks.time_to_accuracy`: the sweep (sweep.py)."""

import sys

from benchmarks.time_to_accuracy import sweep

if __name__ == "__main__":
    sys.argv[0] = "python -m benchmarks.time_to_accuracy"  # argparse's prog
    sweep.main()
