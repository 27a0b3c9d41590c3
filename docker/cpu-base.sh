#!/usr/bin/env bash
# The CPU base image for CI (no registry needed): Debian bookworm + Python 3.11 in /opt/venv + torch's
# CPU build + the pinned SGLang wheel installed without its dependencies. Nothing runs SGLang on a
# CPU; its files are there so that the Dockerfile's patch check/apply/status step runs against the
# real upstream sources. Built once per engine: an existing tag is reused.
#   docker/cpu-base.sh [TAG]          (DOCKER_HOST: a running engine; root, for debootstrap/chroot)
set -euo pipefail
TAG=${1:-hs-recipe-cpu-base:bookworm-sglang0.5.16}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.16}
DOCKER=${DOCKER:-docker}
if "$DOCKER" image inspect "$TAG" >/dev/null 2>&1; then
  echo "cpu base: $TAG already built"
  exit 0
fi
work=$(mktemp -d /var/tmp/hs-cpu-base.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
# the Debian mirror apt already uses here (deb822 or one-line sources)
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}
echo "cpu base: debootstrap bookworm from $mirror"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log"; exit 1; }
# HTTPS may be re-signed by a local proxy: the machine's whole CA bundle goes in
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
cp /etc/resolv.conf "$root/etc/resolv.conf"
export SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt
chroot "$root" python3 -m venv /opt/venv
pip_in() { chroot "$root" /opt/venv/bin/pip install -q --no-cache-dir --disable-pip-version-check "$@"; }
# torch: the CPU build (this machine's local wheel if it has one, else PyTorch's CPU index)
whl=$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
if [ -n "$whl" ]; then
  cp "$whl" "$root/tmp/" && pip_in "/tmp/$(basename "$whl")" && rm "$root/tmp/$(basename "$whl")"
else
  pip_in "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
fi
pip_in --no-deps "sglang==${SGLANG_VERSION}"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/root/.cache
echo "cpu base: importing $TAG"
tar -C "$root" -c . | "$DOCKER" import \
  -c 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  -c 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
  - "$TAG" >/dev/null
echo "cpu base: $TAG"
