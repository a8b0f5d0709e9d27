"""A bundle's file names are spelled in one module (`dlm_jax.executors.bundle_files`): an
exporter and a reader that spell one differently make bundles that load as "missing a file"
with no error at export time."""

from __future__ import annotations

import ast
from pathlib import Path

from dlm_jax.executors import bundle_files

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("dlm_jax", "tflite_export", "lowering", "training", "buckets")


def test_every_bundle_file_name_is_spelled_once():
    names = {v: k for k, v in vars(bundle_files).items() if k.endswith("_FILE") or k == "BUNDLE_FORMAT"}
    assert {"bundle.json", "model.tflite", "cpu.tflite", "ffn.flash", "plan.json"} <= set(names)
    spelled = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "bundle_files.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value in names:
                    spelled.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not spelled, "bundle file names spelled outside bundle_files: " + "; ".join(spelled)
