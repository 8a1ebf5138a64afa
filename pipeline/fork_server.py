"""Imported by the DataLoader fork server alone (the last of `signals.worker_context`'s preload modules),
never by a rank: the server leaves without the interpreter's teardown.

The server ends when its rank has (it reads EOF), and the rank's caller (a launcher, a test, a shell
reading the job's output) waits for it, since it holds the rank's stdout and stderr. Having imported
torch, torchvision and timm, its teardown (collecting and freeing every module's objects) took about 1 s of
CPU per rank and run, for nothing: it has no files to flush, no children of its own to join (the workers
it forked each exit on their own, with os._exit), no state. Workers inherit this handler and never run it
(multiprocessing ends a forked child with os._exit)."""

import atexit
import os
import sys


def _leave() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


atexit.register(_leave)  # registered last of the server's handlers: atexit runs it first
