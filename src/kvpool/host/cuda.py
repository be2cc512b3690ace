"""Registering a mapped arena with CUDA as pinned host memory, through torch.

Device copies from pageable memory go through a bounce buffer in the driver; from registered
(pinned) memory the GPU's DMA engine reads the arena directly, at full link speed, and
``non_blocking=True`` copies become truly asynchronous. Only when torch is already imported
(an engine's process: the core never imports torch) and sees a device; otherwise nothing
happens. Failure contract: a registration CUDA refuses is logged once and the arena stays
pageable (copies still work, slower); never raises.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)


def _cudart() -> Any | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        return torch.cuda.cudart()
    except Exception:  # a broken CUDA install: stay pageable
        return None


def register_host_memory(address: int, nbytes: int) -> bool:
    """cudaHostRegister(address, nbytes, cudaHostRegisterPortable: pinned for every CUDA
    context of the process, as torch's own pin_memory does); True if registered."""
    cudart = _cudart()
    if cudart is None:
        return False
    try:
        err = cudart.cudaHostRegister(address, nbytes, 1)  # cudaHostRegisterPortable
    except Exception as exc:
        log.warning("cudaHostRegister of the host arena failed: %s", exc)
        return False
    if int(getattr(err, "value", err)) != 0:
        log.warning("cudaHostRegister of the host arena returned %s: device copies from "
                    "it stay pageable", err)
        return False
    return True


def unregister_host_memory(address: int) -> None:
    """cudaHostUnregister, before the mapping goes away; never raises."""
    cudart = _cudart()
    if cudart is not None:
        try:
            cudart.cudaHostUnregister(address)
        except Exception as exc:
            log.warning("cudaHostUnregister of the host arena failed: %s", exc)
