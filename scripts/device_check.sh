#!/usr/bin/env bash
# The first GPU run in one call, on a lent machine without DVC, pydantic or network (docs/device.md): the
# study-scale memory of every variant beside the trace's prediction, the trace under the device's own CUDA
# autocast, and, in the time left, the baseline and accumulation trained. Four parts, in this order; each writes
# its results under OUT as soon as they exist (at most 8 files), a failed part is one line in OUT/status.json and
# the next part still runs, and the whole stays under DEVICE_BUDGET_S (450 s) of wall time.
#
#   python -m gradaccum.device bundle              # here, once: device-bundle/ (wheels, data, the prediction)
#   scripts/device_check.sh OUT [-S KEY=VALUE ...]   # there; OUT defaults to $OUT
#
# -S changes params for this run only (the checkout's params.yaml is not touched); the twin in
# tests/test_device_check.py runs this script on the CPU at a tiny scale in a device-shaped environment.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-}
if [ $# -gt 0 ] && [ "$1" != "-S" ]; then out=$1; shift; fi
[ -n "$out" ] || { echo "usage: scripts/device_check.sh OUT [-S KEY=VALUE ...] (or set OUT)" >&2; exit 2; }
sets=()
while [ $# -gt 0 ]; do
  [ "$1" = "-S" ] && [ $# -ge 2 ] || { echo "usage: scripts/device_check.sh OUT [-S KEY=VALUE ...]" >&2; exit 2; }
  sets+=(--set "$2"); shift 2
done
bundle=$(realpath "${DEVICE_BUNDLE:-$repo/device-bundle}")
[ -f "$bundle/manifest.json" ] || { echo "error: $bundle has no manifest.json: run python -m gradaccum.device bundle" >&2; exit 2; }
mkdir -p "$out" && out=$(realpath "$out")
python=${PYTHON:-python3}
export PYTHONPATH="$bundle/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
budget=${DEVICE_BUDGET_S:-450}
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
exec > >(tee -a "$out/log.txt") 2>&1
tee_pid=$!

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$repo/gradaccum" "$repo/stages" "$repo/params.yaml" "$repo/requirements.lock" "$work/"
cd "$work" || exit 1

# part NAME LIMIT_S FUNCTION: runs it within LIMIT_S (and the time left), records ok or its one line.
part() {
  local name=$1 limit=$2 fn=$3 t0 rc
  (( limit > $(left) )) && limit=$(left)
  echo "== $name: up to ${limit} s (at $(( $(date +%s) - start )) s)"
  t0=$(date +%s)
  if (( limit < 5 )); then
    echo "not run: $(left) s left of $budget" | tee "$work/$name.log"; rc=3
  else
    timeout --kill-after=5 "$limit" bash -c "$fn" 2>&1 | tee "$work/$name.log"; rc=${PIPESTATUS[0]}
  fi
  "$python" -m gradaccum.device status "$out" "$name" "$rc" "$(( $(date +%s) - t0 ))" "$work/$name.log"
}

# 1. Preflight (at most 30 s): versions, nvidia-smi -L, imports, one float16 step with GradScaler, its memory snapshot.
preflight_part() { "$python" -m gradaccum.device preflight "$out"; }

# 2. The memory check: every variant at the study scale, one epoch each (two optimizer steps of 32768), in its own
# process as the train stage runs it, each packed into OUT as it ends; then measured against the carried prediction.
memory_part() {
  # shellcheck disable=SC2086 # SETS: --set KEY=VALUE pairs, split on purpose
  "$python" -m gradaccum.params params.yaml --set scales.study.epochs=1 --set "data.source=$bundle/data" \
    --set data.dataset=fashion_mnist --set data.fallback=false $SETS || return
  "$python" -m stages.hardware && "$python" -m stages.download || return
  mkdir -p reports && cp "$bundle/predicted.json" reports/trace.json && cp data/hardware.json reports/ || return
  local v failed=0
  for v in $("$python" -c "import yaml; print(*yaml.safe_load(open('params.yaml'))['variants'])"); do
    "$python" -m stages.train "$v" || { echo "train@$v failed"; failed=1; }
    [ ! -f "reports/variants/$v/metrics.json" ] || "$python" -m gradaccum.device pack "$out" memory "$v"
  done
  { echo "Data: Fashion-MNIST standing in for MNIST (same shapes: memory depends on them alone)."
    "$python" -m gradaccum.report.traced reports; } | tee "$out/predicted_vs_measured.txt"
  return $failed
}

# 3. The trace on the device: the CPU emulation (under this torch) beside CUDA's own autocast on fake CUDA tensors,
# and the measured figures held against the latter too.
trace_part() {
  "$python" -m gradaccum.device trace "$out" || return
  mkdir -p native && "$python" -m gradaccum.device native-trace-json "$out" native/trace.json || return
  cp -r reports/variants reports/hardware.json native/ || return
  echo "== against the trace under CUDA's own autocast (fake CUDA tensors, this GPU's torch):" |
    tee -a "$out/predicted_vs_measured.txt"
  "$python" -m gradaccum.report.traced native | tee -a "$out/predicted_vs_measured.txt"
}

# 4. With the time left: the baseline and accumulation over as many of the study's 10 epochs as fit.
training_part() {
  local epochs v
  epochs=$("$python" -m gradaccum.device epochs "$out" "$(( $(left) - 15 ))") || return
  (( epochs > 0 )) || { echo "not run: part 2 timed no baseline and accumulation, or no epoch fits in $(left) s"; return 3; }
  "$python" -m gradaccum.params params.yaml --set "scales.study.epochs=$epochs" || return
  rm -rf reports/variants
  for v in baseline accumulation; do
    "$python" -m stages.train "$v" && "$python" -m gradaccum.device pack "$out" training "$v" || return
  done
}

export -f left preflight_part memory_part trace_part training_part
export python bundle out start budget SETS="${sets[*]}" DEVICE_BUNDLE="$bundle"
echo "== device check: $(date -u +%FT%TZ), bundle: $(tr -d '\n ' < "$bundle/manifest.json" | head -c 400)"
part preflight 30 preflight_part
part memory 300 memory_part
part trace 120 trace_part
part training 600 training_part
echo "== done in $(( $(date +%s) - start )) s: $(ls "$out" | tr '\n' ' ')"
exec >&- 2>&-
wait "$tee_pid"  # log.txt whole before the call ends
