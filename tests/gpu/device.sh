#!/usr/bin/env bash
# The GPU proof on an offline H100/H200 (this workplace's `device` tool; any GPU host works the same).
# Wheels come in folders (shared/gpu/stage-sglang-wheels.sh -> .gpu-wheels/a, b; the recipe's own
# pure-Python needs -> .gpu-wheels/r), each installed once into /tmp/site.
#   bash tests/gpu/device.sh install    # install whatever wheel folders came along
#   bash tests/gpu/device.sh proof      # patch SGLang in /tmp/site, run tests/gpu -> $OUT/{report.json,pytest.log,servers.log}
#   bash tests/gpu/device.sh bench      # bench/prefill.py -> $OUT/bench.json, bench.log
#   bash tests/gpu/device.sh product    # bench/product.py (python -m recipe vs plain) -> $OUT/product.json, logs
#   bash tests/gpu/device.sh draft      # bench/draft all [its options] -> $OUT/draft.json, draft.log, draft-logs.tgz
#   bash tests/gpu/device.sh draft-peer # bench/draft_peer.py (after draft, same machine) -> $OUT/draft-peer.json, logs
#   bash tests/gpu/device.sh peers      # bench/peers.py (SpecForge's own extraction beside ours) -> $OUT/peers.json
#   bash tests/gpu/device.sh driverless # the image build's patch smoke with no GPU, then no driver -> $OUT/driverless.jsonl
#   bash tests/gpu/device.sh families   # tests/gpu/families.py: every built-in family vs HF -> $OUT/families.json, log
#   bash tests/gpu/device.sh moe-nan    # tests/gpu/moe_nan.py: Qwen3-MoE shapes with NaN states -> $OUT/moe_nan.json
# SpecForge's pinned SGLang (tests/gpu/stage-peer.sh -> .gpu-wheels/p1, p2, p3) goes to /tmp/peer, apart.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/site /tmp/peer
# pip compiles what it installs (it writes bytecode even under the host's PYTHONDONTWRITEBYTECODE=1, which
# keeps imports from caching it): without that, every SGLang start spends about 5 s compiling its sources.
for d in a b r s p1 p2 p3; do
  site=/tmp/site; [[ $d == p* ]] && site=/tmp/peer
  if [ -d .gpu-wheels/$d ] && [ ! -e $site/.installed-$d ]; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target $site .gpu-wheels/$d/*.whl \
      && touch $site/.installed-$d && echo "installed wheel folder $d into $site"
  fi
done
python3 tests/gpu/build_loops.py   # the C loops pip would build (fp8 packs ~5x slower in numpy)
python3 -c "import sglang, transformers, torch; print('sglang', sglang.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)" || exit 0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m recipe.patch apply --site-packages /tmp/site > "$OUT/patch.json" || { cat "$OUT/patch.json"; exit 1; }
case "${1:-install}" in
  proof)
    GPU_REPORT="$OUT/report.json" GPU_WORK=/tmp/gpu-proof timeout 560 python3 -m pytest -q tests/gpu -p no:cacheprovider \
      -o timeout=900 -rA "${@:2}" 2>&1 | tee "$OUT/pytest.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed" ;
    for f in /tmp/gpu-proof/server-*.log; do echo "=== $f"; tail -n 150 "$f"; done > "$OUT/servers.log" 2>&1 ;;
  draft)
    timeout 585 python3 bench/draft all --work /tmp/draft --out "$OUT/draft.json" "${@:2}" 2>&1 | tee "$OUT/draft.log" | grep -v "HTTP Request" | tail -60
    (cd /tmp/draft && tar czf "$OUT/draft-logs.tgz" logs runs/*/*.log drafts/*.log drafts/*.json target/target.json \
      data/data.json $(ls vocab/vocab.json vocab/*/vocab_map.json shards/*/manifest.json 2>/dev/null)) ;;
  draft-peer)
    timeout 585 python3 bench/draft_peer.py --work /tmp/draft --out "$OUT/draft-peer.json" "${@:2}" 2>&1 | tee "$OUT/draft-peer.log" | grep -v "HTTP Request" | tail -40
    (cd /tmp/draft && tar czf "$OUT/draft-peer-logs.tgz" logs/peer-serve-*.log drafts/specforge-extract.log drafts/specforge_set*.log drafts/real_seed*.log) ;;
  product)
    [ -f "${PRODUCT_DONE:-}" ] && cp "$PRODUCT_DONE" "$OUT/product.json"   # --abba: arms recorded before (same machine)
    timeout 585 python3 bench/product.py --out "$OUT/product.json" "${@:2}" 2>&1 | tee "$OUT/product.log" | grep -v "HTTP Request" | tail -40
    cp /tmp/bench-product/recipe-*.log "$OUT/" 2>/dev/null
    for f in $(find /tmp/bench-product /tmp/bench -name server.log 2>/dev/null); do echo "=== $f"; tail -n 60 "$f"; done > "$OUT/product-servers.log" 2>&1 ;;
  peers)
    timeout 585 python3 bench/peers.py --out "$OUT/peers.json" "${@:2}" 2>&1 | tee "$OUT/peers.log" | grep -v "HTTP Request" | tail -60
    cp /tmp/bench-peers/*.log "$OUT/" 2>/dev/null ;;
  driverless)
    bash tests/gpu/driverless.sh ;;
  families)
    GPU_NAME="$(cat "$OUT/gpu.txt")" timeout 585 python3 tests/gpu/families.py --out "$OUT/families.json" "${@:2}" 2>&1 \
      | tee "$OUT/families.log" | grep -v "HTTP Request" | tail -40 ;;
  moe-nan)
    [ -f "${MOE_NAN_DONE:-}" ] && cp "$MOE_NAN_DONE" "$OUT/moe_nan.json"   # arms recorded before: skipped
    timeout 585 python3 tests/gpu/moe_nan.py --out "$OUT/moe_nan.json" "${@:2}" 2>&1 | tee "$OUT/moe_nan.log" | tail -20 ;;
  bench)
    timeout 570 python3 bench/prefill.py --out "$OUT/bench.json" "${@:2}" 2>&1 | tee "$OUT/bench.log" | grep -v "HTTP Request" | tail -40
    for f in /tmp/bench/logs-*/server.log; do echo "=== $f"; tail -n 80 "$f"; done > "$OUT/bench-servers.log" 2>&1 ;;
esac
