"""Loads with an L2 eviction priority, for the programs that read their input twice and want the
second read served by L2: whether the target has them, and their CUDA source.

A program that imports ``PRIORITY_LOADS`` (``T.import_source``) calls
``tileops_load_evict_last(dst, src)`` or ``tileops_load_evict_first(dst, src)`` through
``T.call_extern``: one 16-byte global load (``dst`` and ``src`` 16-byte aligned) with that
priority in L1 and in L2. The first pass over a row loads it "evict last", the second "evict
first", so that the rows in flight between the two passes stay in L2 ahead of the lines
already read twice.
"""

from __future__ import annotations

import json
import re

import torch


def has_cache_priorities(target: str | dict) -> bool:
    """Whether ``target``'s GPU has L2 cache-policy loads (``createpolicy``: sm_80 and later).

    The architecture comes from the target (``{"arch": "sm_90"}``, ``-arch=sm_90``); a bare
    ``"cuda"`` means the current GPU, as TileLang reads it.
    """
    found = re.search(r"sm_(\d+)", json.dumps(target) if isinstance(target, dict) else str(target))
    if found:
        return int(found.group(1)) >= 80
    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 8


def _priority_load(priority: str) -> str:
    """CUDA source of tileops_load_<priority>(dst, src)."""
    return f"""
template <typename T>
__device__ __forceinline__ void tileops_load_{priority}(T* dst, const T* src) {{
  uint4 v;
  unsigned long long policy;
  asm("createpolicy.fractional.L2::{priority}.b64 %0, 1.0;" : "=l"(policy));
  asm("ld.global.L1::{priority}.L2::cache_hint.v4.u32 {{%0, %1, %2, %3}}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src), "l"(policy));
  *reinterpret_cast<uint4*>(dst) = v;
}}
"""


#: The CUDA source of both loads, for ``T.import_source``.
PRIORITY_LOADS = _priority_load("evict_last") + _priority_load("evict_first")
