#!/usr/bin/env bash
# Stages SpecForge 0.2.0's own offline extraction for bench/peers.py on an offline GPU host: the SGLang it
# pins (0.5.14, with that release's kernel, FlashInfer, tvm-ffi and transformers pins) and its
# scripts/prepare_hidden_states.py, which its wheel and sdist do not ship (taken from a SpecForge checkout
# at the release's commit). SpecForge 0.2.0 cannot drive SGLang 0.5.16 in-process: its capture backend
# imports `compute_dp_attention_local_info` and `get_attention_tp_group` from sglang.srt.layers.dp_attention,
# which 0.5.16 no longer has. Everything else (fastapi, pydantic, ... ; specforge's wheel) comes from the
# folders shared/gpu/stage-sglang-wheels.sh and .gpu-wheels/s already stage.
#
#   usage: stage-peer.sh DEST SPECFORGE_CHECKOUT  -> DEST/p1 (~36 MB), DEST/p2 (~27 MB + the script)
#   there: bash tests/gpu/device.sh install       (installs p1, p2 into /tmp/peer; see bench/peers.py)
set -euo pipefail
dest=${1:?usage: stage-peer.sh DEST SPECFORGE_CHECKOUT}
src=${2:?usage: stage-peer.sh DEST SPECFORGE_CHECKOUT}
commit=a6b6b023  # SpecForge main on 2026-08-08, two days before the 0.2.0 wheel; version.txt says 0.2.0
slim=$(cd "$(dirname "$0")/../../../shared/gpu" && pwd)/slim_wheel.py
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
mkdir -p "$dest/p1" "$dest/p2"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$1" "${@:2}" 2>&1 | grep -v "^WARNING: Location" || true; }
get "$dest/p1" flashinfer-python==0.6.12 apache-tvm-ffi==0.1.9
get "$dest/p2" sglang==0.5.14 transformers==5.8.1 openai-harmony==0.0.4 cuda-tile==1.7.0  # flashinfer 0.6.12 imports cuda.tile
get "$raw" sglang-kernel==0.4.4
python3 "$slim" "$raw"/sglang_kernel-0.4.4-*.whl "$dest/p1" sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100/ sgl_kernel/infllm_ops
git -C "$src" show "$commit:scripts/prepare_hidden_states.py" > "$dest/p2/prepare_hidden_states.py"
du -sh "$dest/p1" "$dest/p2"
