r"""Peak memory of the BERT writer against the size of its input.

    python -m benchmarks.pipelines.writer_memory --megabytes 9 90 --piece_mb 16

Makes one large input file of about each size from the demo corpus (Python's
help topics, each copy's documents marked with the copy's number so that
none repeats), runs `create_pretraining_data` on it in a child process with
`--num_processes=1` (both stages run in that process, so its peak RSS is a
worker's plus the client's) and prints the child's peak RSS (`wait4`'s
ru_maxrss), the time and the shards' size. A writer whose memory is bounded
by `--piece_mb` shows about the same peak for 1x and 10x the input.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import REPO

sys.path.insert(0, REPO)


def write_corpus(path: str, megabytes: float) -> int:
    from input_pipelines import demo_corpus
    documents = demo_corpus.corpus_documents()
    size, copy = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * (1 << 20):
            for document in documents:
                text = "\n".join([f"Copy {copy}."] + document) + "\n\n"
                f.write(text)
                size += len(text.encode("utf-8"))
            copy += 1
    return size


def run_writer(corpus: str, vocab: str, out: str, args) -> dict:
    command = [sys.executable, "-m", "input_pipelines.create_pretraining_data",
               f"--input_file={corpus}", f"--vocab_file={vocab}",
               f"--output_file={out}/train.tfrecord",
               f"--num_output_shards={args.shards}", "--max_seq_length=128",
               "--max_predictions_per_seq=20",
               f"--dupe_factor={args.dupe_factor}", "--num_processes=1",
               "--noprogress"]
    if args.piece_mb:
        command.append(f"--piece_mb={args.piece_mb}")
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=REPO, env=dict(
        os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = process.stdout.read().decode()
    _, status, usage = os.wait4(process.pid, 0)
    if status:
        raise SystemExit(f"writer failed:\n{output[-3000:]}")
    shards = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)
                 if n.startswith("train-"))
    return {"seconds": time.monotonic() - start,
            "peak_rss_mb": usage.ru_maxrss / 1024, "shards_mb": shards / 2**20}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, nargs="+", default=[9, 90],
                        help="corpus sizes in MB")
    parser.add_argument("--shards", type=int, default=4,
                        help="output shards")
    parser.add_argument("--dupe_factor", type=int, default=1,
                        help="times each document is masked anew")
    parser.add_argument("--piece_mb", type=int, default=0,
                        help="0: the writer's default")
    parser.add_argument("--workdir", default=None,
                        help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="writer-memory-")
    vocab = os.path.join(work, "vocab.txt")
    if not os.path.exists(vocab):
        from input_pipelines import bert_instances as bi
        from input_pipelines import demo_corpus
        lines = [s for d in demo_corpus.corpus_documents() for s in d]
        with open(vocab, "w", encoding="utf-8") as f:
            f.write("\n".join(bi.build_vocab(lines, 4000)) + "\n")
    print(f"{'input MB':>9} {'peak RSS MB':>12} {'seconds':>8} "
          f"{'shards MB':>10}")
    for megabytes in args.megabytes:
        corpus = os.path.join(work, f"corpus-{megabytes:g}.txt")
        size = write_corpus(corpus, megabytes)
        out = os.path.join(work, f"out-{megabytes:g}")
        result = run_writer(corpus, vocab, out, args)
        print(f"{size / 2**20:9.1f} {result['peak_rss_mb']:12.0f} "
              f"{result['seconds']:8.1f} {result['shards_mb']:10.1f}",
              flush=True)


if __name__ == "__main__":
    main()
