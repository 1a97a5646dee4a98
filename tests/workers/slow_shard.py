"""A task for the writers' engine that takes a while and writes one file:
`(folder, name)` -> folder/name holding the name (tests/test_prepare.py)."""

import os
import time


def write(task, progress):
    folder, name = task
    time.sleep(0.5)
    with open(os.path.join(folder, name), "w") as f:
        f.write(f"{folder}/{name}")
    progress(1)
    return name
