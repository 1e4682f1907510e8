#!/usr/bin/env bash
# The study's image, built and run for real, as a user types the README's commands:
#   sudo bash scripts/container_check.sh        # or from .ci/run, as root
# 1. starts a Docker engine if none answers (host networking only: no bridge, no iptables, nothing on TCP);
# 2. makes a local Debian bookworm base once (mmdebstrap, trusting this host's extra CA certificates), for a
#    machine that reaches no image registry; the Dockerfile's own base (debian:bookworm-slim) is the same system;
# 3. builds the real Dockerfile on it (--build-arg BASE=...);
# 4. on a fresh clone owned by a non-root uid, runs the README's `docker run` (dvc repro at a small CPU scale),
#    a second one (nothing re-runs), `dvc exp run -S accum=8` in it, `dvc status` outside it, a SIGTERM to a
#    running container, and a checkout the container's uid cannot write; each checked, each said in one line.
# Prints the build's time and the image's size (the README quotes them). Needs root, docker.io and mmdebstrap.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
IMAGE=${IMAGE:-accum-study}
BASE_IMAGE=${BASE_IMAGE:-accum-study-base:bookworm}
RUN_UID=${RUN_UID:-1000}  # the checkout's owner in the container: not root
PY=$ROOT/.venv/bin/python  # the host's venv (make test makes it): params, YAML and dvc status outside
WORK=$(mktemp -d /tmp/container-check.XXXXXX)
trap 'docker rm -f accum-study-term >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
fail() { echo "container check FAILED: $*" >&2; exit 1; }
ok() { echo "container check ($SECONDS s): $*"; }

[ "$(id -u)" = 0 ] || { echo "container check: needs root (dockerd, mmdebstrap, chown)" >&2; exit 2; }
[ -x "$PY" ] || { echo "container check: no $PY; run make test first" >&2; exit 2; }

# 1. The engine.
if ! docker info >/dev/null 2>&1; then
  dockerd --bridge=none --iptables=false --ip6tables=false --host=unix:///var/run/docker.sock \
    >/tmp/dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "container check: dockerd did not start: $(tail -3 /tmp/dockerd.log)" >&2; exit 3; }
  ok "started dockerd (no bridge, no iptables; log /tmp/dockerd.log)"
fi

# 2. The base, once.
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  start=$SECONDS
  mmdebstrap --variant=minbase --include=ca-certificates --quiet \
    --customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/" 2>/dev/null || true' \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
    bookworm - | docker import - "$BASE_IMAGE" >/dev/null
  ok "made $BASE_IMAGE with mmdebstrap in $((SECONDS - start)) s"
fi

# The README's docker commands, in its order: the build, the run, dvc exp run in it, the multi-GPU line.
readme_commands() {
  "$PY" - "$ROOT/README.md" <<'PYEOF'
import re, sys
text = open(sys.argv[1]).read()
for block in re.findall(r"```bash\n(.*?)```", text, re.S):
    for command in block.replace("\\\n", " ").splitlines():
        if command.startswith("docker "):
            print(re.sub(r"\s+", " ", command.split("  #")[0]).strip())
PYEOF
}
mapfile -t commands < <(readme_commands)
[ "${#commands[@]}" = 4 ] || fail "expected 4 docker commands in README.md, found ${#commands[@]}: ${commands[*]}"
# Run as README says, on this machine: the clone for "$PWD", RUN_UID for "$(id -u):$(id -g)", no --gpus where
# the host has no GPU, two gloo processes for the multi-GPU line's N on the CPU.
here() {
  local c=${1//\"\$PWD\"/\"$clone\"}
  c=${c//\"\$(id -u):\$(id -g)\"/$RUN_UID:$RUN_UID}
  command -v nvidia-smi >/dev/null 2>&1 || { c=${c// --gpus all/}; c=${c//nproc_per_node=4/nproc_per_node=2}; }
  echo "$c"
}

# 3. The real Dockerfile, by the README's build command (its base from a build argument).
build=${commands[0]}
[ "$build" = "docker build -t $IMAGE ." ] || fail "README's build command is not 'docker build -t $IMAGE .': $build"
start=$SECONDS
DOCKER_BUILDKIT=0 ${build% .} --quiet --network host --build-arg BASE="$BASE_IMAGE" \
  --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt . >/dev/null
size=$(docker image inspect "$IMAGE" --format '{{.Size}}')
ok "built $IMAGE in $((SECONDS - start)) s: $((size / 1000000)) MB (docker image inspect --format '{{.Size}}')"

# 4. A fresh clone of the working tree at a small CPU scale, committed, owned by RUN_UID.
clone=$WORK/clone
mkdir "$clone"  # the working tree's files as a clone has them (tracked, and new ones not ignored)
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$clone"
git -C "$clone" init -q
git -C "$clone" add -A
small=(scale=cpu scales.cpu.train_samples=128 scales.cpu.test_samples=64 scales.cpu.batch=32 scales.cpu.epochs=1
  'scales.cpu.sweep_micro_batches=[8,32]' memory.sweep_steps=1 speed.rounds=2)
(cd "$clone" && "$PY" -m gradaccum.params params.yaml "${small[@]/#/-S}" >/dev/null)
git -C "$clone" -c user.name=check -c user.email=check@localhost commit -qam "a fresh clone at a small CPU scale"
chown -R "$RUN_UID:$RUN_UID" "$clone"

run=$(here "${commands[1]}")
eval "$run" >"$WORK/repro.log" 2>&1 || fail "$run: $(tail -20 "$WORK/repro.log")"
grep -q "no GPU in this container" "$WORK/repro.log" || command -v nvidia-smi >/dev/null ||
  fail "no note that the CPU scale runs without --gpus"
for f in reports/report.html reports/report.md reports/metrics.json dvc.lock; do
  [ -s "$clone/$f" ] || fail "$f missing after dvc repro"
done
for v in $("$PY" -c "import yaml,sys; print(*yaml.safe_load(open(sys.argv[1]))['variants'])" "$clone/params.yaml"); do
  [ -s "$clone/reports/variants/$v/metrics.json" ] || fail "no record for variant $v"
done
wrong=$(find "$clone" ! -uid "$RUN_UID" -print -quit)
[ -z "$wrong" ] || fail "$wrong is owned by uid $(stat -c %u "$wrong"), not $RUN_UID"
ok "$run: the report, the metrics and every variant's record, all owned by uid $RUN_UID"

eval "$run" >"$WORK/again.log" 2>&1 || fail "second dvc repro: $(tail -5 "$WORK/again.log")"
ran=$(grep -o "Running stage '[^']*'" "$WORK/again.log" | tr '\n' ' ')
[ "$ran" = "Running stage 'hardware' " ] || fail "a second dvc repro re-ran more than the hardware check: $ran"
ok "the same again re-ran nothing but the always-run hardware check"

# dvc status outside the container agrees with the dvc.lock it wrote (the hardware stage always runs).
status=$(cd "$clone" && GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=safe.directory GIT_CONFIG_VALUE_0="$clone" \
  "$ROOT/.venv/bin/dvc" status --json)
[ "$status" = '{"hardware": ["always changed"]}' ] || fail "dvc status outside the container: $status"
ok "dvc status outside the container: nothing changed but the always-run hardware stage"

for i in 2 3; do
  run=$(here "${commands[$i]}")
  eval "$run" >"$WORK/exp$i.log" 2>&1 || fail "$run: $(tail -20 "$WORK/exp$i.log")"
done
"$PY" - "$clone/reports/variants/accumulation/metrics.json" <<'PYEOF' || fail "the experiments did not train as asked"
import json, sys
m = json.load(open(sys.argv[1]))
assert m["world_size"] == 2 and m["accum"] == 8, (m["world_size"], m["accum"])  # the second exp kept accum=8
PYEOF
ok "${commands[2]#docker run } and the multi-GPU line (as 2 CPU processes): trained as asked"

# SIGTERM to a running container: stopped within seconds, no half-written output left.
run=$(here "${commands[1]}")
eval "${run/docker run --rm/docker run -d --name accum-study-term} dvc repro -f" >/dev/null
for _ in $(seq 120); do docker logs accum-study-term 2>&1 | grep -q "Running stage 'sweep'" && break; sleep 1; done
sleep 2
start=$(date +%s%N)
docker kill --signal TERM accum-study-term >/dev/null
docker wait accum-study-term >/dev/null
took=$(( ($(date +%s%N) - start) / 1000000 ))
[ "$took" -lt 10000 ] || fail "SIGTERM took $took ms to stop it"
leftover=$(find "$clone/reports" "$clone/data" -name '*.tmp' -print -quit)
[ -z "$leftover" ] || fail "a half-written file after SIGTERM: $leftover"
docker rm accum-study-term >/dev/null
ok "SIGTERM stopped a running dvc repro in $took ms, nothing half-written"

# A checkout the container's uid cannot write: one line naming the folder and the -u flag.
out=$(docker run --rm -v "$clone":/work -u 4242:4242 "$IMAGE" 2>&1) && fail "uid 4242 ran on a checkout it cannot write"
[ "$(echo "$out" | wc -l)" = 1 ] && echo "$out" | grep -q "^error: /work.* -u " || fail "unwritable checkout said: $out"
ok "a checkout the uid cannot write: $out"
