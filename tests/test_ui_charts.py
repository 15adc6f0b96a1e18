"""The charts' shared promises (``Sy.chart`` in static/ui/app.js), checked in Node: no line
across a gap in the data, and "no data yet" on an empty chart. The browser journeys
(tests/e2e/test_browser*.py) draw the same charts in Chromium."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_chart_breaks_gaps_and_says_no_data_yet():
    done = subprocess.run(
        ["node", str(ROOT / "tests/js/chart_gaps.js"), str(ROOT / "static/ui/app.js")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
