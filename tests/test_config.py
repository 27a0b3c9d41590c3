"""Every config composes; the schema rejects typos and wrong types; experiments open with their command."""

import subprocess
import sys

import pytest
from conftest import ROOT, compose, recipe_cli
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

CONF = ROOT / "conf"
GROUPS = ["model", "backend", "server", "nccl", "capture", "data", "client", "shards"]


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes(group, option):
    """Each option of each group composes whole (no missing value) and passes the schema's checks,
    and its own file's values are what the composed config holds."""
    from recipe import schema

    cfg = compose([f"{group}={option}", "output_dir=/tmp/o", "data.sources=[x.jsonl]"])
    whole = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    schema.validate(cfg)
    own = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"), resolve=False)
    node = own.get(group, own) if isinstance(own, dict) else {}
    for k, v in (node or {}).items():
        if not isinstance(v, (dict, list)) and not str(v).startswith(("${", "???")) and k in whole.get(group, {}):
            assert whole[group][k] == v, (group, option, k)


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
        [sys.executable, "-m", "recipe", "--cfg", "job", "--resolve"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert "rid_prefix: hsx-" in out and "${" not in out  # every value resolved, none left as an interpolation
    assert "output_dir: outputs/tiny-llama/tiny-chat/layers-1-2-3+final/shards" in out


def test_the_default_output_dir_is_named_from_model_and_capture_not_the_clock(tmp_path):
    """Running the same command again resumes: same folder. Another capture: another folder."""

    def recipe(*args):
        p = recipe_cli(tmp_path, "data.limit=3", "log_every_s=1000", *args)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout + p.stderr

    first = recipe()
    assert "writing to: output_dir=" + str(tmp_path / "outputs/tiny-llama/tiny-chat/layers-1-2-3+final/shards") in first
    again = recipe()
    assert "3 already stored, 0 to do" in again
    other = recipe("capture.layers=[1,3]", "data.num_shards=2")
    assert "0 already stored" in other
    assert (tmp_path / "outputs/tiny-llama/tiny-chat/layers-1-3+final/part-0-of-2/shards/manifest.json").exists()
    # other data, same model and capture, no output_dir: a folder of its own, not a refusal
    (tmp_path / "mine.jsonl").write_text(_three_conversations())
    theirs = recipe(f"data.sources=[{tmp_path / 'mine.jsonl'}]")
    assert "writing to: output_dir=" + str(tmp_path / "outputs/tiny-llama/mine/layers-1-2-3+final/shards") in theirs


def _three_conversations() -> str:
    import json

    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(3)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_sweep_over_data_files_gives_each_its_own_folder(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(_three_conversations().replace("q", name))
    p = recipe_cli(
        tmp_path, "-m", f"data.sources=[{tmp_path / 'a.jsonl'}],[{tmp_path / 'b.jsonl'}]", "log_every_s=1000"
    )
    assert p.returncode == 0, p.stderr[-2000:]
    made = sorted(x.parent.parent.name for x in (tmp_path / "multirun").rglob("shards/manifest.json"))
    assert len(made) == 2 and made[0] != made[1], made


def test_each_backend_schema_holds_only_its_own_keys():
    compose(["backend=hf", "backend.batch_size=2", "output_dir=/o"])
    with pytest.raises(ConfigCompositionException, match="device"):  # an HF setting under sglang
        compose(["backend=sglang", "backend.device=cpu", "output_dir=/o"])
    with pytest.raises(ConfigCompositionException, match="backend.name"):  # a closed set
        compose(["backend.name=vllm", "output_dir=/o"])


@pytest.mark.parametrize("name", ["hf", "sglang"])
def test_registry_hands_each_backend_only_its_config_nodes(name, monkeypatch, tmp_path):
    import recipe.backends as backends

    seen = {}

    class Recorder:
        @classmethod
        def from_config(cls, model_dir, dump_dir, output_dir, **nodes):
            seen.update(nodes)
            return cls()

    monkeypatch.setitem(sys.modules, "recorder_mod", type(sys)("recorder_mod"))
    sys.modules["recorder_mod"].Recorder = Recorder
    target, nodes = backends.REGISTRY[name]
    monkeypatch.setitem(backends.REGISTRY, name, ("recorder_mod:Recorder", nodes))
    cfg = compose([f"backend={name}", "output_dir=/o"])
    backends.make_backend(cfg, tmp_path, tmp_path, tmp_path)
    assert set(seen) == set(nodes) and "data" not in seen and "output_dir" not in seen
    for n in nodes:
        assert seen[n] == cfg[n]
    # and the real class accepts exactly those nodes (a renamed or extra one fails here)
    import importlib
    import inspect

    module, cls = target.split(":")
    sig = inspect.signature(getattr(importlib.import_module(module), cls).from_config)
    assert {p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY} == set(nodes)


def test_serve_runs_the_server_alone_and_returns_its_status(tmp_path):
    from recipe.serve import serve

    cfg = compose(
        [
            "backend=sglang",
            "output_dir=/o",
            f"capture.dump_dir={tmp_path}/dump",
            "server.command=[" + sys.executable + ",-c,'import sys; sys.exit(7)']",
        ]
    )
    assert serve(cfg, run_dir=tmp_path) == 7
    assert not list((tmp_path / "dump").glob("user-*/*"))  # its dump folder went (the user's root stays)


@pytest.mark.parametrize(
    "path,schema_name",
    [
        ("capture/default.yaml", "CaptureConfig"),
        ("client/default.yaml", "ClientConfig"),
        ("shards/default.yaml", "ShardsConfig"),
        ("server/sglang.yaml", "ServerConfig"),
        ("backend/hf.yaml", "HFBackendConfig"),
        ("backend/sglang.yaml", "SGLangBackendConfig"),
    ],
)
def test_a_default_group_sets_no_default_the_schema_holds(path, schema_name):
    """Each default lives once, in the schema; a group's YAML holds comments and what the schema
    leaves open (capture.layers, capture.dump_dir, SGLang's flags), never a second copy to drift."""
    import dataclasses

    from recipe import schema

    cls = getattr(schema, schema_name)
    held = {
        f.name
        for f in dataclasses.fields(cls)
        if (f.default is not dataclasses.MISSING and f.default != "???")
        or (f.default_factory is not dataclasses.MISSING and f.default_factory() not in ({}, []))
    }
    yaml = OmegaConf.to_container(OmegaConf.load(CONF / path), resolve=False) or {}
    yaml.pop("defaults", None)
    yaml.pop("name", None)  # the backend group's own name: it picks the backend, as the schema's does
    again = sorted(set(yaml) & held)
    assert not again, f"{path} sets defaults the schema already holds ({schema_name}): {again}"


def test_the_gpt_oss_experiments_server_flags_are_ones_sglang_accepts_for_it(tmp_path, sglang_wheel):
    """Read against the pinned SGLang's own source: an attention backend its GptOssForCausalLM branch
    accepts (the ones with attention sinks), a MoE runner it knows, and no quantization flag (the MXFP4
    block is read from the checkpoint: the triton_kernels runner needs `quantization is None`)."""
    import ast
    import zipfile

    with zipfile.ZipFile(sglang_wheel) as z:
        server_args = z.read("sglang/srt/server_args.py").decode()
        overrides = z.read("sglang/srt/arg_groups/overrides.py").decode()
    tree = ast.parse(server_args)
    branch = next(n for n in ast.walk(tree) if isinstance(n, ast.If) and "GptOssForCausalLM" in ast.unparse(n.test))

    def assigned(body, name):
        return next(
            ast.literal_eval(a.value) for a in body if isinstance(a, ast.Assign) and ast.unparse(a.targets[0]) == name
        )

    supported, runners = assigned(branch.body, "supported_backends"), assigned(tree.body, "MOE_RUNNER_BACKEND_CHOICES")
    args = compose(["experiment=gpt-oss-120b", "output_dir=/o"]).server.args
    assert args.attention_backend in supported and args.attention_backend in {"fa3", "triton", "trtllm_mha", "fa4"}
    assert args.moe_runner_backend in runners
    assert 'overrides["moe_runner_backend"] = "triton_kernel"' in overrides  # SGLang's own pick on Hopper
    assert "quantization" not in args and int(args.get("ep_size") or 1) == 1
