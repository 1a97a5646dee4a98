"""The entry points' edge: a finished job leaves at once, nothing lost."""

import sys
import textwrap

from tests.conftest import run_command

# A worker whose Python exit would wait a minute (a non-daemon thread stuck,
# as a slow tf.data iterator deletion is), with output still buffered.
SCRIPT = textwrap.dedent("""
    import logging as py_logging, logging.handlers, threading, time, sys
    from absl import logging
    from tfscale import cli as cli
    threading.Thread(target=time.sleep, args=(60,), daemon=False).start()
    logging.set_verbosity(logging.INFO)
    logging.info("the last log line")
    sys.stdout.write("no newline, no flush")
    # A log file whose records reach the disk only when logging shuts down
    # (a MemoryHandler holds them): os._exit alone would lose them.
    held = py_logging.handlers.MemoryHandler(
        100, flushLevel=py_logging.CRITICAL,
        target=py_logging.FileHandler(sys.argv[1]))
    run_log = py_logging.getLogger("run")
    run_log.addHandler(held)
    def job(config):
        run_log.warning("written by the job")
        if config == "preempt":
            from tfscale.resume.preemption import Preempted
            raise Preempted(7, "ckpt-7")
        if config == "error":
            from tfscale.jobs import JobError
            raise JobError("input_file", "no files match")
        if config == "crash":
            raise RuntimeError("boom\\nsecond line")
        if config == "interrupt":
            raise KeyboardInterrupt
    cli.run_job("prog", job, sys.argv[2])
""")


def test_a_finished_job_leaves_at_once_with_everything_flushed(tmp_path):
    for config, code, text in (("ok", 0, "no newline, no flush"),
                               ("preempt", 143, "prog: preempted: checkpoint "
                                "at step 7 saved to ckpt-7"),
                               ("error", 2, "prog: error: --input_file: no "
                                "files match"),
                               ("crash", 1, "Traceback (most recent call "
                                "last)"),
                               ("interrupt", 130, "prog: interrupted "
                                "(Ctrl-C)")):
        target = tmp_path / f"{config}.txt"
        got, output = run_command(
            [sys.executable, "-c", SCRIPT, str(target), config], timeout=30)
        assert got == code, output
        assert "the last log line" in output and text in output, output
        assert target.read_text() == "written by the job\n"
        if config == "crash":
            assert output.rstrip().endswith("prog: error: RuntimeError: boom")


def test_an_uncaught_setting_error_exits_with_the_launchers_code():
    """tfscale.errors sits below the cluster package: its exit code for an
    uncaught ConfigError is the contract's, written twice, kept equal."""
    from tfscale import errors
    from tfscale.cluster import contract
    assert errors.CONFIG_ERROR_EXIT_CODE == contract.CONFIG_ERROR_EXIT_CODE
