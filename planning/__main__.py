"""python -m planning: see planning/cli.py."""

from planning.cli import main

if __name__ == "__main__":
    main()
