"""tests/pick_slow.py reads pytest's own --durations report, and tests/conftest.py marks what it
lists `slow`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import pick_slow

ROOT = Path(__file__).resolve().parents[1]


def test_durations_are_read_from_pytests_own_report(tmp_path, monkeypatch):
    (tmp_path / "test_timed.py").write_text(textwrap.dedent("""
        import time, pytest

        @pytest.fixture
        def slow_setup():
            time.sleep(0.3)

        def test_long(slow_setup):
            time.sleep(0.3)

        @pytest.mark.parametrize("x", ["a b", "c"])
        def test_short(x):
            pass
        """))
    report = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0",
                             "--durations-min=0", "test_timed.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    seconds = pick_slow.read_durations(report.stdout)
    assert 0.55 < seconds["test_timed.py::test_long"] < 5  # setup and call summed
    assert set(seconds) == {"test_timed.py::test_long", "test_timed.py::test_short[a b]",
                            "test_timed.py::test_short[c]"}  # an id with a space kept whole

    listed = tmp_path / "slow_by_time.txt"
    monkeypatch.setattr(pick_slow, "LIST", listed)
    monkeypatch.setattr(pick_slow, "KEEP", ("test_timed.py::test_short[c]",))
    pick_slow.write_list({"test_timed.py::gone_by_hand_edit": 9.0}, listed)
    (tmp_path / "durations.txt").write_text(report.stdout)
    pick_slow.main([str(tmp_path / "durations.txt"), "--over", "0.5"])
    long = pytest.approx(seconds["test_timed.py::test_long"], abs=0.01)
    assert pick_slow.read_list(listed) == {"test_timed.py::gone_by_hand_edit": 9.0, "test_timed.py::test_long": long}
    pick_slow.main([str(tmp_path / "durations.txt"), "--over", "0"])  # KEEP stays in the default pass
    assert set(pick_slow.read_list(listed)) == {"test_timed.py::gone_by_hand_edit", "test_timed.py::test_long",
                                                "test_timed.py::test_short[a b]"}
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_a_report_without_durations_is_one_line(tmp_path):
    (tmp_path / "d.txt").write_text("1 passed in 0.01s\n")
    result = subprocess.run([sys.executable, "tests/pick_slow.py", str(tmp_path / "d.txt")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no --durations rows" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_listed_tests_are_marked_slow(request):
    listed = pick_slow.read_list()
    assert listed, "tests/slow_by_time.txt lists no test"
    items = [item for item in request.session.items if item.nodeid in listed]
    assert all("slow" in item.keywords for item in items)
    assert not any(test.startswith(pick_slow.KEEP) for test in listed)
