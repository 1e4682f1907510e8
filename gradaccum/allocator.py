"""A model of PyTorch's CUDA caching allocator: what `torch.cuda.max_memory_reserved` is for a sequence of
allocations and frees, from the rules of c10/cuda/CUDACachingAllocator.cpp (torch 2.14.1; the constants
are pinned in tests/test_allocator.py against the ones ../shared/gpu-memory-facts.md quotes).

- every request is rounded up to a multiple of 512 bytes (kMinBlockSize);
- requests of 1 MiB or less (kSmallSize) come from the small pool, carved out of 2 MiB segments
  (kSmallBuffer); larger ones from the large pool: under 10 MiB (kMinLargeAlloc) a 20 MiB segment
  (kLargeBuffer), from 10 MiB a segment of their own size rounded up to 2 MiB (kRoundLarge);
- a request takes the smallest cached free block of its pool that holds it (best fit), split when the rest
  is large enough to reuse (at least 512 bytes in the small pool, more than 1 MiB in the large one);
- a freed block goes back to its pool, merged with free neighbours of its segment; segments are returned to
  the driver only when a new one cannot be had: given a `capacity` (what the card leaves PyTorch), a segment that
  would take reserved memory past it first makes the allocator free every cached segment that holds no live
  block (`release_cached_blocks`, which releases the free blocks that are not split) and try again, and only if
  it still does not fit is the step out of memory (DeviceCachingAllocator::malloc: `alloc_block`, then
  `release_available_cached_blocks`, a no-op unless max_split_size_mb is set, then `release_cached_blocks` and
  `alloc_block` again). Without a capacity the card is endless and reserved memory only grows.

Not modelled: `max_split_size_mb`, `expandable_segments`, garbage_collection_threshold, and the per-stream
pools (one stream here).

On top of the allocator, nvidia-smi shows what PyTorch does not allocate; `predict_gpu` adds it as stated
assumptions (GPU_ASSUMPTIONS), each with its source, for the first GPU run to confirm or correct.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MIB  # kSmallSize: largest "small" request
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: a small-pool segment
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: from here a request gets a segment of its own
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: the segment a 1-10 MiB request gets
ROUND_LARGE = 2 * MIB  # kRoundLarge


def round_size(size: int) -> int:
    """round_size: up to a multiple of 512 bytes (at least 512)."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """get_allocation_size: the segment a rounded request that no cached block holds makes the allocator reserve."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class Block:
    segment: int
    offset: int
    size: int
    free: bool = True


class OutOfMemory(RuntimeError):
    """A segment the card cannot hold even after the allocator freed its cache: torch.cuda.OutOfMemoryError."""


@dataclass
class CachingAllocator:
    """Replays allocations and frees; `allocated` and `reserved` (and their peaks) as torch.cuda reports them.
    `capacity`: the bytes the card leaves for segments (None: endless); `cache_frees` counts the times a full card
    made it free its cached segments and retry, as torch.cuda.memory_stats()'s num_alloc_retries does."""

    capacity: int | None = None
    cache_frees: int = 0
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: int = 0
    _blocks: dict[int, list[Block]] = field(default_factory=dict)  # per segment, by offset
    _small: dict[int, bool] = field(default_factory=dict)  # segment -> in the small pool
    _live: dict[object, Block] = field(default_factory=dict)  # a request's key -> its block

    def malloc(self, key: object, size: int) -> Block:
        """Serve request `key` of `size` bytes: a cached block if one fits (best fit, split), else a new segment."""
        size = round_size(size)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small)
        if block is None:
            total = segment_size(size)
            if self.capacity is not None and self.reserved + total > self.capacity:
                self.cache_frees += 1
                self._release_cached()
                if self.reserved + total > self.capacity:
                    raise OutOfMemory(f"a {total / MIB:.0f} MiB segment past {self.capacity / MIB:.0f} MiB")
            segment = self.segments
            self.segments += 1
            block = Block(segment, 0, total)
            self._blocks[segment], self._small[segment] = [block], small
            self.reserved += total
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:  # should_split
            blocks = self._blocks[block.segment]
            blocks.insert(blocks.index(block) + 1, Block(block.segment, block.offset + size, rest))
            block.size = size
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def is_live(self, key: object) -> bool:
        return key in self._live

    def free(self, key: object) -> None:
        """Return request `key`'s block to its pool, merged with its free neighbours in the segment."""
        block = self._live.pop(key)
        self.allocated -= block.size
        block.free = True
        blocks = self._blocks[block.segment]
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:
            block.size += blocks.pop(i + 1).size
        if i > 0 and blocks[i - 1].free:
            blocks[i - 1].size += blocks.pop(i).size

    def _release_cached(self) -> None:
        """release_cached_blocks: every segment that is one free block (no live block, none split off) goes back."""
        for segment, blocks in list(self._blocks.items()):
            if len(blocks) == 1 and blocks[0].free:
                self.reserved -= blocks[0].size
                del self._blocks[segment], self._small[segment]

    def _best_fit(self, size: int, small: bool) -> Block | None:
        """The smallest free block of the pool that holds `size` (ties: the lower segment, then offset)."""
        fits = [
            (b.size, b.segment, b.offset, b)
            for segment, blocks in self._blocks.items()
            if self._small[segment] == small
            for b in blocks
            if b.free and b.size >= size
        ]
        return min(fits, key=lambda f: f[:3])[3] if fits else None


# What a GPU adds that no trace sees, as assumptions with their sources (the report prints them).
CUBLAS_WORKSPACE = 32 * MIB  # sm90 and later (H100, H200); 8.125 MiB before (4096 KiB x 2 + 16 KiB x 8)
CUBLAS_WORKSPACE_BEFORE_SM90 = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLAS_WORKSPACES = 2  # one per (cuBLAS handle, stream): the forward's thread and autograd's device thread
# cuDNN's workspace is not modelled: chosen per convolution at run time, freed after it.
CUDA_CONTEXT = 500 * MIB  # driver, kernels, cuDNN/cuBLAS handles: outside PyTorch's allocator


@dataclass(frozen=True)
class Gpu:
    """What differs between GPUs that the prediction uses: the card's size (GiB, as nvidia-smi's MiB / 1024), its
    architecture (compute capability: the attention kernel CUDA picks, gradaccum/attention.py) and that
    architecture's cuBLAS workspace, and the CUDA context (the same assumption on every card)."""

    name: str
    memory_gib: float
    cublas_workspace: int = CUBLAS_WORKSPACE
    context: int = CUDA_CONTEXT
    sm: tuple[int, int] = (9, 0)


GPUS = {  # --gpu NAME in gradaccum.fit; the study's figures are the H100's
    "h100": Gpu("H100 80GB (sm90)", 80),
    "h200": Gpu("H200 141GB (sm90)", 141),
    "a100-40gb": Gpu("A100 40GB (sm80)", 40, CUBLAS_WORKSPACE_BEFORE_SM90, sm=(8, 0)),
    "a100-80gb": Gpu("A100 80GB (sm80)", 80, CUBLAS_WORKSPACE_BEFORE_SM90, sm=(8, 0)),
    "a10": Gpu("A10 24GB (sm86)", 24, CUBLAS_WORKSPACE_BEFORE_SM90, sm=(8, 6)),
    "l4": Gpu("L4 24GB (sm89)", 24, CUBLAS_WORKSPACE_BEFORE_SM90, sm=(8, 9)),
    "rtx3090": Gpu("RTX 3090 24GB (sm86)", 24, CUBLAS_WORKSPACE_BEFORE_SM90, sm=(8, 6)),
    "rtx4090": Gpu("RTX 4090 24GB (sm89)", 24, CUBLAS_WORKSPACE_BEFORE_SM90, sm=(8, 9)),
    "v100-16gb": Gpu("V100 16GB (sm70)", 16, CUBLAS_WORKSPACE_BEFORE_SM90, sm=(7, 0)),
    "v100-32gb": Gpu("V100 32GB (sm70)", 32, CUBLAS_WORKSPACE_BEFORE_SM90, sm=(7, 0)),
    "t4": Gpu("T4 16GB (sm75)", 15, CUBLAS_WORKSPACE_BEFORE_SM90, sm=(7, 5)),  # 15360 MiB visible
}
STUDY_GPU = GPUS["h100"]
GPU_ASSUMPTIONS = {
    "cuBLAS workspaces": (
        f"{CUBLAS_WORKSPACES} x {CUBLAS_WORKSPACE // MIB} MiB, allocated through the caching allocator (in "
        "allocated and reserved): aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize, 4096 KiB x 8 "
        "on sm90 and later (H100, H200), 4096 KiB x 2 + 16 KiB x 8 = 8.125 MiB before (A100, consumer cards); "
        "one per cuBLAS handle and stream, and autograd runs backward on its own thread with its own handle"
    ),
    "cuDNN workspaces": (
        "0: each convolution's workspace is chosen at run time (benchmark off: cuDNN's heuristics) and freed "
        "after it; it lands in reserved only where it raises the step's peak, which the first GPU run shows as "
        "reserved over this prediction"
    ),
    "CUDA context": (
        f"{CUDA_CONTEXT // MIB} MiB, assumed: the driver's context, the loaded kernels and the libraries' handles, "
        "outside PyTorch's allocator (nvidia-smi counts it, torch.cuda does not); a few hundred MiB, less with "
        "CUDA's lazy module loading (the default on Linux since CUDA 12.2, NVIDIA's CUDA programming guide), more "
        "on GPUs with more SMs; measured by the first GPU run as nvidia-smi's peak less torch's reserved peak"
    ),
}


def predict_gpu(
    before: list[tuple[str, object, int]], step: list[tuple[str, object, int]], rounds: int = 2, gpu: Gpu = STUDY_GPU
) -> dict[str, float]:
    """torch.cuda's allocated and reserved peaks, and nvidia-smi's, for a training step's allocations.

    `before` is what exists when the step starts (weights, optimizer state, the data, a window's gradients);
    `step` is one step's events. The step is replayed `rounds` times, each finding the cache the one before
    left, as every step after the first does; what the step frees of `before` (the gradients, at a window's
    end) is made again before the next round, as the next window's first backward does. The card is endless.
    """
    a = replay_step(before, step, rounds, gpu)
    return {
        "gpu_allocated_mib": a.peak_allocated / MIB,
        "gpu_reserved_mib": a.peak_reserved / MIB,
        "gpu_context_mib": gpu.context / MIB,
        "gpu_nvidia_smi_mib": (a.peak_reserved + gpu.context) / MIB,
    }


def on_card(
    before: list[tuple[str, object, int]],
    step: list[tuple[str, object, int]],
    usable_mib: float,
    rounds: int = 2,
    gpu: Gpu = STUDY_GPU,
) -> dict[str, Any]:
    """The same replay on a card that leaves `usable_mib` (the card less the safety margin) for the context and
    the segments: whether the step runs without running out of memory, the reserved peak and nvidia-smi figure
    it has there, and how often the allocator had to free its cache to get there (each time, on a GPU, a
    synchronisation and cudaFree/cudaMalloc calls: a step that fits only so is slower)."""
    capacity = int(usable_mib * MIB) - gpu.context
    out: dict[str, Any] = {"usable_mib": round(usable_mib)}
    try:
        a = replay_step(before, step, rounds, gpu, capacity)
    except OutOfMemory:
        return out | {"fits": False}
    smi = (a.peak_reserved + gpu.context) / MIB
    return out | {
        "fits": True,
        "reserved_mib": a.peak_reserved / MIB,
        "nvidia_smi_mib": smi,
        "cache_frees": a.cache_frees,
    }


def replay_step(
    before: list[tuple[str, object, int]],
    step: list[tuple[str, object, int]],
    rounds: int = 2,
    gpu: Gpu = STUDY_GPU,
    capacity: int | None = None,
) -> CachingAllocator:
    """predict_gpu's replay: what exists before, the cuBLAS workspaces, then the step `rounds` times."""
    a = CachingAllocator(capacity)
    resident = {key: size for kind, key, size in before if kind == "malloc"}
    for key, size in resident.items():
        a.malloc(("before", key), size)
    for i in range(CUBLAS_WORKSPACES):  # made at the first matrix product, kept for the process's life
        a.malloc(("cublas", i), gpu.cublas_workspace)
    for r in range(rounds):
        for key, size in resident.items():
            if not a.is_live(("before", key)):
                a.malloc(("before", key), size)
        for kind, key, size in step:
            k = ("before", key) if key in resident else (r, key)
            if kind == "malloc":
                a.malloc(k, size)
            else:
                a.free(k)
    return a


def replay(events: list[tuple[str, object, int]], allocator: CachingAllocator | None = None) -> CachingAllocator:
    """Run ("malloc", key, bytes) / ("free", key, 0) events through `allocator` (a fresh one by default)."""
    allocator = allocator or CachingAllocator()
    for kind, key, size in events:
        if kind == "malloc":
            allocator.malloc(key, size)
        else:
            allocator.free(key)
    return allocator
