import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SGLANG_VERSION = "0.5.16"  # the pinned SGLang (patches/sglang/v0.5.16, Dockerfile, pyproject)
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory):
    """Built-in models go to a per-session cache (subprocesses inherit it)."""
    os.environ.setdefault("RECIPE_CACHE", str(tmp_path_factory.mktemp("recipe-cache")))


@pytest.fixture(scope="session")
def tiny_model_dir(_cache):
    from recipe.models import materialize

    return materialize("tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def dump_parent(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return d


def compose(overrides=()):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from recipe import schema
    from recipe.main import CONF_DIR

    schema.register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hcompose(config_name="config", overrides=list(overrides), return_hydra_config=False)


def recipe_cli(tmp, *args, timeout=300):
    """`python -m recipe ARGS` in a subprocess with cwd=tmp and its dumps under tmp/shm."""
    return subprocess.run(
        [sys.executable, "-m", "recipe", *args, f"capture.dump_dir={tmp / 'shm'}"],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def small_run_cfg(tmp, *extra, limit=8):
    """The embedded default on `limit` records, writing under tmp (out/, shm/)."""
    return compose(
        [
            f"output_dir={tmp / 'out'}",
            f"capture.dump_dir={tmp / 'shm'}",
            f"data.limit={limit}",
            "log_every_s=1000",
            *extra,
        ]
    )


SEAM_FILES = ("sglang/srt/layers/logits_processor.py", "sglang/srt/model_executor/model_runner.py")


def unpack_models(whl: Path, dest: Path) -> Path:
    """The files of an SGLang wheel the patch and its tests read: the model files, the two files the
    seam patches, and the dist-info."""
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            models = n.endswith(".py") and n.startswith("sglang/srt/models/")
            ours = n in SEAM_FILES or n == "sglang/__init__.py" or (n.startswith("sglang-") and ".dist-info/" in n)
            if models or ours:
                z.extract(n, dest)
    return dest


NEWEST = "0.5.23"  # the newest SGLang release: its seam patch is checked on the CPU (patches/sglang/v0.5.23)


def wheel(version: str = SGLANG_VERSION) -> Path:
    """The SGLang wheel of `version` from PyPI, downloaded once into a cache."""
    cache = Path(os.environ.get("RECIPE_WHEEL_CACHE", Path.home() / ".cache" / "hs-recipe" / "wheels"))
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if not found:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check"]
        subprocess.run([*pip, f"sglang=={version}", "-d", str(cache)], check=True)
        found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    return found[0]


@pytest.fixture(scope="session")
def sglang_wheel():
    return wheel(SGLANG_VERSION)
