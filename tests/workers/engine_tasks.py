"""Tasks for the writers' engine on a real LocalCluster
(tests/test_prepare.py): one that fails, one that writes a shard slowly and
says how it ended, one that grows its memory until its worker is killed.
A task is `(kind, folder, name)`."""

import os
import time


def run(task, progress):
    kind, folder, name = task
    if kind == "fail":
        time.sleep(1.0)
        raise ValueError(f"{name}: broken input")
    if kind == "hog":
        held = []
        while True:  # until the nanny kills this worker
            held.append(bytearray(16 << 20))
            time.sleep(0.02)
    from input_pipelines import shard_writer

    def records():
        for i in range(400):
            time.sleep(0.05)  # 20 s in all, unless stopped
            yield b"record %d" % i
    ended = "raised"
    try:
        shard_writer.write_shard(os.path.join(folder, name), records(),
                                 progress, every=1)
        ended = "finished"
    finally:
        with open(os.path.join(folder, f"{name}.ended"), "w") as f:
            f.write(ended)
    return name
