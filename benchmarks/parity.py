"""Max abs fp32 logit difference between dlm-jax and transformers, per checkpoint family.

    .venv/bin/python benchmarks/parity.py   (needs the test extra: torch, transformers)

Prints one JSON object. The same models and inputs as tests/checkpoint/test_parity.py.
"""

import json
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dlm_jax  # noqa: E402
from tests.checkpoint.hf_models import build, llama_to_llada, logits, qwen2_to_dream  # noqa: E402


def main() -> None:
    ids = np.random.default_rng(0).integers(0, 96, (2, 13))
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for kind in ["llama", "qwen2", "qwen3", "qwen3_tied", "qwen3_moe", "dots1"]:
            model = build(kind)
            model.save_pretrained(tmp / kind)
            ours = dlm_jax.load_pretrained(tmp / kind)(jnp.asarray(ids, jnp.int32)).logits
            figures[kind] = float(np.abs(np.asarray(ours) - logits(model, ids)).max())
        llama, qwen2 = build("llama"), build("qwen2")
        llama.save_pretrained(tmp / "llama_src")
        llama_to_llada(tmp / "llama_src", tmp / "llada", mask_token_id=95)
        qwen2.save_pretrained(tmp / "qwen2_src")
        qwen2_to_dream(tmp / "qwen2_src", tmp / "dream", mask_token_id=94)
        for name, ref in [("llada", llama), ("dream", qwen2)]:
            ours = dlm_jax.load_pretrained(tmp / name)(jnp.asarray(ids, jnp.int32)).logits
            figures[name] = float(np.abs(np.asarray(ours) - logits(ref, ids, bidirectional=True)).max())
    print(json.dumps({"max_abs_logit_diff": figures, "tolerance": 1e-4,
                      "all_within": all(v <= 1e-4 for v in figures.values())}, indent=2))


if __name__ == "__main__":
    main()
