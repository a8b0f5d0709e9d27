"""What the benchmarks' plots share: a matplotlib figure as PNG bytes (written by the caller,
through `dlm_jax._integrity.atomic_write`)."""

from __future__ import annotations

import io


def png_bytes(fig) -> bytes:
    """`fig` rendered as a PNG (110 dpi), then closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
