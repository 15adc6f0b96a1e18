"""One Django process per end-to-end backend that runs its management commands one after another
(``Backend.manage``): a ``manage.py`` process costs ~1.3 s of CPU to start, and a run of the
end-to-end tests called it about 100 times for tenants, nodes and ``shell -c`` code (~130 s of
CPU measured on two cores).

Started with the backend's environment (``python -m tests.e2e.manage_runner``; the harness starts
a new one when that environment changes). Each line on stdin is a JSON list, the arguments of
``manage.py``; each answer is one JSON line ``{"rc", "stdout", "stderr"}`` on the file descriptor
that was stdout at start. Everything else the process writes (logging, a C library) goes to
stderr, so nothing can corrupt an answer. The database connections are closed after every
command, as a ``manage.py`` process would leave them: no lock or session outlives a command (a
PostgreSQL template cannot be copied while anyone is connected to it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_site.settings")
    import django

    django.setup()
    from django.core.management import ManagementUtility
    from django.db import connections

    for line in sys.stdin:
        args = json.loads(line)
        out, err = io.StringIO(), io.StringIO()
        rc = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                ManagementUtility(["manage.py", *args]).execute()
            except SystemExit as exit_:
                rc = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
            except BaseException:  # noqa: BLE001 - reported to the caller like a failed manage.py
                traceback.print_exc()
                rc = 1
            finally:
                connections.close_all()
        answer = {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
