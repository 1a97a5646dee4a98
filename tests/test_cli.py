"""The entry points' edge: a finished job leaves at once, nothing lost."""

import sys
import textwrap

from tests.conftest import run_command

# A worker whose Python exit would wait a minute (a non-daemon thread stuck,
# as a slow tf.data iterator deletion is), with output still buffered.
SCRIPT = textwrap.dedent("""
    import threading, time, sys
    from absl import logging
    import cli
    threading.Thread(target=time.sleep, args=(60,), daemon=False).start()
    logging.set_verbosity(logging.INFO)
    logging.info("the last log line")
    sys.stdout.write("no newline, no flush")
    with open(sys.argv[1], "w") as f:
        f.write("written")
    def job(config):
        if config == "preempt":
            from tfscale.preemption import Preempted
            raise Preempted(7, "ckpt-7")
        if config == "error":
            from tfscale.jobs import JobError
            raise JobError("input_file", "no files match")
    cli.run_job("prog", job, sys.argv[2])
""")


def test_a_finished_job_leaves_at_once_with_everything_flushed(tmp_path):
    for config, code, text in (("ok", 0, "no newline, no flush"),
                               ("preempt", 143, "prog: preempted: checkpoint "
                                "at step 7 saved to ckpt-7"),
                               ("error", 1, "prog: error: --input_file: no "
                                "files match")):
        target = tmp_path / f"{config}.txt"
        got, output = run_command(
            [sys.executable, "-c", SCRIPT, str(target), config], timeout=30)
        assert got == code, output
        assert "the last log line" in output and text in output, output
        assert target.read_text() == "written"
