"""Models the speed benchmarks share: the shipped llada-tiny and random LLaDA-architecture
checkpoints built here (random weights: their decodes commit one token per step, so every
executor and the PyTorch peer run exactly gen_len forward passes)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bidirectional LLaDA-style shapes: SwiGLU, RoPE, grouped K/V heads, untied head.
RANDOM_SHAPES: dict[str, dict[str, int]] = {
    "random-29m": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, ffn_hidden=1536,
                       vocab_size=4096, embedding_rows=4096),
    "random-154m": dict(d_model=1024, n_layers=12, n_heads=16, n_kv_heads=4, head_dim=64, ffn_hidden=1536,
                        vocab_size=32000, embedding_rows=32000),
}
MODELS: tuple[str, ...] = ("llada-tiny", *RANDOM_SHAPES)


def model_path(name: str, workdir: Path) -> Path:
    """The checkpoint directory of `name`: shipped under models/, or a random one written to
    `workdir` once (seeded, so every run benchmarks the same weights)."""
    if name not in RANDOM_SHAPES:
        return ROOT / "models" / name
    path = workdir / name
    if (path / "config.json").exists():
        return path
    import dlm_jax

    shipped = dlm_jax.load(ROOT / "models" / "llada-tiny")
    config = dlm_jax.ModelConfig.from_dict({**shipped.config.to_dict(), **RANDOM_SHAPES[name], "max_seq_len": 1024})
    dlm_jax.save_pretrained(dlm_jax.init_model(config, seed=0), path, tokenizer=shipped.tokenizer)
    return path


def prompts_for(name: str, handle, batch: int, *, length: int = 64) -> list[list[int]]:
    """`batch` prompts of one length (the PyTorch peer batches only equal lengths): held-out
    gsm_lite prompts of the most common encoded length for a shipped (trained) model, whose
    decode ends early on EOS otherwise; `length` seeded random byte ids for a random one."""
    import numpy as np

    if name in RANDOM_SHAPES:
        rng = np.random.default_rng(0)
        return [rng.integers(0, 256, length).tolist() for _ in range(batch)]
    from collections import Counter

    from dlm_jax.training.data import TASKS, make_split

    encoded = [handle.encode(ex.prompt) for ex in make_split(TASKS["gsm_lite"], 64, split="heldout")]
    common = Counter(len(p) for p in encoded).most_common(1)[0][0]
    same = [p for p in encoded if len(p) == common]
    return [same[i % len(same)] for i in range(batch)]
