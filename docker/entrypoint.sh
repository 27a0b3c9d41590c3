#!/bin/sh
# The image's entrypoint: `python -m recipe` with the chosen experiment ($EXPERIMENT, set by the image
# and by compose from .env) in front of the user's overrides. `docker compose run --rm extract
# capture.layers=[2,16,29]` replaces the service's command, so without this the overrides would run
# against the embedded default instead of the experiment. An explicit experiment=... wins. It goes
# last: Hydra's overrides are positional and may follow flags such as -m or --cfg, not precede them.
for arg in "$@"; do
  case "$arg" in experiment=* | +experiment=* | ++experiment=*) exec python3 -m recipe "$@" ;; esac
done
exec python3 -m recipe "$@" ${EXPERIMENT:+"experiment=$EXPERIMENT"}
