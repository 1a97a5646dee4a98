"""`python -m benchmarks.scaling`: the study (study.py)."""

import sys

from benchmarks.scaling import study

if __name__ == "__main__":
    sys.argv[0] = "python -m benchmarks.scaling"  # argparse's prog
    study.main()
