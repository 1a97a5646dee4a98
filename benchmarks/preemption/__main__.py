"""`python -m benchmarks.preemption`: the study (study.py)."""

import sys

from benchmarks.preemption import study

if __name__ == "__main__":
    sys.argv[0] = "python -m benchmarks.preemption"  # argparse's prog
    study.main()
