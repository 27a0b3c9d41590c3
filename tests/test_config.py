"""Every config composes; the schema rejects typos and wrong types; experiments open with their command."""

import subprocess
import sys

import pytest
from conftest import ROOT, compose
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

CONF = ROOT / "conf"
GROUPS = ["model", "backend", "server", "nccl", "capture", "data", "client", "shards"]


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes(group, option):
    cfg = compose([f"{group}={option}", "output_dir=/tmp/o", "data.sources=[x.jsonl]"])
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


@pytest.mark.parametrize("exp", options("experiment"))
def test_every_experiment_composes(exp):
    cfg = compose([f"experiment={exp}", "output_dir=/tmp/o"])
    c = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert c["capture"]["layers"] == sorted(c["capture"]["layers"])


@pytest.mark.parametrize("path", sorted(CONF.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF)))
def test_every_config_opens_with_its_command(path):
    first = path.read_text().lstrip().splitlines()
    first = [line for line in first if not line.startswith("# @package")][0]
    assert first.startswith(("# python -m recipe", "# docker compose")), (
        f"{path.name} must open with its command: {first}"
    )


def test_defaults_list_has_a_comment_on_every_line():
    text = (CONF / "config.yaml").read_text()
    block = text.split("defaults:")[1].split("\n\n")[0]
    for line in block.strip().splitlines():
        assert "#" in line, line


def test_schema_rejects_a_typo():
    with pytest.raises(ConfigCompositionException, match="captur"):
        compose(["capture.layerz=[1,2]"])


def test_schema_rejects_a_wrong_type():
    with pytest.raises(ConfigCompositionException, match="budget_gb"):
        compose(["capture.budget_gb=lots"])


def test_required_keys_are_missing_until_set():
    cfg = compose(["data=jsonl"])
    with pytest.raises(Exception, match="sources"):
        OmegaConf.to_container(cfg.data, resolve=True, throw_on_missing=True)


def test_layers_follow_the_model():
    cfg = compose(["model=kimi-k2.5", "output_dir=/x"])
    assert list(cfg.capture.layers) == [3, 31, 59]
    assert "entering decoder layer i" in cfg.capture.convention


def test_cfg_job_prints_the_resolved_config():
    out = subprocess.run(
        [sys.executable, "-m", "recipe", "--cfg", "job"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "layers:" in out and "rid_prefix: hsx-" in out
