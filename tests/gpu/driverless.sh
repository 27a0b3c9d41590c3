#!/usr/bin/env bash
# The image build's patch smoke (`python -m recipe.patch smoke --import`, Dockerfile) as `docker build`
# meets it on a GPU base: SGLang and its CUDA torch installed, but no GPU and no driver. Run on the GPU
# host after `device.sh install` (SGLang patched in /tmp/site): once with no GPU visible, once with the
# driver's libcuda hidden too (bind-mounted over by /dev/null in a private mount namespace).
# Writes $OUT/driverless.jsonl (a line per mode: the torch probe, the smoke's exit status and output).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/gpu-out}
probe='import ctypes, json, torch
try:
    ctypes.CDLL("libcuda.so.1"); drv = "loads"
except OSError as e:
    drv = f"does not load: {e}"
print(json.dumps({"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "libcuda": drv}))'
smoke="python3 -m recipe.patch smoke --site-packages /tmp/site --import"
no_gpu() { CUDA_VISIBLE_DEVICES= "$@"; }
no_driver() {  # every libcuda the loader knows of, replaced by an empty file, for this command only
  local libs; libs=$(ldconfig -p | awk '/libcuda\.so/{print $NF}' | xargs -r readlink -f | sort -u)
  unshare -m bash -c 'for l in $1; do mount --bind /dev/null "$l" || exit 97; done; shift; "$@"' _ "$libs" "$@"
}
line='import json, sys; m, probe, rc, smoke = sys.argv[1:]; print(json.dumps({"mode": m, "probe": probe, "smoke_rc": int(rc), "smoke": smoke}))'
for mode in no_gpu no_driver; do
  p=$($mode python3 -c "$probe" 2>&1 | tail -3); s=$($mode $smoke 2>&1); rc=$?
  python3 -c "$line" "$mode" "$p" "$rc" "$s"
done | tee "$OUT/driverless.jsonl"
