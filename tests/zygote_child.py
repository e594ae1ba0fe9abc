"""A stand-in for the server in tests/test_zygote.py: says how it was started, then waits for
SIGTERM. Its import takes `ZYGOTE_TEST_IMPORT_S` seconds (none by default), as vLLM's takes many."""

import json
import os
import signal
import sys
import time

time.sleep(float(os.environ.get("ZYGOTE_TEST_IMPORT_S", "0")))

if __name__ == "__main__":
    def ended(signum: int, frame: object) -> None:
        print("terminated", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, ended)
    umask = os.umask(0)
    print(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "pid": os.getpid(), "ppid": os.getppid(),
                      "pgid": os.getpgid(0), "sid": os.getsid(0), "cwd": os.getcwd(), "path0": sys.path[0],
                      "main": sys.modules["__main__"].__spec__.name, "umask": umask,
                      "nice": os.getpriority(os.PRIO_PROCESS, 0),
                      "fds": [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                              if os.path.lexists(f"/proc/self/fd/{fd}")]}), flush=True)  # not the listing's own
    time.sleep(120)
