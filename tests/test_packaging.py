"""The wheel: pyproject.toml's package list against the tree and the shipped model as package
data (default pass), and a real install of the built wheel into a fresh venv, where the
installed `dlm-jax demo` answers with the shipped llada-tiny (slow: builds a wheel and a venv)."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The folders whose packages install as dlm_jax and its subpackages.
SOURCE_FOLDERS = ("dlm_jax", "buckets", "lowering", "tflite_export", "training")
# Data only (no __init__.py): the checkout's models/ folder, of which the wheel carries llada-tiny.
DATA_PACKAGE = "dlm_jax._shipped"
SHIPPED = "llada-tiny"
# Top-level names that must not land in site-packages.
GENERIC = {"buckets", "lowering", "tflite_export", "training", "models", "tests", "benchmarks", "examples"}


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_folder(package: str, package_dir: dict[str, str]) -> str:
    """The source folder (relative, `/`-separated) setuptools builds `package` from: the longest
    mapped prefix in `package-dir`, else the package's own path from the root."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        mapped = package_dir.get(".".join(parts[:i]))
        if mapped is not None:
            return "/".join([mapped, *parts[i:]]).strip("/")
    return "/".join(parts)


def _tree_packages(package_dir: dict[str, str]) -> dict[str, str]:
    """Every folder with an __init__.py under SOURCE_FOLDERS, as {dotted package name: folder}."""
    by_folder = {folder: package for package, folder in package_dir.items()}
    found = {}
    for top in SOURCE_FOLDERS:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            folder = init.parent.relative_to(ROOT).as_posix()
            head, _, rest = folder.partition("/")
            dotted = by_folder.get(head, head) + ("." + rest.replace("/", ".") if rest else "")
            found[dotted] = folder
    return found


def test_package_list_names_every_package_of_the_tree():
    """Silent failure guarded: a subpackage missing from pyproject.toml's explicit `packages`
    list builds a wheel without it (a source checkout still imports it, so only an installed
    copy breaks, with ModuleNotFoundError at first use)."""
    cfg = _setuptools()
    listed, package_dir = set(cfg["packages"]), cfg.get("package-dir", {})
    tree = _tree_packages(package_dir)
    assert not sorted(set(tree) - listed), f"packages missing from pyproject.toml's list: {sorted(set(tree) - listed)}"
    stray = sorted(listed - set(tree) - {DATA_PACKAGE})
    assert not stray, f"pyproject.toml lists packages with no __init__.py folder: {stray}"
    for package in listed:
        assert (ROOT / _package_folder(package, package_dir)).is_dir(), package


def test_wheel_carries_the_shipped_model_and_only_it():
    """Silent failure guarded: a wheel without the shipped llada-tiny installs fine, and the
    installed `dlm-jax demo` falls back to a random model whose answers are noise. The package
    data must be exactly the files of its manifest (and the manifest), no other models/ folder."""
    cfg = _setuptools()
    folder = cfg.get("package-dir", {}).get(DATA_PACKAGE)
    assert DATA_PACKAGE in cfg["packages"] and folder == "models", \
        f"pyproject.toml does not install models/ as {DATA_PACKAGE} (the installed demo's model)"
    globs = cfg.get("package-data", {}).get(DATA_PACKAGE, [])
    data = ROOT / folder
    files = {p.relative_to(data).as_posix() for p in data.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    carried = {f for f in files if any(fnmatch.fnmatchcase(f, g) for g in globs)}
    manifest = json.loads((data / SHIPPED / "manifest.json").read_text())["files"]
    assert carried == {f"{SHIPPED}/{name}" for name in [*manifest, "manifest.json"]}


def _copy_source(dst: Path) -> Path:
    """The checkout without virtual environments, build outputs and caches: a wheel built in
    place would write build/ and *.egg-info into it and pick up stale files from an old build/."""
    skip = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", "runs", "out", "bundles"}

    def ignore(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n in skip or n.endswith(".egg-info") or (Path(folder, n, "pyvenv.cfg")).is_file()}

    return Path(shutil.copytree(ROOT, dst, ignore=ignore))


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_built_wheel_installs_and_demo_uses_the_shipped_model(tmp_path):
    """Silent failures guarded: a wheel that puts lowering/ (or any top-level folder) into
    site-packages, drops a package or the shipped model, or only works beside the checkout. The
    wheel is installed (not editable) into a fresh venv with constraints.txt, and run from a
    folder outside the checkout with no PYTHONPATH."""
    cfg = _setuptools()
    source = _copy_source(tmp_path / "src")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist), str(source)],
         cwd=tmp_path, env=os.environ.copy())
    (wheel,) = dist.glob("dlm_jax-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"dlm_jax"}, sorted(tops)
    assert not tops & GENERIC
    package_dir = cfg.get("package-dir", {})
    for package, folder in _tree_packages(package_dir).items():
        installed = package.replace(".", "/")
        expected = {f"{installed}/{p.name}" for p in (ROOT / folder).glob("*.py")}
        assert expected <= names, f"{package}: the wheel lacks {sorted(expected - names)}"
    shipped = {n for n in names if n.startswith("dlm_jax/_shipped/")}
    assert shipped == {f"dlm_jax/_shipped/{SHIPPED}/{f}" for f in ("config.json", "model.safetensors",
                       "tokenizer_config.json", "manifest.json", "README.md", "eval.json")}

    venv = tmp_path / "venv"
    try:
        _check_install(wheel, venv, tmp_path)
    finally:  # 1.3 GB, and pytest keeps its last temporary folders
        shutil.rmtree(venv, ignore_errors=True)


def _check_install(wheel: Path, venv: Path, tmp_path: Path) -> None:
    """Install `wheel` into a new venv at `venv` and check it from a folder outside the checkout."""
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=os.environ.copy())
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt"), str(wheel)],
         cwd=tmp_path, env=os.environ.copy())

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=elsewhere, env=env).stdout.strip())
    # Every byte of the installed copy against its manifest, a warning (a file edited by hand) failing too.
    probe = """if True:
        import json, warnings
        import dlm_jax, dlm_jax.lowering, dlm_jax.tflite_export, dlm_jax.training, dlm_jax.buckets
        from dlm_jax._integrity import verify_manifest
        from dlm_jax.frontends.cli import shipped_model
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            verified = verify_manifest(shipped_model(), required=True, full=True)
        modules = (dlm_jax, dlm_jax.lowering, dlm_jax.tflite_export, dlm_jax.training, dlm_jax.buckets)
        print(json.dumps({"files": [m.__file__ for m in modules], "shipped": str(shipped_model()), "verified": verified}))
    """
    found = json.loads(_run([str(python), "-c", probe], cwd=elsewhere, env=env).stdout)
    assert all(Path(f).is_relative_to(site / "dlm_jax") for f in found["files"]), found["files"]
    assert found["shipped"] == str(site / "dlm_jax" / "_shipped" / SHIPPED) and found["verified"]
    for name in ("lowering", "training", "tflite_export", "buckets"):
        missing = subprocess.run([str(python), "-c", f"import {name}"], cwd=elsewhere, env=env, capture_output=True,
                                 text=True, timeout=120)
        assert missing.returncode != 0 and f"No module named '{name}'" in missing.stderr, name

    demo = _run([str(venv / "bin" / "dlm-jax"), "demo", "--per-task", "1"], cwd=elsewhere, env=env)
    assert f"model: {site / 'dlm_jax' / '_shipped' / SHIPPED} (" in demo.stderr, demo.stderr[-2000:]
    # The shipped model answers the held-out addition and sorting prompts (a random one: noise).
    assert demo.stdout.count("[ok ]") >= 2, demo.stdout
    assert "speedup_vs_vanilla" in demo.stdout
