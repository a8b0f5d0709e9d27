"""`python -m dlm_jax.tflite_export.background`: the bundle-cache export `AutoExecutor` runs in a process
of its own (at the lowest CPU priority) while decodes go on with JAX.

    python -m dlm_jax.tflite_export.background --source models/llada-tiny --entry ~/.cache/dlm-jax/bundles/llada-tiny-<key> \
        --buckets step_w32_p0_r32 ...

It loads the checkpoint, checks that it names the same cache entry as the process that asked
(the same weights and program), and exports the buckets the entry lacks as one part, under the
entry's lock, exactly as the bundle cache does in the foreground.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="checkpoint directory")
    p.add_argument("--entry", required=True, type=Path, help="the cache entry the asking process uses")
    p.add_argument("--buckets", nargs="+", required=True, help="signature names of the buckets to export")
    args = p.parse_args(argv)
    os.nice(19)  # idle time only: the decodes of the process that asked come first
    from dlm_jax.checkpoint._io import load_pretrained
    from dlm_jax.tflite_export.bundle import parse_bucket
    from dlm_jax.executors.bundle_cache import BundleCacheExecutor

    t0 = time.time()
    model = load_pretrained(args.source)
    executor = BundleCacheExecutor(model, source=args.source, root=args.entry.parent)
    if executor.path != args.entry:
        print(f"error: {args.source} names the cache entry {executor.path.name}, not {args.entry.name} "
              f"(the asking process changed the model): nothing exported", file=sys.stderr)
        return 2
    keys = [parse_bucket(b) for b in args.buckets]
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} exporting up to {len(keys)} buckets into {args.entry.name}",
          file=sys.stderr, flush=True)
    executor.prepare(keys)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} done: {len(executor.exported)} exported in "
          f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
