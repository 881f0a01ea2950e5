"""The TileLang implementation of decode attention (``DecodeAttentionFwdInterface``), and its key
table ``KERNELS``, which ``DecodeAttentionFwdOp`` names.

``TileLangDecodeAttention`` runs split-KV flash decoding (``decode_programs``): the attend kernel
over a grid of (split, kv head, sequence), and, where the call is split, the merge kernel. Its
three programs (attend unsplit, attend split, merge) are compiled when the kernel is built, in
parallel, so that no call compiles or loads a module: a call may be the first one a CUDA graph
captures. The split count comes from the policy (``decode_policy``) and the call's shapes alone,
so the grid of a call shape never changes, whatever the lengths in ``cache_seqlens``. Importing
this module does not import tilelang; building a kernel does.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch

from tileops.core import Kernel, facts_for
from tileops.ops.attention import DecodeAttentionCall, DecodeAttentionFwdInterface

from ..compile import entry_function
from ..device import compile_target, current_device_index
from . import decode_policy as policy
from . import decode_programs as programs


class TileLangDecodeAttention(Kernel, DecodeAttentionFwdInterface):
    """Split-KV flash decoding for one (dtype, heads, head size, new tokens, page size, scale,
    causality, cache layout, key mask or none, device): float16 and bfloat16, head sizes in
    multiples of 32 up to 256."""

    def __init__(self, call: DecodeAttentionCall) -> None:
        super().__init__()
        self.call = call
        self.device = call.device
        self._device_index = call.device.index if call.device.index is not None else torch.cuda.current_device()
        facts = facts_for(torch.device("cuda", self._device_index))
        sm_count = facts.sm_count
        per_multiprocessor = (facts.shared_memory_per_sm, facts.registers_per_sm, facts.threads_per_sm)
        itemsize = call.dtype.itemsize
        target = compile_target(call.device)
        block_m = policy.block_rows(call.heads_q, call.heads_kv, call.new_tokens)
        stages = policy.stages(
            call.page_size, call.masked, target["arch"] == "sm_90", block_m, call.head_dim, itemsize,
            per_multiprocessor[0],
        )
        per_sm = policy.blocks_per_sm(block_m, call.head_dim, itemsize, *per_multiprocessor, stages=stages)
        self._resident = sm_count * per_sm
        self._position_bytes = 2 * call.head_dim * itemsize  # a key and a value
        self._split_cost = policy.split_bytes(call.heads_q, call.heads_kv, call.head_dim, call.new_tokens, itemsize)
        self.config = {"block_n": policy.BLOCK_N, "threads": policy.THREADS, "blocks_per_sm": per_sm, "stages": stages}
        self._splits: dict[tuple[int, int], int] = {}
        self._positions_at = 1 if call.cache_layout == "bshd" else 2  # of the caches' dimensions
        attend = (
            call.dtype, call.heads_q, call.heads_kv, call.head_dim, call.new_tokens, call.page_size, call.scale,
            call.causal, call.cache_layout, call.masked,
        )
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            whole = pool.submit(programs.compile_attend, *attend, target, split=False, **self.config)
            split = pool.submit(programs.compile_attend, *attend, target, split=True, **self.config)
            merge = pool.submit(programs.compile_merge, call.dtype, call.heads_q, call.head_dim, call.new_tokens, target)
            self._attend_whole = entry_function(whole.result())
            self._attend_split = entry_function(split.result())
            self._merge = entry_function(merge.result())

    @classmethod
    def refusal(cls, call: DecodeAttentionCall) -> str | None:
        return policy.refusal(call.dtype, call.heads_q, call.heads_kv, call.head_dim, call.new_tokens, call.aligned)

    @classmethod
    def entry_for(cls, call: DecodeAttentionCall):
        return call, lambda: cls(call)

    def splits_for(self, batch: int, capacity: int) -> int:
        """The split count of a call of ``batch`` sequences over caches of ``capacity`` positions."""
        key = (batch, capacity)
        count = self._splits.get(key)
        if count is None:
            count = self._splits[key] = policy.splits(
                batch, self.call.heads_kv, capacity, self._resident, self._position_bytes, self._split_cost
            )
        return count

    def forward(self, q, k_cache, v_cache, cache_seqlens, block_table, key_mask):
        batch, new_tokens, heads_q, head_dim = q.shape
        capacity = k_cache.shape[self._positions_at] * (1 if block_table is None else block_table.shape[1])
        count = self.splits_for(batch, capacity)
        o = torch.empty_like(q)
        lse = torch.empty((batch, heads_q, new_tokens), dtype=torch.float32, device=q.device)
        tensors: list[Any] = [q, k_cache, v_cache, cache_seqlens]
        if block_table is not None:
            tensors.append(block_table)
        if key_mask is not None:
            tensors.append(key_mask)
        if current_device_index() == self._device_index:
            self._launch(tensors, o, lse, count)
        else:
            # TileLang launches in the current device's context: make the call's device current.
            with torch.cuda.device(self._device_index):
                self._launch(tensors, o, lse, count)
        return o, lse

    def _launch(self, tensors: list, o: torch.Tensor, lse: torch.Tensor, count: int) -> None:
        if count == 1:
            self._attend_whole(*tensors, o, lse)
            return
        batch, new_tokens, heads_q, head_dim = o.shape
        o_part = torch.empty((count, batch, new_tokens, heads_q, head_dim), dtype=torch.float32, device=o.device)
        lse_part = torch.empty((count, batch, heads_q, new_tokens), dtype=torch.float32, device=o.device)
        self._attend_split(*tensors, o_part, lse_part)
        self._merge(o_part, lse_part, o, lse)


KERNELS = {DecodeAttentionFwdInterface: {"tilelang": TileLangDecodeAttention}}
