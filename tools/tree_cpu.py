"""Run a command as a child subreaper and print the wall and CPU seconds of its whole process tree.

``/usr/bin/time`` counts a descendant's CPU only when its own parent waited for it. A process re-parented
away (an orphan) is lost. As a subreaper this script adopts every orphan of the tree and reaps it, so
their CPU counts too. Usage::

    python tools/tree_cpu.py TAG python -m pytest -q -n 2 tests
    # last line on stderr: "TAG wall 496.6 s cpu 911.2 s (user 772.8 sys 138.4) rc 0"
"""

import ctypes
import os
import resource
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    tag, argv = sys.argv[1], sys.argv[2:]
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    t0 = time.time()
    pid = os.fork()
    if pid == 0:
        os.execvp(argv[0], argv)
    rc = None
    while True:  # the command, then every orphan it left behind
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if reaped == pid:
            rc = os.waitstatus_to_exitcode(status)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = f"cpu {ru.ru_utime + ru.ru_stime:.1f} s (user {ru.ru_utime:.1f} sys {ru.ru_stime:.1f})"
    print(f"{tag} wall {time.time() - t0:.1f} s {cpu} rc {rc}", file=sys.stderr)
    return rc if rc is not None else 1


if __name__ == "__main__":
    sys.exit(main())
