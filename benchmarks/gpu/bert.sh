#!/usr/bin/env bash
# BERT-base on one GPU: examples/s and the step split per variant, a profile
# of the first variant summed by kernel, and the attention heads' moves.
#
#   bash benchmarks/gpu/bert.sh OUT_DIR
#
# Environment (defaults): STEPS=300 steps per run, LOOP=100
# (--iterations_per_loop, the job's default), BATCH=256,
# BERT_CONFIG=benchmarks/gpu/bert_base.json,
# VARIANTS="mixed_bfloat16:auto mixed_bfloat16:noxla" (precision:xla, xla
# one of auto = the default flags, xla, noxla), PROFILE=1 (profile the first
# variant's last interval: steps STEPS-LOOP+1 .. STEPS-LOOP+6 start one call),
# RUN_TIMEOUT=300 seconds per run, PYTHON=python, HEADS=1 (time the
# attention heads' moves), RUN_FLAGS="" (more flags for every run, e.g.
# --timed_steps_per_log=0; XLA_FLAGS passes through to XLA).
# Records: RECORDS=8192 generated Google-format records (sequence 128, 20
# predictions, 4 files; benchmarks/pipelines/input_pipeline.py's writer: TensorFlow
# alone, as on a GPU host with nothing else installed), written once into
# RECORDS_DIR when it is set (a second run reuses them). Each run's log,
# the table (table.md: the interval ending at step STEPS-LOOP, before the
# profiled one; the first interval holds tracing and compilation) and the
# profile's summary land in OUT_DIR.
set -euo pipefail
case "${1:-}" in
  -h|--help|"")
    # The header above is the help: its comment lines, without the '#'.
    sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"
    [ -n "${1:-}" ] && exit 0 || exit 2 ;;
  -*) echo "gpu_bert.sh: error: unknown option $1 (OUT_DIR is the one argument; settings are environment variables: --help)" >&2
    exit 2 ;;
esac
OUT=$1
STEPS=${STEPS:-300}; LOOP=${LOOP:-100}; BATCH=${BATCH:-256}
CONFIG=${BERT_CONFIG:-benchmarks/gpu/bert_base.json}; PY=${PYTHON:-python}
VARIANTS=${VARIANTS:-"mixed_bfloat16:auto mixed_bfloat16:noxla"}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
mkdir -p "$OUT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
nvidia-smi -L > "$OUT/gpu.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/gpu.txt"
start=$SECONDS
RECORDS_DIR=${RECORDS_DIR:-$WORK/records}
if ! ls "$RECORDS_DIR"/bert-*.tfrecord > /dev/null 2>&1; then
  mkdir -p "$RECORDS_DIR"
  $PY -c "from benchmarks.pipelines.input_pipeline import write_records as w; \
w('$RECORDS_DIR', ${RECORDS:-8192}, 4)" > /dev/null 2>&1
fi
echo "records: $((SECONDS - start)) s" >> "$OUT/wall.txt"

run() {  # run NAME PRECISION XLA [extra flags]
  local name=$1 precision=$2 xla=$3; shift 3
  local xla_flag=()
  [ "$xla" = auto ] || xla_flag=(--"$xla")
  local start=$SECONDS
  timeout "$RUN_TIMEOUT" $PY run_pretraining.py \
    --input_file="$RECORDS_DIR/bert-*.tfrecord" \
    --output_dir="$WORK/$name" --bert_config_file="$CONFIG" \
    --max_seq_length=128 --max_predictions_per_seq=20 \
    --train_batch_size="$BATCH" --optimizer=lamb --learning_rate=1e-4 \
    --num_train_steps="$STEPS" --num_warmup_steps=10 \
    --precision="$precision" "${xla_flag[@]}" --iterations_per_loop="$LOOP" \
    --save_checkpoints_steps=1000000 ${RUN_FLAGS:-} "$@" \
    > "$OUT/$name.log" 2>&1 || true
  echo "$name: $((SECONDS - start)) s" >> "$OUT/wall.txt"
}

first=1
for variant in $VARIANTS; do
  extra=()
  if [ "$first" = 1 ] && [ "${PROFILE:-1}" = 1 ]; then
    p=$((STEPS - LOOP + 1)); extra=(--profile_steps="$p,$((p + 5))")
  fi
  run "${variant%%:*}-${variant##*:}" "${variant%%:*}" "${variant##*:}" \
    "${extra[@]}"
  if [ "$first" = 1 ] && [ "${PROFILE:-1}" = 1 ]; then
    $PY -m benchmarks.gpu.xplane_top "$WORK/${variant%%:*}-${variant##*:}" 30 \
      > "$OUT/profile.txt" 2>&1 || true
  fi
  first=0
done

if [ "${HEADS:-1}" = 1 ]; then
  $PY -m benchmarks.gpu.head_transpose --batch="$BATCH" > "$OUT/heads.txt" 2>&1 || true
fi

"$PY" - "$OUT" "$((STEPS - LOOP))" $VARIANTS <<'PYEOF' | tee "$OUT/table.md"
import re, sys
out, report, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
line = re.compile(r"step (\d+): loss ([\d.]+), ([\d.]+) examples/s, step ([\d.]+) "
                  r"ms(?:; timed steps ([\d.]+) ms \(input ([\d.]+), compute "
                  r"([\d.]+), sync ([\d.]+), update ([\d.]+)\))?")
print("| precision | XLA | step layout | examples/s | step ms | timed step: input / compute / sync / update ms | first interval s |")
print("|---|---|---|---:|---:|---|---:|")
for v in variants:
    name = v.replace(":", "-")
    text = open(f"{out}/{name}.log", errors="replace").read()
    found = {int(s[0]): s for s in line.findall(text)}
    layout = re.search(r"step: (.*)", text)
    layout = layout.group(1) if layout else "?"
    if report not in found:
        error = [l for l in text.splitlines() if "rror" in l][-1:]
        print(f"| {v.split(':')[0]} | {v.split(':')[1]} | {layout} | failed: {error} | | | |")
        continue
    s = found[report]
    first = min(found)
    first_s = float(found[first][3]) * first / 1000
    split = f"{s[5]} / {s[6]} / {s[7]} / {s[8]}" if s[4] else "none timed"
    print(f"| {v.split(':')[0]} | {v.split(':')[1]} | {layout} | {float(s[2]):.1f} | "
          f"{float(s[3]):.1f} | {split} | {first_s:.1f} |")
PYEOF
