"""The model of PyTorch's CUDA caching allocator, on sequences worked out by hand from its documented rules."""

from __future__ import annotations

import pytest
from torch import nn

from gradaccum import allocator, trace
from gradaccum.allocator import MIB, CachingAllocator, replay


def test_the_constants_are_the_caching_allocators() -> None:
    """c10/cuda/CUDACachingAllocator.cpp (kMinBlockSize, kSmallSize, kSmallBuffer, kMinLargeAlloc, kLargeBuffer,
    kRoundLarge), as ../shared/gpu-memory-facts.md quotes them."""
    assert (allocator.MIN_BLOCK, allocator.SMALL_SIZE, allocator.SMALL_BUFFER) == (512, MIB, 2 * MIB)
    assert (allocator.MIN_LARGE_ALLOC, allocator.LARGE_BUFFER, allocator.ROUND_LARGE) == (10 * MIB, 20 * MIB, 2 * MIB)


def test_sizes_round_up_to_512_bytes() -> None:
    assert [allocator.round_size(n) for n in (0, 1, 512, 513, 1536)] == [512, 512, 512, 1024, 1536]


def test_small_requests_share_a_2_mib_segment() -> None:
    a = replay([("malloc", "a", 1000), ("malloc", "b", 1000)])
    assert (a.allocated, a.reserved, a.segments) == (2048, 2 * MIB, 1)


def test_three_1_mib_requests_fill_one_small_segment_and_open_a_second() -> None:
    a = replay([("malloc", k, MIB) for k in "abc"])  # 1 MiB is still small; two fit a 2 MiB segment exactly
    assert (a.allocated, a.reserved, a.segments) == (3 * MIB, 4 * MIB, 2)


def test_a_request_over_1_mib_gets_a_20_mib_segment_that_later_ones_share() -> None:
    a = replay([("malloc", "a", MIB + 1), ("malloc", "b", 5 * MIB), ("malloc", "c", 9 * MIB)])
    assert a.reserved == 20 * MIB and a.segments == 1
    assert a.allocated == MIB + 512 + 14 * MIB
    a.malloc("d", 5 * MIB)  # 20 - 15 MiB - 512 B left: too small
    assert a.reserved == 40 * MIB and a.segments == 2


def test_from_10_mib_a_request_gets_its_own_segment_rounded_to_2_mib() -> None:
    a = replay([("malloc", "a", 10 * MIB), ("malloc", "b", 11 * MIB)])
    assert a.reserved == 10 * MIB + 12 * MIB and a.segments == 2


def test_a_freed_block_is_cached_and_reused_whole_when_the_rest_is_1_mib_or_less() -> None:
    a = replay([("malloc", "a", 12 * MIB), ("free", "a", 0), ("malloc", "b", 11 * MIB)])
    assert a.reserved == 12 * MIB and a.segments == 1  # nothing returned to the driver, nothing new asked
    assert a.allocated == 12 * MIB  # the whole block: the 1 MiB rest is not split off


def test_best_fit_takes_the_smallest_free_block_that_holds_the_request() -> None:
    a = replay([("malloc", "big", 30 * MIB), ("malloc", "mid", 14 * MIB), ("free", "big", 0), ("free", "mid", 0)])
    block = a.malloc("c", 13 * MIB)
    assert block.segment == 1 and a.reserved == 44 * MIB


def test_freed_neighbours_merge_so_a_larger_request_fits_the_segment_again() -> None:
    events = [("malloc", "a", 2 * MIB), ("malloc", "b", 2 * MIB), ("free", "a", 0), ("free", "b", 0)]
    a = replay([*events, ("malloc", "c", 19 * MIB)])
    assert a.reserved == 20 * MIB and a.segments == 1  # without merging, 19 MiB would need a segment of its own


def test_the_pools_are_separate() -> None:
    a = replay([("malloc", "large", 12 * MIB), ("free", "large", 0), ("malloc", "small", 4096)])
    assert a.reserved == 14 * MIB and a.segments == 2


def test_allocated_has_a_high_water_mark_and_reserved_only_grows() -> None:
    a = replay([("malloc", "a", 12 * MIB), ("free", "a", 0), ("malloc", "b", 1000)])
    assert (a.peak_allocated, a.allocated) == (12 * MIB, 1024)
    assert a.peak_reserved == a.reserved == 14 * MIB  # the freed 12 MiB segment stays cached


def test_a_fresh_allocator_each_replay() -> None:
    replay([("malloc", "a", 1000)])
    assert CachingAllocator().reserved == 0 and replay([]).segments == 0


def test_a_step_is_replayed_after_the_resident_tensors_and_the_cublas_workspaces() -> None:
    """A 1000-byte weight (small pool), then a step that takes and frees 12 MiB: allocated peaks at the
    rounded weight, the two 32 MiB cuBLAS workspaces and the 12 MiB; reserved holds a 2 MiB small segment,
    the workspaces' own segments and the 12 MiB segment, which the second round reuses; nvidia-smi adds the
    assumed context."""
    gpu = allocator.predict_gpu([("malloc", "w", 1000)], [("malloc", "a", 12 * MIB), ("free", "a", 0)])
    workspaces = allocator.CUBLAS_WORKSPACES * allocator.CUBLAS_WORKSPACE
    assert gpu["gpu_allocated_mib"] * MIB == 1024 + workspaces + 12 * MIB
    assert gpu["gpu_reserved_mib"] * MIB == 2 * MIB + workspaces + 12 * MIB
    assert gpu["gpu_nvidia_smi_mib"] * MIB == gpu["gpu_reserved_mib"] * MIB + allocator.CUDA_CONTEXT
    assert gpu["gpu_context_mib"] == 500


def test_what_a_step_frees_of_the_resident_tensors_is_made_again_before_the_next_round() -> None:
    """A window's gradients (12 MiB), freed at its end and made again by the next window's first backward:
    the second round finds both 12 MiB segments cached and reserves nothing more; allocated never holds
    two copies of the gradients."""
    step = [("malloc", "t", 12 * MIB), ("free", "t", 0), ("free", "g", 0)]
    gpu = allocator.predict_gpu([("malloc", "g", 12 * MIB)], step, rounds=3)
    workspaces = allocator.CUBLAS_WORKSPACES * allocator.CUBLAS_WORKSPACE
    assert gpu["gpu_reserved_mib"] * MIB == 24 * MIB + workspaces
    assert gpu["gpu_allocated_mib"] * MIB == 24 * MIB + workspaces


def test_a_traced_linear_step_replays_to_the_hand_count_rounded() -> None:
    """The linear model of tests/test_trace.py, micro-batch 1, traced under CUDA's rules: its peak (AdamW's
    step as CUDA runs it, foreach: weight, gradient, two moments and one temporary, the second moments' square
    roots, of 3,136,000 bytes each, the 4-byte step counter and 784,000 bytes of data) rounded to 512 bytes each,
    plus the workspaces, is the predicted allocated peak. Reserved: one 20 MiB segment holds all five
    weight-sized blocks, one 2 MiB small segment the counter and the data, and the workspaces their own."""
    weight = 784 * 1000 * 4
    build = lambda: nn.Sequential(nn.Flatten(), nn.Linear(784, 1000, bias=False))  # noqa: E731
    r = trace.trace_step(
        trace.TracedStep(build=build, micro=1, accum=1, num_classes=10, dtype=None, resident=1000), policy="cuda"
    )
    workspaces = allocator.CUBLAS_WORKSPACES * allocator.CUBLAS_WORKSPACE
    assert r["peak_mib"] * MIB == 5 * weight + 4 + 784_000  # the live tensors, unrounded
    assert r["gpu_allocated_mib"] * MIB == 5 * weight + 512 + 784_384 + workspaces
    assert r["gpu_reserved_mib"] * MIB == 20 * MIB + 2 * MIB + workspaces
    assert "gpu_reserved_mib" not in trace.trace_step(
        trace.TracedStep(build=build, micro=1, accum=1, num_classes=10, dtype=None, resident=1000), policy="cpu"
    )  # CUDA's only


def test_a_full_card_frees_the_cached_segments_and_retries() -> None:
    """Capacity 40 MiB: a freed 20 MiB segment stays cached; a 30 MiB request finds no cached block that holds it,
    and a new segment would reserve 50 MiB, so the allocator releases the unused 20 MiB segment and retries:
    reserved 30 MiB, one retry. On an endless card the same requests reserve 50 MiB."""
    events = [("malloc", "a", 20 * MIB), ("free", "a", 0), ("malloc", "b", 30 * MIB)]
    full = replay(events, CachingAllocator(capacity=40 * MIB))
    assert (full.reserved, full.peak_reserved, full.cache_frees, full.segments) == (30 * MIB, 30 * MIB, 1, 2)
    endless = replay(events)
    assert (endless.reserved, endless.cache_frees) == (50 * MIB, 0)


def test_a_segment_holding_a_live_block_is_kept_and_the_step_is_out_of_memory() -> None:
    """The same with the 20 MiB tensor still live: nothing can be released, so 50 MiB > 40 is out of memory; and a
    20 MiB segment split by a live 2 MiB block is not released either (release_cached_blocks frees whole ones)."""
    with pytest.raises(allocator.OutOfMemory):
        replay([("malloc", "a", 20 * MIB), ("malloc", "b", 30 * MIB)], CachingAllocator(capacity=40 * MIB))
    split = [("malloc", "a", 2 * MIB), ("malloc", "c", 2 * MIB), ("free", "c", 0), ("malloc", "b", 30 * MIB)]
    with pytest.raises(allocator.OutOfMemory):
        replay(split, CachingAllocator(capacity=40 * MIB))
    assert replay(split, CachingAllocator(capacity=50 * MIB)).cache_frees == 0  # 20 + 30: room without freeing


def test_a_step_whose_reserved_peak_exceeds_the_card_fits_when_its_allocated_peak_does() -> None:
    """allocator.on_card: the card less the context is what the segments may take. The two 1 MiB workspaces share
    a 2 MiB small segment; the step's 30 MiB tensor is freed before its 40 MiB one is made, so on an endless card
    it reserves 2 + 30 + 40 = 72 MiB (82 in nvidia-smi with 10 MiB of context). A 60 MiB card leaves 50: the
    cached 30 MiB segment goes back for the 40 MiB one (42 reserved), and the second round reuses the 40 MiB
    segment for both. A 45 MiB card leaves 35, under 2 + 40: out of memory."""
    gpu = allocator.Gpu("test", 1, cublas_workspace=MIB, context=10 * MIB)
    step = [("malloc", "x", 30 * MIB), ("free", "x", 0), ("malloc", "y", 40 * MIB), ("free", "y", 0)]
    endless = allocator.predict_gpu([], step, gpu=gpu)
    assert endless["gpu_reserved_mib"] == 72 and endless["gpu_nvidia_smi_mib"] == 82
    room = allocator.on_card([], step, 82.0, gpu=gpu)
    assert room == {"usable_mib": 82, "fits": True, "reserved_mib": 72, "nvidia_smi_mib": 82, "cache_frees": 0}
    tight = allocator.on_card([], step, 60.0, gpu=gpu)
    assert tight == {"usable_mib": 60, "fits": True, "reserved_mib": 42, "nvidia_smi_mib": 52, "cache_frees": 1}
    assert allocator.on_card([], step, 45.0, gpu=gpu) == {"usable_mib": 45, "fits": False}
