"""Each action is an attack a tenant's code could try on the node; the report says how far it
got (the test asserts it got nowhere)."""

import glob
import os
import socket
import sys
import time

import numpy as np


def hunt(secret):
    """Where on the node the worker can read ``secret`` (the node's token)."""
    found = [k for k, v in os.environ.items() if secret in v]
    for path in glob.glob("/proc/[0-9]*/cmdline") + glob.glob("/proc/[0-9]*/environ"):
        try:
            if secret.encode() in open(path, "rb").read():
                found.append(path)
        except OSError:
            pass
    pythons = (sys.base_prefix, sys.prefix)  # the interpreter and the environment: public code
    for top in ("/etc", "/tmp", "/root", "/var", "/home", os.getcwd(), os.environ["HOME"]):
        for folder, folders, files in os.walk(top):
            folders[:] = [f for f in folders if os.path.join(folder, f) not in pythons]
            for name in files:
                path = os.path.join(folder, name)
                try:
                    with open(path, "rb") as handle:
                        if secret.encode() in handle.read(1 << 20):
                            found.append(path)
                except OSError:
                    pass
    return "found: " + ", ".join(found) if found else "not found"


def attempt(action, argument):
    if action == 0:
        return "ok"
    if action == 1:
        return " ".join(sorted(os.environ))
    if action == 2:
        return hunt(argument)
    if action == 3:  # fork bomb
        forks = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                forks += 1
        except OSError as exc:
            return f"forks stopped after {forks}: {exc.strerror}"
    if action == 4:  # 10 GiB
        return str(len(bytearray(10 << 30)))
    if action == 5:  # sleep forever
        while True:
            time.sleep(1)
    if action == 6:  # write outside the scratch folder (and inside it)
        results = []
        for folder in argument.split(","):
            path = os.path.join(folder, "hostile-was-here")
            try:
                with open(path, "w") as handle:
                    handle.write("x")
                results.append(f"wrote {path}")
            except OSError as exc:
                results.append(f"refused {path}: {exc.strerror}")
        return "; ".join(results)
    if action == 7:  # the network
        host, port = argument.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return "connected"
        except OSError as exc:
            return f"refused: {exc}"
    if action == 8:  # crash
        os._exit(3)
    if action == 9:
        raise ValueError("the handler raised on purpose")
    return "unknown action"


class Hostile:
    def predict(self, batch):
        reports = [
            attempt(int(action), argument.decode())
            for action, argument in zip(batch["action"], batch["argument"], strict=True)
        ]
        return {"report": np.array(reports, dtype=object)}
