"""`python -m benchmarks.time_to_accuracy`: the study (study.py)."""

import sys

from benchmarks.time_to_accuracy import study

if __name__ == "__main__":
    sys.argv[0] = "python -m benchmarks.time_to_accuracy"  # argparse's prog
    study.main()
