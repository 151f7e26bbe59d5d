"""``HardwareSpec`` and ``ModelSpec`` (declared in ``batchpilot.core.specs``, where
``batchpilot/schemas/`` can store them as the ``hardware`` and ``model`` groups' schemas)."""

from __future__ import annotations

from batchpilot.core.specs import INT8_SCALE_BYTES, HardwareSpec, ModelSpec, is_8bit, kv_elem_bytes

__all__ = ["INT8_SCALE_BYTES", "HardwareSpec", "ModelSpec", "is_8bit", "kv_elem_bytes"]
