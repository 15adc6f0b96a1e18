"""Kubernetes exec probe for a heartbeat file (platform_site/alive.py, the agent's --alive-file):
exit 0 when the file was refreshed within --max-age seconds (liveness) and, with --ready, also
says ``ready`` (readiness). Standard library only: it runs every few seconds in the pod.

    python scripts/probe_alive.py /tmp/alive --max-age 60 [--ready]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def check(path: Path, max_age_s: float, ready: bool) -> str | None:
    """Why the probe fails, or None when it passes."""
    try:
        age = time.time() - path.stat().st_mtime
        line = path.read_text().strip()
    except OSError as exc:
        return f"no heartbeat: {exc}"
    if age > max_age_s:
        return f"heartbeat {age:.0f} s old (more than {max_age_s:g} s): the process is wedged"
    if ready and line != "ready":
        return line or "not ready"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--max-age", type=float, default=60.0)
    parser.add_argument("--ready", action="store_true", help="also require the line 'ready'")
    args = parser.parse_args(argv)
    failure = check(args.path, args.max_age, args.ready)
    if failure:
        print(failure, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
