#!/usr/bin/env bash
# The full study on one CUDA GPU without DVC: the stage commands in order, from a local data folder,
# no network. Everything it measured lands in OUT: metrics, nvidia-smi snapshots, PyTorch memory snapshots
# of the first optimizer step of the baseline and the accumulation variant (GPU only), the interleaved
# speeds, the traced peaks (held in the report against this GPU's allocated, reserved and nvidia-smi
# peaks), the report; last it prints each variant's predicted allocated, reserved and nvidia-smi figures
# beside the measured ones, with their ratios (OUT/reports/predicted_vs_measured.txt).
#
#   scripts/gpu_check.sh OUT [DATA_DIR] [-S KEY=VALUE ...]
#   scripts/gpu_check.sh /tmp/h100 /usr/share/datasets/fashion-mnist -S data.dataset=fashion_mnist
#
# DATA_DIR holds the four IDX .gz files (data.source); without it the data stage uses the mirrors or
# the fallback sample. -S changes params for this run only (the checkout's params.yaml is not touched).
set -euo pipefail
usage="usage: scripts/gpu_check.sh OUT [DATA_DIR] [-S KEY=VALUE ...]"
out=${1:?$usage}; shift
data=""
if [ $# -gt 0 ] && [ "$1" != "-S" ]; then data=$(realpath "$1"); shift; fi
sets=()
while [ $# -gt 0 ]; do
  [ "$1" = "-S" ] && [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
  sets+=(--set "$2"); shift 2
done
[ -z "$data" ] || [ -d "$data" ] || { echo "error: DATA_DIR $data is not a folder" >&2; exit 2; }

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
mkdir -p "$out"
out=$(realpath "$out")
if [ "$out" = "$repo" ]; then  # the end replaces OUT/reports: here, the checkout's own (its reference runs too)
  echo "error: OUT is this checkout; its reports/ would be replaced. Pick another folder, e.g. /tmp/gpu-check" >&2
  exit 2
fi
work="$out/work"
rm -rf "$work" && mkdir -p "$work"
cp -r "$repo/gradaccum" "$repo/stages" "$repo/params.yaml" "$work/"
cd "$work"
[ -z "$data" ] || sets+=(--set "data.source=$data")
"$python" -m gradaccum.params params.yaml "${sets[@]}"   # validated before any long work

start=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - start )) s)"; "$python" -m "$@"; }
step stages.hardware
step stages.download
step stages.sweep
step stages.gradcheck
step stages.speed
step stages.trace   # the traced peaks, for the report's trace against this GPU's allocated peaks
for variant in $("$python" -c "import yaml; print(' '.join(yaml.safe_load(open('params.yaml'))['variants']))"); do
  snapshot=()  # on a GPU: PyTorch's memory history up to the first optimizer step, for pytorch.org/memory_viz
  case "$variant" in
    baseline|accumulation) snapshot=(--memory-snapshot "reports/variants/$variant/memory_snapshot.pickle") ;;
  esac
  step stages.train "$variant" "${snapshot[@]}"
done
step stages.report
rm -rf "$out/reports" && cp -r reports "$out/reports"
cp data/hardware.json data/provenance.json params.yaml "$out/reports/"
echo "== predicted (trace, allocator model, assumed context) against measured, per variant:"
"$python" -m gradaccum.report.traced "$out/reports" | tee "$out/reports/predicted_vs_measured.txt"
echo "== done in $(( $(date +%s) - start )) s: $out/reports/report.html"
