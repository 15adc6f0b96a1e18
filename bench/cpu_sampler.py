"""Run a Python program (``-m module args...``) with a CPU-time sampler, for
``oip_bench.py --profile``: where the gateway's and the agent's CPU goes, stage by stage.

Why not py-spy: on the one core the gateway, the agent and Redis share, a process that is ready
to run but waits for the core reads to py-spy as running (``R`` in /proc), so its samples
pile up where it waits (``select``) and not where it spends CPU. This sampler counts CPU time
only: ``ITIMER_PROF`` fires after each ``--interval-ms`` of the process's CPU, and each sample
gives every thread's CPU used since the last sample (its own thread clock) to the stack that
thread is on now. The sampler's own time is left out (each thread's clock is read again after
the sample is taken). Samples land at the next bytecode boundary, so time in C (uvloop, orjson,
ONNX Runtime) goes to the Python function that called it or that runs next.

Control: the first SIGUSR1 starts sampling, the next writes the samples to ``--out`` (lines
``root;...;leaf microseconds``, frames as ``function (file:line)``, py-spy's raw format) and
stops. Usage: ``python bench/cpu_sampler.py --out X.raw -m uvicorn platform_site.asgi:app ...``.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
from collections import Counter
from types import FrameType

MAX_DEPTH = 80


def _stack(frame: FrameType | None) -> str:
    names = []
    while frame is not None and len(names) < MAX_DEPTH:
        code = frame.f_code
        names.append(f"{code.co_qualname} ({code.co_filename}:{frame.f_lineno})")
        frame = frame.f_back
    return ";".join(reversed(names))


class Sampler:
    def __init__(self, out: str, interval_s: float) -> None:
        self.out, self.interval_s = out, interval_s
        self.main = threading.main_thread().ident
        self.cpu: Counter[str] = Counter()  # stack -> CPU seconds
        self.last: dict[int, float] = {}
        self.on = False

    @staticmethod
    def _clock(ident: int) -> float:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))

    def sample(self, signum: int, frame: FrameType | None) -> None:
        frames = sys._current_frames()
        for ident, current in frames.items():
            try:
                now = self._clock(ident)
            except (OSError, OverflowError):  # the thread ended meanwhile
                continue
            before = self.last.get(ident)
            if before is not None and now > before:
                # The main thread runs this handler: its stack is the interrupted frame's.
                self.cpu[_stack(frame if ident == self.main else current)] += now - before
        for ident in frames:  # again, so the sampler's own time is nobody's
            try:
                self.last[ident] = self._clock(ident)
            except (OSError, OverflowError):
                self.last.pop(ident, None)

    def toggle(self, signum: int, frame: FrameType | None) -> None:
        if not self.on:
            self.cpu.clear()
            self.last.clear()
            self.on = True
            signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)
            return
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        self.on = False
        with open(self.out, "w") as f:
            for stack, seconds in self.cpu.items():
                f.write(f"{stack} {round(seconds * 1e6)}\n")


def main() -> None:
    args = sys.argv[1:]
    out, interval_ms = "cpu.raw", 1.0
    while args and args[0] != "-m":
        flag, value, args = args[0], args[1], args[2:]
        if flag == "--out":
            out = value
        elif flag == "--interval-ms":
            interval_ms = float(value)
        else:
            raise SystemExit(f"unknown option {flag}")
    if len(args) < 2:
        raise SystemExit("usage: cpu_sampler.py [--out F] [--interval-ms N] -m module [args]")
    module = args[1]
    sampler = Sampler(out, interval_ms / 1000)
    signal.signal(signal.SIGPROF, sampler.sample)
    signal.signal(signal.SIGUSR1, sampler.toggle)
    sys.argv = [module, *args[2:]]
    sys.path[0] = os.getcwd()  # as ``python -m`` would have it, not this script's folder
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
