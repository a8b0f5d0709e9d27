"""Load a checkpoint (any supported family), run one forward pass, print the top tokens.

    python examples/load_and_forward.py path/to/checkpoint "some text"
"""

import sys

import jax.numpy as jnp
import numpy as np

import dlm_jax


def main(path: str, text: str) -> None:
    model = dlm_jax.load_pretrained(path)
    tok = dlm_jax.load_tokenizer(path)
    ids = jnp.asarray([tok.encode(text)], jnp.int32)
    logits = np.asarray(model(ids).logits[0])
    print(dlm_jax.load_config(path)[1].name, model.config.attention, f"{dlm_jax.param_count(model):,} params")
    for pos, row in enumerate(logits):
        print(pos, repr(tok.decode([int(ids[0, pos])])), "->", repr(tok.decode([int(row.argmax())])))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "hello")
