"""python -m recipe.serve server=multinode ...   -- run only the (patched) SGLang server, in the foreground.

For nodes 1..N-1 of a multi-node server: same config, same argv and environment as the recipe
builds on node 0, but no client and no packer. Exits with the server's status; SIGTERM stops it.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from . import schema
from .backends.sglang import Server, hydra_run_dir, server_argv, server_env
from .capture.dumpdir import dump_dir
from .errors import UserError
from .main import CONF_DIR
from .models import resolve_model_path

schema.register()


def serve(cfg: DictConfig, run_dir: Path | None = None) -> int:
    schema.validate(cfg)
    with dump_dir(cfg.capture.dump_dir) as dump:
        srv = Server(
            server_argv(cfg.server, resolve_model_path(cfg.model.path)),
            server_env(cfg.nccl, cfg.capture, dump, server=cfg.server),
            Path(run_dir or hydra_run_dir() or ".") / "server.log",
            f"http://127.0.0.1:{cfg.server.port}",
            cfg.server.ready_timeout_s,
        )
        signal.signal(signal.SIGTERM, lambda *a: srv.stop())
        srv.start()
        try:
            return srv.proc.wait()
        finally:
            srv.stop()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        sys.exit(serve(cfg))
    except UserError as e:  # one line with the fix; bugs keep their traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
