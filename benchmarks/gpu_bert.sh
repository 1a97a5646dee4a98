#!/usr/bin/env bash
# BERT-base on one GPU: examples/s and the step split for each precision,
# with and without XLA, then a profile of the bf16 step summed by kernel.
#
#   bash benchmarks/gpu_bert.sh OUT_DIR
#
# Environment (defaults): STEPS=300 steps per run, LOOP=50
# (--iterations_per_loop), BATCH=256, BERT_CONFIG=benchmarks/bert_base.json,
# VARIANTS="float32:noxla float32:xla mixed_bfloat16:noxla mixed_bfloat16:xla
# mixed_float16:noxla mixed_float16:xla", PROFILE=1, PYTHON=python.
# Records: the demo corpus (Python's own help text) written by
# create_pretraining_data at sequence 128 with 20 predictions. Each run's log
# and a table (table.md) land in OUT_DIR; the last interval's line of each
# run is the figure (the first intervals include tracing and compilation).
set -euo pipefail
OUT=${1:?usage: bash benchmarks/gpu_bert.sh OUT_DIR}
STEPS=${STEPS:-300}; LOOP=${LOOP:-50}; BATCH=${BATCH:-256}
CONFIG=${BERT_CONFIG:-benchmarks/bert_base.json}; PY=${PYTHON:-python}
VARIANTS=${VARIANTS:-"float32:noxla float32:xla mixed_bfloat16:noxla mixed_bfloat16:xla mixed_float16:noxla mixed_float16:xla"}
mkdir -p "$OUT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
nvidia-smi -L > "$OUT/gpu.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/gpu.txt"
$PY -m input_pipelines.make_demo_corpus --output_dir="$WORK/corpus" > /dev/null
$PY -m input_pipelines.create_pretraining_data \
  --input_file="$WORK/corpus/corpus.txt" --vocab_file="$WORK/corpus/vocab.txt" \
  --output_file="$WORK/records/train.tfrecord" --num_output_shards=4 \
  --max_seq_length=128 --max_predictions_per_seq=20 --dupe_factor=5 \
  --noprogress > /dev/null

run() {  # run NAME PRECISION XLA [extra flags]
  local name=$1 precision=$2 xla=$3; shift 3
  local start=$SECONDS
  $PY run_pretraining.py --input_file="$WORK/records/train-*.tfrecord" \
    --output_dir="$WORK/$name" --bert_config_file="$CONFIG" \
    --max_seq_length=128 --max_predictions_per_seq=20 \
    --train_batch_size="$BATCH" --optimizer=lamb --learning_rate=1e-4 \
    --num_train_steps="$STEPS" --num_warmup_steps=10 \
    --precision="$precision" --"$xla" --iterations_per_loop="$LOOP" \
    --save_checkpoints_steps=1000000 "$@" > "$OUT/$name.log" 2>&1 || true
  echo "$name: $((SECONDS - start)) s" >> "$OUT/wall.txt"
}

for variant in $VARIANTS; do
  run "${variant%%:*}-${variant##*:}" "${variant%%:*}" "${variant##*:}"
done

"$PY" - "$OUT" $VARIANTS <<'PYEOF' | tee "$OUT/table.md"
import re, sys
out, variants = sys.argv[1], sys.argv[2:]
line = re.compile(r"step (\d+): loss ([\d.]+), ([\d.]+) examples/s, step ([\d.]+) "
                  r"ms; timed steps ([\d.]+) ms \(input ([\d.]+), compute "
                  r"([\d.]+), sync ([\d.]+), update ([\d.]+)\)")
print("| precision | XLA | examples/s | step ms | timed step: compute / sync / update ms | update share |")
print("|---|---|---:|---:|---|---:|")
for v in variants:
    name = v.replace(":", "-")
    text = open(f"{out}/{name}.log", errors="replace").read()
    found = line.findall(text)
    if not found:
        error = [l for l in text.splitlines() if "error" in l.lower()][-1:]
        print(f"| {v.split(':')[0]} | {v.split(':')[1]} | failed: {error} | | | |")
        continue
    s = found[-1]
    timed = float(s[4])
    print(f"| {v.split(':')[0]} | {v.split(':')[1]} | {float(s[2]):.1f} | {float(s[3]):.1f} | "
          f"{s[6]} / {s[7]} / {s[8]} | {100 * float(s[8]) / max(timed, 1e-9):.1f}% |")
PYEOF

if [ "${PROFILE:-1}" = 1 ]; then
  # Six steps of the compiled bf16 step in one call, profiled: per log
  # interval of 10 steps, a call of steps 1-6, then 4 timed steps one by one.
  run profile mixed_bfloat16 xla --iterations_per_loop=10 --num_train_steps=30 \
    --profile_steps=11,16
  $PY -m benchmarks.xplane_top "$WORK/profile" 30 > "$OUT/profile.txt" 2>&1 || true
  head -40 "$OUT/profile.txt"
fi
