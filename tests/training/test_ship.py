"""Model-card helpers of training.ship."""

from __future__ import annotations

import pytest

from training.ship import LOSS_WINDOW, _final_loss


def test_final_loss_averages_the_last_logged_steps():
    metrics = [{"step": 50 * (i + 1), "loss": 100.0} for i in range(5)]
    metrics += [{"step": 300 + 50 * i, "loss": float(i % 2)} for i in range(LOSS_WINDOW)]  # 0,1,0,1,...
    assert _final_loss(metrics) == pytest.approx(0.5)  # not the last batch's 1.0, nor the early 100s
    assert _final_loss(metrics[:3]) == pytest.approx(100.0)  # fewer logs than the window
