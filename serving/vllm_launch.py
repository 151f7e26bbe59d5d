"""``python -m batchpilot.serving.vllm_launch ARGS``: vLLM's OpenAI API server (what
``python -m vllm.entrypoints.openai.api_server ARGS`` runs), with AMX permission asked first.

The request is at import, not in ``main``: vLLM on CPU starts its engine-core and worker
processes with multiprocessing's *spawn*, and a spawned child imports its parent's main
module (as ``__mp_main__``) before anything else, so every process of the server asks for
itself (``request_amx_permission``: the permission does not survive exec, and vLLM's attention
needs it on AMX CPUs).
"""

from __future__ import annotations

from batchpilot.platform.vllm_cpu import request_amx_permission

request_amx_permission()


def main() -> None:
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    serve()


if __name__ == "__main__":
    main()
