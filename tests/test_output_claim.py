"""One writer per output: the claim (input_pipelines/output_claim.py) on
the writers' real entry points, with real processes holding it and dying."""

import os
import signal
import subprocess
import sys
import time

import pytest

from input_pipelines import output_claim, shard_writer
from tests.conftest import REPO, run_command
from tests.test_prepare import bert_writer

HOLD = ("import sys, time\n"
        "from input_pipelines import output_claim\n"
        "with output_claim.claim(sys.argv[1], 'train', 'writer A') as held:\n"
        "    held.note_plan('a' * 64)\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n")


def test_a_second_claim_is_refused_and_a_released_one_is_free(tmp_path):
    said = []
    with output_claim.claim(str(tmp_path), "train", "A", said.append) as a:
        a.note_plan("f" * 64)
        with pytest.raises(output_claim.ClaimError) as refused:
            with output_claim.claim(str(tmp_path), "train", "B", said.append):
                pass
        # Another output in the same folder is another claim.
        with output_claim.claim(str(tmp_path), "validation", "C",
                                said.append):
            pass
    message = str(refused.value)
    assert "\n" not in message
    assert f"A pid {os.getpid()} on " in message
    assert "plan ffffffffffffffff" in message
    with output_claim.claim(str(tmp_path), "train", "D", said.append):
        pass
    assert said == []  # released claims: nothing to take over


def test_a_writer_refuses_a_live_holder_and_takes_over_a_dead_one(
        corpus, tmp_path):  # noqa: F811
    # A requeued job beside a manual rerun: the second writer must refuse
    # at once naming the first (before, both ran and the folder mixed their
    # plans); once the first is killed (-9), the next run takes the claim
    # over, says whose it was, and writes. (Mutation tried: main without
    # the claim: the second writer ran and exited 0.)
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        code, output = run_command(bert_writer(corpus, out), timeout=120)
        assert code != 0, output
        line = f"{out}/train*: another writer is writing this output now: " \
               f"writer A pid {holder.pid} on "
        assert line in output, output
        assert "plan aaaaaaaaaaaaaaaa" in output
        assert time.monotonic() - start < 60  # at once, not after a wait
        assert not any(n.startswith("train-") for n in os.listdir(out))
        assert not os.path.exists(out / ".train.manifest.json")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    code, output = run_command(bert_writer(corpus, out), timeout=300)
    assert code == 0, output
    assert f"took over the claim on {out}/train* from writer A pid " \
           f"{holder.pid}" in output, output
    assert len([n for n in os.listdir(out) if n.startswith("train-")]) == 1


def test_a_plan_change_names_the_shards_it_removes(tmp_path):
    said = []
    names = [str(tmp_path / f"s-{i}") for i in range(4)]
    first = shard_writer.Plan(str(tmp_path / ".s.manifest.json"), names, "1" * 64)
    assert first.keep(said.append) == set()
    for name in names[:3]:
        shard_writer.write_shard(name, [b"x"], lambda n: None)
    assert first.keep(said.append) == {0, 1, 2} and said == []
    second = shard_writer.Plan(first.manifest, names, "2" * 64)
    assert second.keep(said.append) == set()
    assert said == ["removing 3 shard(s) (3 complete) of an earlier run with "
                    "other settings (plan 1111111111111111; this run's plan "
                    "2222222222222222): s-0, s-1, s-2"]
    assert not any(os.path.exists(n) for n in names)
