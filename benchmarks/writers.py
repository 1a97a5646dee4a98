r"""Record writers' throughput: images/s of build_image_records and
documents/s of create_pretraining_data, with 1 writer process and with one
per core, on data made on this machine.

    python -m benchmarks.writers --images_per_class 100 --classes 10 \
        --corpus_copies 30 --output_dir runs/writers

Each tool runs as a user runs it (its command line, a fresh process), and
the rate is the one it prints on its last line (after its own start-up:
reading the folder or corpus, the vocabulary), so the process counts are
compared on the same work in the same sitting.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(command) -> str:
    proc = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{command[2]}: exit {proc.returncode}\n"
                           f"{proc.stdout[-3000:]}")
    return proc.stdout


def images(args, processes: int) -> float:
    out = os.path.join(args.output_dir, f"records-{processes}")
    shutil.rmtree(out, ignore_errors=True)
    text = _run([sys.executable, "-m", "input_pipelines.build_image_records",
                 f"--image_dir={args.output_dir}/images",
                 f"--output_dir={out}", f"--num_shards={args.shards}",
                 f"--num_processes={processes}", "--noprogress"])
    return float(re.search(r"\(([\d.]+) images/s\)", text).group(1))


def documents(args, processes: int) -> float:
    out = os.path.join(args.output_dir, f"bert-{processes}")
    shutil.rmtree(out, ignore_errors=True)
    text = _run([sys.executable, "-m",
                 "input_pipelines.create_pretraining_data",
                 f"--input_file={args.output_dir}/corpus/big.txt",
                 f"--vocab_file={args.output_dir}/corpus/vocab.txt",
                 f"--output_file={out}/train.tfrecord",
                 f"--num_output_shards={args.shards}", "--max_seq_length=128",
                 "--max_predictions_per_seq=20", "--dupe_factor=2",
                 f"--num_processes={processes}", "--noprogress"])
    return float(re.search(r"\(([\d.]+) documents/s", text).group(1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--images_per_class", type=int, default=100)
    parser.add_argument("--corpus_copies", type=int, default=30,
                        help="the demo corpus repeated this many times")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output_dir", default="runs/writers")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    from input_pipelines import pattern_images
    if not os.path.isdir(os.path.join(args.output_dir, "images")):
        pattern_images.write_image_folder(
            os.path.join(args.output_dir, "images"), args.classes,
            args.images_per_class, seed=0)
    corpus = os.path.join(args.output_dir, "corpus")
    if not os.path.exists(os.path.join(corpus, "big.txt")):
        _run([sys.executable, "-m", "input_pipelines.make_demo_corpus",
              f"--output_dir={corpus}"])
        with open(os.path.join(corpus, "corpus.txt")) as f:
            text = f.read().strip("\n") + "\n\n"
        with open(os.path.join(corpus, "big.txt"), "w") as f:
            f.write(text * args.corpus_copies)
    cores = os.cpu_count() or 1
    rows = []
    for repeat in range(args.repeats):
        for processes in (1, cores):
            rows.append(("build_image_records", processes,
                         images(args, processes), "images/s"))
            rows.append(("create_pretraining_data", processes,
                         documents(args, processes), "documents/s"))
            print(rows[-2], rows[-1], flush=True)
    lines = [f"{args.classes * args.images_per_class} patterned JPEGs "
             f"(300-500 px) into {args.shards} shards; the demo corpus x"
             f"{args.corpus_copies} into {args.shards} shards (seq 128, "
             f"dupe_factor 2); {cores} cores, {args.repeats} repeats:", "",
             "| tool | processes | rate | unit |", "|---|---:|---:|---|"]
    lines += [f"| {tool} | {p} | {rate:.1f} | {unit} |"
              for tool, p, rate, unit in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.output_dir, "report.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
