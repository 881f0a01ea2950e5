"""Decode attention's TileLang kernels without a GPU: the launch policy (which calls they take, the
blocks a multiprocessor holds, the split rule), the kernel class on CPU tensors with its programs
replaced (which launches a call makes, with which tensors), and the compile tier (each kernel
kind compiled for sm_90 in a fresh interpreter)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_python
from tileops.core.device_facts import DeviceFacts
from tileops.kernels.cuda.attention import decode as kernels
from tileops.kernels.cuda.attention import decode_policy as policy
from tileops.ops.attention import DecodeAttentionCall

CUDA = torch.device("cuda", 0)
#: The H200's: 132 multiprocessors, each holding 228 KiB of shared memory, 65536 registers and 2048 threads.
H200 = DeviceFacts("cuda", 90, 132, 227 * 1024, "NVIDIA H200", 228 * 1024, 65536, 2048)


def test_the_kernels_take_16_bit_calls_with_head_sizes_in_multiples_of_32_up_to_256_and_64_rows():
    assert policy.refusal(torch.bfloat16, 32, 8, 128, 1, True) is None
    assert policy.refusal(torch.float16, 64, 8, 256, 8, True) is None
    assert "float16 and bfloat16" in policy.refusal(torch.float32, 32, 8, 128, 1, True)
    assert "not 80" in policy.refusal(torch.bfloat16, 32, 8, 80, 1, True)
    assert "not 512" in policy.refusal(torch.bfloat16, 32, 8, 512, 1, True)
    assert "not 128" in policy.refusal(torch.bfloat16, 64, 8, 128, 16, True)  # 8 heads x 16 tokens: prefill's
    # Its loads are 16-byte vectors, the guarded ones too: an address off that grid would fault.
    assert "16-byte aligned" in policy.refusal(torch.bfloat16, 32, 8, 128, 1, False)
    assert [policy.block_rows(hq, hkv, s) for hq, hkv, s in [(32, 8, 1), (64, 8, 1), (64, 8, 3), (8, 8, 1)]] == [16, 16, 32, 16]


def test_blocks_per_multiprocessor_follow_shared_memory_and_registers():
    # D = 128, 16 rows: 38 KiB of shared memory (5 blocks in 228 KiB), 80 registers a thread (6).
    assert policy.shared_bytes(16, 128, 2) == 38912
    assert policy.blocks_per_sm(16, 128, 2, H200.shared_memory_per_sm) == 5
    # D = 256: 74 KiB, 3 blocks; 64 rows of D = 64: 32 KiB, but registers bind (144 a thread, 3 blocks).
    assert policy.blocks_per_sm(16, 256, 2, H200.shared_memory_per_sm) == 3
    assert policy.shared_bytes(64, 64, 2) == 32768 and policy.blocks_per_sm(64, 64, 2, H200.shared_memory_per_sm) == 3
    # D = 64: 7 by registers (72 a thread); with shared memory and registers to spare, thread
    # slots bind: 12 blocks of 128 threads on a multiprocessor of 1536 (sm_89), 16 on one of 2048.
    assert policy.blocks_per_sm(16, 64, 2) == 7
    assert policy.blocks_per_sm(16, 32, 2, 10**7, 10**7, 1536) == 12
    assert policy.blocks_per_sm(16, 32, 2, 10**7, 10**7, 2048) == 16


def test_whole_tiles_are_pipelined_where_no_mask_or_small_page_forbids_and_their_buffers_are_counted():
    def stages(page_size=0, masked=False, hopper=True, block_m=16, head_dim=128):
        return policy.stages(page_size, masked, hopper, block_m, head_dim, 2, H200.shared_memory_per_sm)

    assert stages() == policy.STAGES == 3
    assert stages(page_size=256) == stages(page_size=64) == 3
    assert stages(page_size=16) == 0  # pages smaller than a tile are gathered row by row
    assert stages(masked=True) == stages(page_size=256, masked=True) == 0  # hidden positions are not read
    assert stages(hopper=False) == 0  # TMA's pipeline is Hopper's
    # 64 rows of D 256: three stages would take 232 KiB, over the 227 a block may have.
    assert policy.shared_bytes(64, 256, 2, stages=3) + 1024 > H200.shared_memory_per_sm and stages(block_m=64, head_dim=256) == 2
    # D = 128, 16 rows: three stages of a key and a value tile, 102 KiB: 2 blocks in 228 KiB.
    assert policy.shared_bytes(16, 128, 2, stages=3) == 2 * (16 * 128 + 3 * 2 * 64 * 128 + 16 * 64) == 104448
    assert policy.shared_bytes(16, 128, 2, stages=1) == policy.shared_bytes(16, 128, 2)
    assert policy.blocks_per_sm(16, 128, 2, H200.shared_memory_per_sm, stages=3) == 2
    # D = 64: shared memory would take 4 blocks, but a pipelined block's producer warp group
    # doubles its threads, each with the 72 registers the estimate gives: 3 (7 guarded).
    per_sm = (H200.shared_memory_per_sm, H200.registers_per_sm, H200.threads_per_sm)
    assert policy.blocks_per_sm(16, 64, 2, *per_sm, stages=3) == 3 and policy.blocks_per_sm(16, 64, 2, *per_sm) == 7
    from tileops.kernels.cuda.attention import decode_programs as programs

    with pytest.raises(ValueError, match="key mask"):
        programs.make_attend_program(torch.bfloat16, 32, 8, 128, 1, 0, 0.1, True, "bshd", True,
                                     split=False, block_n=64, threads=128, blocks_per_sm=2, stages=3)
    with pytest.raises(ValueError, match="page size 16"):
        programs.make_attend_program(torch.bfloat16, 32, 8, 128, 1, 16, 0.1, True, "bshd", False,
                                     split=False, block_n=64, threads=128, blocks_per_sm=2, stages=3)


def test_splits_fill_one_wave_of_resident_blocks_and_no_more():
    resident = H200.sm_count * 5
    cost = policy.split_bytes(32, 8, 128, 1, 2)
    # q of 4 rows in bfloat16 and their partial o, lse in float32; the merge reads the partials.
    assert cost == (4 * 128 * 2 + 4 * 129 * 4, 4 * 129 * 4)
    position = 2 * 128 * 2  # a key and a value of 128 bfloat16 elements
    # One sequence of 32k: 8 kv heads x 82 splits = 656 blocks of the 660 the GPU holds.
    assert policy.splits(1, 8, 32768, resident, position, cost) == 82
    assert policy.splits(32, 8, 4096, resident, position, cost) == 2
    # B * Hkv fills the wave: unsplit; a short cache is cut into splits of at least a tile.
    assert policy.splits(128, 8, 4096, resident, position, cost) == 1
    assert policy.splits(1, 8, 1024, resident, position, cost) == 1024 // policy.BLOCK_N
    assert policy.splits(1, 8, 100, resident, position, cost) == 1
    # 64 rows of 256 columns carry 160 KiB of their own a split, still less than a block's share
    # of a 4k cache: one sequence fills the wave of 264 such blocks, 7 sequences fill it too.
    heavy, heavy_resident = policy.split_bytes(64, 8, 256, 8, 2), H200.sm_count * 2
    assert heavy == (64 * 256 * 2 + 64 * 257 * 4, 64 * 257 * 4)
    assert policy.splits(1, 8, 4097, heavy_resident, 1024, heavy) == 33
    assert policy.splits(7, 8, 4097, heavy_resident, 1024, heavy) == heavy_resident // 56
    assert policy.splits(32, 8, 4097, heavy_resident, 1024, heavy) == 1
    for batch in (1, 3, 7, 32, 64, 256):
        for capacity in (1, 1000, 4096, 131072):
            count = policy.splits(batch, 8, capacity, resident, position, cost)
            assert count >= 1 and (count == 1 or batch * 8 * count <= resident and capacity // count >= policy.BLOCK_N)


# -- the kernel class on CPU tensors ---------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Kernels built for cuda:0 of an H200's facts with their programs replaced, so that the
    production forward runs on CPU tensors; the list of (program, tensors) launched."""
    from tileops.kernels.cuda.attention import decode_programs as programs

    launched = []

    def compiled(name):
        return lambda *args, **config: (name, config.get("split"))

    def recorder(kernel):
        name, split = kernel
        label = name if split is None else f"{name}-{'split' if split else 'whole'}"
        return lambda *tensors: launched.append((label, tensors))

    monkeypatch.setattr(programs, "compile_attend", compiled("attend"))
    monkeypatch.setattr(programs, "compile_merge", compiled("merge"))
    monkeypatch.setattr(kernels, "entry_function", recorder)
    monkeypatch.setattr(kernels, "compile_target", lambda device: {"kind": "cuda", "arch": "sm_90"})
    monkeypatch.setattr(kernels, "facts_for", lambda device: H200)
    monkeypatch.setattr(kernels, "current_device_index", lambda: 0)
    return launched


def _call(page_size=0, new_tokens=1, cache_layout="bshd", masked=False, aligned=True):
    return DecodeAttentionCall(
        CUDA, torch.bfloat16, 32, 8, 128, new_tokens, page_size, 128**-0.5, True, cache_layout, masked, aligned
    )


def test_a_long_cache_of_few_sequences_is_split_and_merged(launches):
    kernel = kernels.TileLangDecodeAttention(_call())
    # Tiles copied whole in three stages: two blocks per multiprocessor (264 resident).
    assert kernel.config == {"block_n": 64, "threads": 128, "blocks_per_sm": 2, "stages": 3}
    q, k = torch.randn(1, 1, 32, 128).bfloat16(), torch.randn(1, 32768, 8, 128).bfloat16()
    seqlens = torch.tensor([20000], dtype=torch.int32)
    o, lse = kernel.forward(q, k, k, seqlens, None, None)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (1, 32, 1) and lse.dtype == torch.float32
    (attend, attended), (merge, merged) = launches
    assert attend == "attend-split" and merge == "merge"
    assert attended[:4] == (q, k, k, seqlens)
    o_part, lse_part = attended[4:]
    # 8 kv heads x 33 splits: the 264 blocks the GPU holds at once.
    assert o_part.shape == (33, 1, 1, 32, 128) and lse_part.shape == (33, 1, 32, 1) and o_part.dtype == torch.float32
    assert merged[0] is o_part and merged[1] is lse_part and merged[2] is o and merged[3] is lse


def test_a_batch_that_fills_the_gpu_runs_unsplit_and_a_paged_call_passes_its_block_table(launches):
    kernel = kernels.TileLangDecodeAttention(_call(page_size=16))
    assert kernel.config["stages"] == 0  # pages of 16 are gathered row by row
    q, pool = torch.randn(128, 1, 32, 128).bfloat16(), torch.randn(128 * 256, 16, 8, 128).bfloat16()
    seqlens, table = torch.full((128,), 4096, dtype=torch.int32), torch.zeros(128, 256, dtype=torch.int32)
    o, lse = kernel.forward(q, pool, pool, seqlens, table, None)
    ((attend, tensors),) = launches
    assert attend == "attend-whole" and tensors[:5] == (q, pool, pool, seqlens, table)
    assert tensors[5] is o and tensors[6] is lse
    # The split count of a call shape is kept: the same grid whatever the lengths are.
    assert kernel.splits_for(1, 4096) == policy.splits(1, 8, 4096, 660, 512, policy.split_bytes(32, 8, 128, 1, 2)) == kernel.splits_for(1, 4096)


def test_heads_first_caches_are_split_by_their_positions_the_third_dimension(launches):
    # transformers' caches (B, Hkv, L, D): the split rule reads the capacity from dimension 2,
    # so the call splits as the same cache in the bshd layout does (82 splits at 32k). Masked,
    # as transformers' static cache's decode steps are.
    kernel = kernels.TileLangDecodeAttention(_call(cache_layout="bhsd", masked=True))
    # A key mask keeps the guarded loads: no stage buffers, five blocks per multiprocessor.
    assert kernel.config == {"block_n": 64, "threads": 128, "blocks_per_sm": 5, "stages": 0}
    q, k = torch.randn(1, 1, 32, 128).bfloat16(), torch.randn(1, 8, 32768, 128).bfloat16()
    mask = torch.ones(1, 32768, dtype=torch.bool)
    kernel.forward(q, k, k, torch.tensor([20000], dtype=torch.int32), None, mask)
    (attend, attended), _ = launches
    # The key mask follows the lengths, before the outputs.
    assert attend == "attend-split" and attended[4] is mask and attended[5].shape == (82, 1, 1, 32, 128)


def test_gpus_before_hopper_keep_the_guarded_loads(launches, monkeypatch):
    monkeypatch.setattr(kernels, "compile_target", lambda device: {"kind": "cuda", "arch": "sm_80"})
    kernel = kernels.TileLangDecodeAttention(_call())
    assert kernel.config == {"block_n": 64, "threads": 128, "blocks_per_sm": 5, "stages": 0}


def test_refusals_leave_float32_odd_head_sizes_and_unaligned_calls_to_the_plain_torch_implementation():
    assert kernels.TileLangDecodeAttention.refusal(_call()) is None
    odd = DecodeAttentionCall(CUDA, torch.bfloat16, 32, 8, 80, 1, 0, 0.1, True, "bshd", False, True)
    wide = DecodeAttentionCall(CUDA, torch.float32, 32, 8, 128, 1, 0, 0.1, True, "bhsd", True, True)
    assert "not 80" in kernels.TileLangDecodeAttention.refusal(odd)
    assert "float32" in kernels.TileLangDecodeAttention.refusal(wide)
    assert "16-byte aligned" in kernels.TileLangDecodeAttention.refusal(_call(aligned=False))


# -- the compile tier ----------------------------------------------------------------------------

COMPILE = """
import torch
from tileops.kernels.cuda.attention import decode_programs as programs
target = {"kind": "cuda", "arch": "sm_90"}
# One build per kind: attend over a contiguous cache (split, whole tiles in a pipeline), attend
# over a paged one (unsplit, guarded loads: pages of 16, several causal new tokens, another dtype
# and head size, heads-first pages as transformers' caches hold them, a key mask), and the merge.
builds = [
    ("attend", programs.compile_attend(torch.bfloat16, 32, 8, 128, 1, 0, 128**-0.5, True, "bshd", False, target,
                                       split=True, block_n=64, threads=128, blocks_per_sm=2, stages=3)),
    ("attend_paged", programs.compile_attend(torch.float16, 64, 8, 64, 3, 16, 0.125, True, "bhsd", True, target,
                                             split=False, block_n=64, threads=128, blocks_per_sm=3, stages=0)),
    ("merge", programs.compile_merge(torch.bfloat16, 32, 128, 1, target)),
]
for name, kernel in builds:
    source = kernel.get_kernel_source()
    body = source[source.index("__launch_bounds__"):]
    print(name, body[:body.index(")") + 1], "mma_sync" in body, "block_table" in body, "key_mask" in body, "exp2f" in body,
          "tma_load" in body)
"""


@pytest.mark.compile
def test_each_kernel_kind_compiles_for_sm90(tmp_path):
    result = run_python(COMPILE, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["attend"], ["attend_paged"], ["merge"])]
    # name, launch bounds (threads, blocks per multiprocessor), tensor-core MMAs, block table,
    # key mask, exp2, tiles copied by TMA
    assert lines == [
        ["attend", "__launch_bounds__(256,", "2)", "True", "False", "False", "True", "True"],  # + a producer warp group
        ["attend_paged", "__launch_bounds__(128,", "3)", "True", "True", "True", "True", "False"],
        ["merge", "__launch_bounds__(128,", "1)", "False", "False", "False", "True", "False"],
    ], result.stdout[-3000:]
