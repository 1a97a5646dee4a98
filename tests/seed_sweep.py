"""Runs tests under many global seeds and counts each test's failures.

    python -m tests.seed_sweep                      # the noise-scale tests, seeds 0-19
    python -m tests.seed_sweep --seeds 5 -- tests/test_trainer.py -k resume

Each seed is one pytest process started with `--global-seed=K`, so every
test in it starts from `keras.utils.set_random_seed(K)` (tests/conftest.py).
A test whose outcome depends on the global seed fails at some K. Prints one
line per seed, then a table of the tests that failed and at which seeds;
exits 1 if any failed. `make test-seeds` runs the default.
"""

import argparse
import re
import subprocess
import sys
import time

DEFAULT_TESTS = ["tests/test_noise_scale.py", "-m", "not slow"]
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
SUMMARY = re.compile(r"^=* ?(.*\d+ (?:passed|failed).*?) ?=*$", re.MULTILINE)


def run_seed(seed: int, tests: list) -> tuple:
    """(failed test ids, pytest's summary line, seconds) at one seed."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
         f"--global-seed={seed}", *tests],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL)
    summary = SUMMARY.findall(proc.stdout)
    if proc.returncode not in (0, 1) or not summary:
        raise SystemExit(f"seed_sweep: error: pytest exited {proc.returncode} "
                         f"at --global-seed={seed}:\n{proc.stdout[-3000:]}")
    return (FAILED.findall(proc.stdout), summary[-1],
            time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20,
                        help="run at global seeds 0 .. SEEDS-1")
    parser.add_argument("tests", nargs="*", default=DEFAULT_TESTS,
                        help="pytest's arguments (after --)")
    args = parser.parse_args(argv)
    failures = {}
    total = time.perf_counter()
    for seed in range(args.seeds):
        failed, summary, seconds = run_seed(seed, args.tests)
        print(f"seed {seed:2d}: {summary} ({seconds:.0f} s)", flush=True)
        for test in failed:
            failures.setdefault(test, []).append(seed)
    print(f"{args.seeds} seeds in {time.perf_counter() - total:.0f} s")
    for test, seeds in sorted(failures.items()):
        print(f"  {test}: failed at {len(seeds)} of {args.seeds} seeds "
              f"({', '.join(map(str, seeds))})")
    if not failures:
        print("  no test failed at any seed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
