#!/bin/sh
# The image's entrypoint, under tini: what a user must fix is said in one line before DVC starts.
set -e
for path in /work /work/.dvc /work/.dvc/tmp /work/dvc.lock; do
  if [ -e "$path" ] && [ ! -w "$path" ]; then
    echo "error: $path is not writable by uid $(id -u) in the container;" \
      "run docker as the checkout's owner, with -u \"\$(id -u):\$(id -g)\"" >&2
    exit 77
  fi
done
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "note: no GPU in this container (no nvidia-smi): the CPU scale runs; on a GPU host add --gpus all" >&2
elif [ -f gradaccum/machine.py ]; then
  python -m gradaccum.machine || true  # a GPU torch cannot use (an old driver): the line that says why and the fix
fi
exec "$@"
