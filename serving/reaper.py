"""``python -m batchpilot.serving.reaper PARENT_PID -- CMD ...``: run a managed ``vllm serve``
so that it never outlives the gateway.

The gateway starts this as the leader of a new process group; it starts ``CMD`` as its child in
that group (vLLM's engine-core processes join it too) and waits. When the gateway is gone
however it ended (SIGKILL and crashes included: it is then no longer this process's parent),
the whole group gets SIGTERM, then SIGKILL. A SIGTERM to the group (the gateway stopping its
engine) is left to vLLM's own shutdown; this process exits with vLLM's status once it has.
Without it, a gateway killed mid-restart left ``vllm serve`` running, holding the device.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

#: The name of a managed engine's own folder for vLLM's sockets (``ManagedVLLM._launch`` makes
#: it); only a folder named so is removed here.
IPC_DIR_PREFIX = "bp-vllm-ipc-"
#: How often the parent is checked, and how long vLLM gets to stop before SIGKILL.
POLL_S = 0.5
GRACE_S = 10.0


def _end_group(child: subprocess.Popen) -> int:
    pgid = os.getpgrp()
    os.killpg(pgid, signal.SIGTERM)
    try:
        child.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _remove_ipc_dir()  # the gateway that would have is gone
    os.killpg(pgid, signal.SIGKILL)  # ends this process too
    return 1


def _remove_ipc_dir() -> None:
    """The engine's socket folder (``ManagedVLLM._launch``), if it is one of the gateway's."""
    path = os.environ.get("VLLM_RPC_BASE_PATH", "")
    if os.path.basename(path).startswith(IPC_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m batchpilot.serving.reaper PARENT_PID -- CMD ...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    signal.signal(signal.SIGTERM, lambda *_: None)  # the group's SIGTERM is for vLLM; wait for it
    child = subprocess.Popen(argv[2:])
    while True:
        try:
            code = child.wait(POLL_S)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:
            return _end_group(child)
        time.sleep(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
