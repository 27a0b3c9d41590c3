"""python -m recipe.patch {check,apply,status,smoke} --site-packages DIR | site | pins --sglang-version V

Applies patches/sglang/v<version>/*.patch to the SGLang installed under DIR (DIR/sglang/...).
Strict: every hunk must match the file exactly at its stated line (no fuzz, no offset), or nothing
is written. `apply` records what it applied in DIR/sglang/.hs_recipe_patch.json (patch sha256s and
the patched files' sha256s); `status` re-checks those files; every manifest copies that record.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import py_compile
import re
import sys
import time
from pathlib import Path

from .errors import UserError

REPO = Path(__file__).resolve().parent.parent
PATCH_ROOT = REPO / "patches" / "sglang"
STATUS_FILE = ".hs_recipe_patch.json"
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(UserError, RuntimeError):
    pass


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def parse(text: str) -> list[tuple[str, list]]:
    """Unified diff -> [(path relative to site-packages, [(old_start, [(op, line)])])]."""
    files, lines, i = [], text.splitlines(keepends=True), 0
    while i < len(lines):
        if lines[i].startswith("--- "):
            path = lines[i + 1][4:].strip().split("\t")[0]
            path = path[2:] if path.startswith("b/") else path
            hunks, i = [], i + 2
            while i < len(lines) and lines[i].startswith("@@"):
                m = HUNK.match(lines[i])
                if not m:
                    raise PatchError(f"bad hunk header: {lines[i]!r}")
                old_n = int(m.group(2) or 1)
                new_n = int(m.group(4) or 1)
                body, i = [], i + 1
                while i < len(lines) and (old_n > 0 or new_n > 0):
                    op, content = lines[i][:1], lines[i][1:]
                    if op == "\\":  # "\ No newline at end of file"
                        i += 1
                        continue
                    body.append((op, content))
                    old_n -= op in (" ", "-")
                    new_n -= op in (" ", "+")
                    i += 1
                hunks.append((int(m.group(1)), body))
            files.append((path, hunks))
        else:
            i += 1
    if not files:
        raise PatchError("no file in patch")
    return files


def apply_text(original: str, hunks, name: str) -> str:
    src = original.splitlines(keepends=True)
    out, pos = [], 0
    for start, body in hunks:
        at = start - 1 if start else 0
        old = [c for op, c in body if op in (" ", "-")]
        if src[at : at + len(old)] != old:
            got = "".join(src[at : at + len(old)])[:400]
            raise PatchError(
                f"{name}: hunk at line {start} does not match the installed file exactly.\n"
                f"--- expected ---\n{''.join(old)[:400]}\n--- found ---\n{got}"
            )
        out += src[pos:at]
        out += [c for op, c in body if op in (" ", "+")]
        pos = at + len(old)
    return "".join(out + src[pos:])


def sglang_version(site: Path) -> str:
    for dist in sorted(site.glob("sglang-*.dist-info")):
        m = re.match(r"sglang-([^-]+)\.dist-info", dist.name)
        if m:
            return m.group(1)
    raise PatchError(f"no sglang-*.dist-info in {site}: pass --version")


def patch_files(version: str) -> list[Path]:
    d = PATCH_ROOT / f"v{version}"
    files = sorted(d.glob("*.patch"))
    if not files:
        have = sorted(p.name for p in PATCH_ROOT.glob("v*"))
        raise PatchError(f"no patches for SGLang {version} in {d} (have {have}); see patches/README.md")
    return files


def plan(site: Path, version: str) -> tuple[dict, list]:
    """All patched texts, computed in memory. Raises PatchError before anything is written."""
    new, applied = {}, []
    for pf in patch_files(version):
        raw = pf.read_bytes()
        for rel, hunks in parse(raw.decode()):
            target = site / rel
            if not target.exists():
                raise PatchError(f"{pf.name}: {target} does not exist")
            base = new.get(rel, target.read_text())
            new[rel] = apply_text(base, hunks, f"{pf.name} -> {rel}")
        applied.append({"patch": str(pf.relative_to(REPO)), "sha256": sha256(raw)})
    return new, applied


def read_status(site: Path) -> dict | None:
    p = site / "sglang" / STATUS_FILE
    return json.loads(p.read_text()) if p.exists() else None


def status(site: Path) -> dict:
    st = read_status(site)
    if st is None:
        return {"applied": False}
    changed = [
        rel for rel, h in st["files"].items() if not (site / rel).exists() or sha256((site / rel).read_bytes()) != h
    ]
    return {**st, "applied": True, "intact": not changed, "changed_since": changed}


def check(site: Path, version: str) -> dict:
    st = read_status(site)
    if st is not None:
        s = status(site)
        if not s["intact"]:
            raise PatchError(f"patched files changed since apply: {s['changed_since']}")
        return {"ok": True, "already_applied": True, "patches": st["patches"]}
    _, applied = plan(site, version)
    return {"ok": True, "already_applied": False, "patches": applied}


def apply(site: Path, version: str) -> dict:
    if read_status(site) is not None:
        check(site, version)
        return status(site)
    new, applied = plan(site, version)
    for rel, text in new.items():
        (site / rel).write_text(text)
        py_compile.compile(str(site / rel), doraise=True)
    combined = sha256("".join(a["sha256"] for a in applied).encode())
    record = {
        "sglang_version": version,
        "patches": applied,
        "patch_set_sha256": combined,
        "files": {rel: sha256((site / rel).read_bytes()) for rel in new},
        "applied_at": time.time(),
    }
    (site / "sglang" / STATUS_FILE).write_text(json.dumps(record, indent=2))
    return status(site)


def installed_status() -> dict | None:
    """For the manifest: the patch record of the SGLang this Python would import (without importing it)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return status(Path(list(spec.submodule_search_locations)[0]).parent)


def site_dir() -> Path:
    """The site-packages folder that holds the importable sglang (found without importing it)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("sglang is not importable here")
    return Path(list(spec.submodule_search_locations)[0]).parent


def pins(version: str) -> dict:
    """The SGLang installed == the version asked for, and patches exist for it."""
    import importlib.metadata as md

    try:
        have = md.version("sglang")
    except md.PackageNotFoundError:
        raise PatchError("sglang is not installed") from None
    if have != version:
        raise PatchError(
            f"installed SGLang is {have}, the build pins {version}: base image and SGLANG_VERSION disagree"
        )
    return {"sglang": have, "patches": [str(p.relative_to(REPO)) for p in patch_files(version)]}


# the seam: each patched file holds its one call exactly once (patches/sglang/README.md)
HOOKS = {
    "sglang/srt/model_executor/model_runner.py": "install(self.model)",
    "sglang/srt/layers/logits_processor.py": "self.hs_dump(logits_metadata, hidden_states, aux_hidden_states)",
}


def smoke(site: Path, do_import: bool = False) -> dict:
    """After apply: files intact, the seam's two calls wired in once each (the target's model handed
    to the recipe once loaded, the hook called first in LogitsProcessor.forward); with do_import, the
    patched modules import (needs SGLang's own dependencies, as in the image)."""
    st = status(site)
    if not st.get("applied") or not st.get("intact"):
        raise PatchError(f"patch not applied or changed since: {st}")
    if sorted(st["files"]) != sorted(HOOKS):
        raise PatchError(f"patched files {sorted(st['files'])}, the seam needs {sorted(HOOKS)}")
    for rel, call in HOOKS.items():
        if (site / rel).read_text().count(call) != 1:
            raise PatchError(f"{rel}: hook not wired in exactly once ({call})")
    imported = []
    if do_import:
        import importlib

        for rel in st["files"]:
            mod = importlib.import_module(rel[:-3].replace("/", "."))
            if HOOKS[rel] not in Path(mod.__file__).read_text():
                raise PatchError(f"{mod.__name__} imported from an unpatched file {mod.__file__}")
            imported.append(mod.__name__)
    return {"ok": True, "files": sorted(st["files"]), "imported": imported}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m recipe.patch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("cmd", choices=["check", "apply", "status", "smoke", "site", "pins"])
    p.add_argument("--site-packages", type=Path, help="the folder that holds sglang/")
    p.add_argument("--version", help="SGLang version (default: read from sglang-*.dist-info)")
    p.add_argument("--sglang-version", help="pins: the version the build expects")
    p.add_argument("--import", dest="do_import", action="store_true", help="smoke: also import the patched modules")
    a = p.parse_args(argv)
    try:
        if a.cmd == "site":
            print(site_dir())
            return 0
        if a.cmd == "pins":
            print(json.dumps(pins(a.sglang_version), indent=2))
            return 0
        if a.site_packages is None:
            p.error(f"{a.cmd} needs --site-packages")
        site = a.site_packages.resolve()
        if a.cmd == "smoke":
            print(json.dumps(smoke(site, a.do_import), indent=2))
            return 0
        if a.cmd == "status":
            st = status(site)
            print(json.dumps(st, indent=2))
            return 0 if st.get("applied") and st.get("intact") else 1
        version = a.version or sglang_version(site)
        result = check(site, version) if a.cmd == "check" else apply(site, version)
        print(json.dumps(result, indent=2))
        return 0
    except PatchError as e:
        print(f"PATCH FAILED: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
