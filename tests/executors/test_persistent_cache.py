"""A second process loads the compiled buckets of the first from the persistent XLA cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlm_jax.testing import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]

# One process: load a random tiny checkpoint (many steps per block) on the JAX executor (its default persistent cache,
# here `$DLM_JAX_CACHE_DIR`), decode with the prefix cache (several buckets), report what
# the cache served and what XLA compiled.
SCRIPT = """
import json, sys
import jax
import dlm_jax

events = {}
jax.monitoring.register_event_listener(lambda event, **_: events.__setitem__(event, events.get(event, 0) + 1))
m = dlm_jax.load(sys.argv[1], executor="jax", eos_token_id=None)
cfg = dlm_jax.decode_config(gen_len=32, block_len=8, cache="prefix", rule="threshold", threshold=0.9)
out = m.decoder.decode([[5, 6, 7, 8, 9]], cfg)
print(json.dumps({"programs": out.stats.compiles, "buckets": len(out.stats.buckets),
                  "hits": events.get("/jax/compilation_cache/cache_hits", 0),
                  "misses": events.get("/jax/compilation_cache/cache_misses", 0),
                  "tokens": [s.tolist() for s in out.sequences], "cache_dir": jax.config.jax_compilation_cache_dir}))
"""


def _run(ckpt: Path, cache: Path, layers: str) -> dict:
    env = {**os.environ, "DLM_JAX_CACHE_DIR": str(cache), "DLM_JAX_LAYERS": layers, "DLM_JAX_COMPILE_THREADS": "0",
           "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the tests' shared cache: the process must pick its own
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt)], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["unrolled", "scan"])
def test_a_second_process_compiles_nothing(tmp_path, layers):
    """Guards a persistent cache that silently misses (a key that differs between processes:
    a fresh process would wait for every compile again, 35.7 s at LLaDA-8B on a GPU instead
    of 6.3 s): the second process's programs all come from the cache the first filled, and
    the cache directory gains no entry."""
    cache, ckpt = tmp_path / "xla", tiny_checkpoint(tmp_path / "ckpt", seed=3)
    first = _run(ckpt, cache, layers)
    assert first["cache_dir"] == str(cache)
    assert first["buckets"] >= 2 and first["programs"] > first["buckets"]  # the allocation too
    assert first["misses"] >= first["programs"] and first["hits"] == 0
    entries = sorted(p.name for p in cache.iterdir())
    second = _run(ckpt, cache, layers)
    assert second["misses"] == 0 and second["hits"] >= second["programs"] == first["programs"]
    assert sorted(p.name for p in cache.iterdir()) == entries
    assert second["tokens"] == first["tokens"]
