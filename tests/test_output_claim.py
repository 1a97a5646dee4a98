"""One writer per output: the claim (input_pipelines/output_claim.py) on
the writers' real entry points, with real processes holding it and dying."""

import os
import shutil
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


# Another user's side of a folder: the other user's files are owned by
# `nobody`; this user is root without the powers that pass permission
# checks (`setpriv`), so the kernel checks it as it checks any user.
OTHER_USER = 65534
SETPRIV = shutil.which("setpriv")
as_another_user = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None,
    reason="needs root and util-linux's setpriv to check as another user")

CLAIM_AND_INDEX = (
    "import os, sys\n"
    "from input_pipelines import output_claim\n"
    "from input_pipelines.record_order import index\n"
    "try:\n"
    "    with output_claim.claim(sys.argv[1], 'train', 'writer B') as held:\n"
    "        held.note_plan('b' * 64)\n"
    "        if len(sys.argv) > 2:\n"
    "            index.write(sys.argv[2])\n"
    "except output_claim.ClaimError as e:\n"
    "    sys.exit(f'writer B: error: {e}')\n"
    "print('claimed', flush=True)\n")


def run_as_another_user(*args):
    return subprocess.run(
        [SETPRIV, "--bounding-set", "-dac_override,-dac_read_search,-fowner",
         "--", sys.executable, "-c", CLAIM_AND_INDEX, *args], cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, timeout=120)


def give_away(*paths):
    for path in paths:
        os.chown(path, OTHER_USER, -1)


@as_another_user
def test_a_folder_the_writer_cannot_write_is_one_line(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir(mode=0o755)
    give_away(folder)
    proc = run_as_another_user(str(folder))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"writer B: error: {folder}: this user cannot write there "
        "(Permission denied): write the output to a folder you can write"]


@as_another_user
def test_a_shared_folder_is_not_locked_by_another_users_past_run(tmp_path):
    """One user writes an output into a folder all may write; afterwards
    another claims the same output and indexes a file there. (The first
    user's claim file locked every other user out for good, then its
    index folder did.)"""
    import tensorflow as tf
    from input_pipelines.record_order import index
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    names = [str(folder / f"train-0000{i}-of-00002") for i in range(2)]
    for name in names:
        with tf.io.TFRecordWriter(name) as writer:
            writer.write(b"record")
    with output_claim.claim(str(folder), "train", "writer A"):
        index.write(names[0])
    give_away(*names, output_claim.lock_path(str(folder), "train"),
              os.path.dirname(index.index_path(names[0])))
    proc = run_as_another_user(str(folder), names[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "claimed"
    assert os.path.exists(index.index_path(names[1]))


@as_another_user
def test_a_rerun_in_a_shared_folder_never_removes_another_users_shards(
        corpus, tmp_path):  # noqa: F811
    """One user writes BERT records into a folder all may write; another
    reruns the writer there with another seed. It must refuse in one line
    before it removes anything (it removed the first user's 4 complete
    shards, then died on their manifest with a traceback)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    code, output = run_command(bert_writer(corpus, folder,
                                           "--num_output_shards=4"),
                               timeout=300)
    assert code == 0, output
    shards = sorted(folder.glob("train-*"))
    before = {p.name: p.read_bytes() for p in shards}
    assert len(before) == 4
    give_away(*folder.rglob("*"))  # every file and folder the run left
    proc = subprocess.run(
        [SETPRIV, "--bounding-set", "-dac_override,-dac_read_search,-fowner",
         "--", *bert_writer(corpus, folder, "--num_output_shards=4",
                            "--random_seed=2")],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith(
        f"create_pretraining_data: error: {shards[0]}: an earlier run with "
        "other settings wrote it, and it belongs to nobody"), last
    assert {p.name: p.read_bytes()
            for p in sorted(folder.glob("train-*"))} == before


def test_the_manifest_is_replaced_whole_never_rewritten_in_place(tmp_path):
    names = [str(tmp_path / "s-0")]
    manifest = tmp_path / ".s.manifest.json"
    shard_writer.Plan(str(manifest), names, "1" * 64).keep(lambda _: None)
    first = os.stat(manifest).st_ino
    os.chmod(manifest, 0o444)  # another user's, or read-only: no matter
    shard_writer.Plan(str(manifest), names, "2" * 64).keep(lambda _: None)
    assert os.stat(manifest).st_ino != first  # a new file renamed over it
    assert '"digest": "' + "2" * 64 in manifest.read_text()
    assert [p for p in os.listdir(tmp_path) if p.endswith(".partial")] == []


@as_another_user
def test_a_claim_held_read_only_does_not_name_a_dead_writer(tmp_path):
    """A shared folder whose claim file belongs to another user, naming
    that user's past writer (killed, so it never released it). Writer B
    takes the claim read-only (it cannot write its own name there); a third
    writer is refused, and must not call the dead one the holder."""
    import json
    import socket
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           stdout=subprocess.PIPE, text=True).stdout.strip()
    lock = output_claim.lock_path(str(folder), "train")
    with open(lock, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": int(ended),
                   "started": 0, "tool": "writer A"}, f)
    os.chmod(lock, 0o644)
    give_away(lock)
    holder = subprocess.Popen(
        [SETPRIV, "--bounding-set", "-dac_override,-dac_read_search,-fowner",
         "--", sys.executable, "-c", HOLD.replace("writer A", "writer B"),
         str(folder)], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(output_claim.ClaimError) as refused:
            with output_claim.claim(str(folder), "train", "writer C",
                                    lambda line: None):
                pass
    finally:
        holder.kill()
        holder.wait()
    message = str(refused.value)
    assert "another writer is writing this output now: a writer that " \
           f"cannot sign the claim file (it names writer A pid {ended} " in \
           message, message
