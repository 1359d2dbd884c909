"""Warp-specialized blockwise FP8 GEMM for Hopper, in Gluon (Triton's low-level language).

y = dequant(x) @ dequant(w).T (+ bias), the tiled kernel's numerics (each 128-wide K group's
tensor-core product promoted into an fp32 accumulator with :func:`~fp8linear.ops.gemm_common.promote`'s
arithmetic), scheduled as DeepGEMM does on Hopper. A program computes output tiles of 128 rows
and 128, 192 or 256 columns, one per program or, persistent, one program per SM walking the tiles in grouped
order, with three partitions of warps:

- a producer warp streams the K groups of x (two 64-row boxes) and w of the program's tiles through
  a ring of STAGES shared-memory slots with TMA (zero-filled past M, N and K), each slot guarded by
  a ``ready`` barrier (the loads landed) and an ``empty`` barrier (both consumers are done with
  it); the ring runs on across tiles, so a tile's first groups load while the last one is stored;
- two consumer warpgroups each own 64 rows of a tile: they wait for a slot, multiply on the
  tensor cores (WGMMA), release the slot, and promote the product into their accumulator; then
  store their rows through shared memory, 16 contiguous bytes a thread, or (persistent 128-column
  launches with more work units than programs: :func:`tma_store_pays`) write them into their own
  boxes in shared memory for TMA to store while they start the next tile. On 128-column tiles with
  128x128 or per-tensor weight scales and at least 4 ring slots they take K groups in pairs (the
  second product started before the first is promoted, both slots released together:
  :func:`_k_loop`). A 192- or 256-column tile is three or four 64-column products per K group, each
  started before the one before it is promoted (w in 64-row boxes at 192 columns: TMA boxes and
  shared-memory shapes are powers of two).

The two consumers run independently, so one's promotion on the CUDA cores overlaps the other's
tensor-core work, which the `tl` kernel (one instruction stream, ``wgmma.wait_group 0`` before
every promotion) cannot do; and the producer warp gives most of the register file to them.

Needs a Hopper GPU and a Triton whose Gluon has ``warp_specialize`` (3.6); operands must be
TMA-addressable (:func:`ws_accepts`). Gluon does not run in Triton's CPU interpreter: the router
(:mod:`fp8linear.ops.router`) sends work here only on such a GPU, and the GPU tests compare it with
the float64 reference and with the tiled kernel.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..backend import interpreting
from ..formats import GROUP_SIZE
from .configs import sm_count

try:  # Gluon with warp specialization and Hopper's WGMMA (Triton 3.6)
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    HAS_GLUON_WS = hasattr(gl, "warp_specialize")
    # Gluon names that moved between Triton releases (same arguments and meaning): the TMA load into
    # shared memory, `async_copy_global_to_shared` in Triton 3.6, `async_load` in newer ones (3.9 has
    # only that); the CTA barrier, `thread_barrier` in 3.6, `barrier` in 3.9.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except (ImportError, AttributeError):  # no Triton, no Gluon or one without these names: never picked
    HAS_GLUON_WS = False

__all__ = ["HAS_GLUON_WS", "PAIR_MIN_STAGES", "RELEASE_EVERY", "SPLIT_MAX_STAGES", "TAIL_MAX_WAVES", "TAIL_MIN_GROUPS",
           "TAIL_MAX_SPLIT", "TAIL_MIN_K_GROUPS", "SHARED_LIMIT", "WsConfig", "sum_width", "tail_plan", "tma_store_ok",
           "tma_store_pays", "ws_accepts", "ws_device_ok", "ws_fp8_gemm", "ws_plan", "ws_shared_bytes"]

# Rows per consumer warpgroup (one WGMMA's M) and consumers per program: 128-row tiles.
_HALF_M = 64
# Columns of one tensor-core product (one WGMMA's N): a consumer holds its 64-row accumulators and
# one 64x128 fp32 product (64 registers a thread); tiles are 128, 192 or 256 columns (WsConfig.block_n).
_PRODUCT_COLS = 128
# Register cap the kernel is compiled with: 3 warpgroups x 128 threads x 168 <= 64K registers. The
# partitions then reallocate them (``gl.warp_specialize``'s last argument): the producer warp's
# warpgroup keeps 24 a thread (the minimum; it only issues TMA), the two consumer warpgroups get
# 240 each, what is left.
_MAXNREG = 168
# Columns of one tensor-core product of a 192- or 256-column tile: three or four 64x64 fp32 products
# (32 registers a thread each, two in flight) into as many 64x64 accumulators. 128x192 tiles take x
# from registers (read from shared memory once a K group, not once a product): H100, CUDA graphs, 14
# shapes x M 512-8192, 0.96x the time of x from shared memory (geomean; 8192x28672 M=2048 934.7
# against 1113.1 us, 7168x2048 M=4096 132.9 against 146.9); 256-column tiles do not (1.41x: the
# register copy of x spills there). A 256-column tile: 192 registers of the 240, no spills with
# 128x128 or per-tensor weight scales on the device's Triton 3.6 as measured when the layout was
# chosen (Triton 3.9's ptxas, sm_90a ahead of time, --regAllocOptLevel=2, spills 816 bytes of stores
# and 656 of loads a thread in the unsplit 256-column kernel with 128x128 scales; 1x128 weights'
# per-column scales spill on both, and in 192-column tiles with Triton 3.9's ptxas, 1.2 KB a thread:
# the routes tables name 192- and 256-column tiles for 128x128 weights only; with 128x128 scales the
# 192-column kernel spills 100 bytes of stores and 84 of loads there, 0 with x from shared memory).
# A K group of a 128x256 tile moves 48 KB through L2 against 64 KB for two 128x128 tiles (128x192:
# 40 KB against 48), and L2 is what bounds the 128-column kernel on long K (H100, ncu, 18432x7168
# M=4096: L2 throughput 86%, tensor pipe 53%).
_CHUNK_COLS = 64
# K groups a consumer of a 128-column tile takes per ring-slot release (_k_loop: pairs). Gluon's
# lowering of a one-thread mbarrier arrive syncs the warpgroup first (bar.sync 0, 128 in the PTX,
# Triton 3.6 and 3.9). With a release per K group that sync is the kernel's largest stall (H200,
# ncu, 576x7168 M=2048: 3.7 of 8.7 cycles between instructions waiting at a CTA barrier); in pairs
# the kernel takes 0.93x the time (H100, geomean of 8 cases at M 2048-4096, docs/benchmarks.md).
RELEASE_EVERY = 2
# Ring slots from which the pairs run: a consumer holds both of a pair's slots until its second
# product is in, so with fewer slots the producer runs at most one group ahead (measured with 4).
PAIR_MIN_STAGES = 4
# The most ring slots of a 128-column kernel with a split tail: its partials' layout conversion
# (_PARTIAL_LAYOUT) takes 48 KB of shared memory, so 4 slots use 196,680 bytes and 6 would need
# 262,248 of an H100's 232,448 (sm_90a, compiled ahead of time with Triton 3.6 and 3.9).
SPLIT_MAX_STAGES = 5
# The most K pieces of a split tail tile (WsConfig.tail_split): the sum holds a piece of rows of every
# partial at once (_sum_store), sum_width(split) of them (the plan's split rounded up to a power of
# two) in 64 registers a thread, so 16 leaves 4 rows of 128 columns, one a warp (the layout's smallest).
TAIL_MAX_SPLIT = 16


class WsConfig:
    """Launch options of the warp-specialized kernel: tile width (128, 192 or 256 columns), ring depth
    (shared memory per slot: 32 KB at 128 columns, 40 KB at 192, 48 KB at 256), tile order, whether it runs
    persistent (one program per SM looping over the tiles, so the loads of a program's next tile
    overlap the store of its last one and no program starts cold) or one program per tile, and
    `tail_split`: the most K splits of a tile of the last, partly filled wave (1: none; see
    :func:`tail_plan`)."""

    __slots__ = ("block_n", "stages", "group_m", "persistent", "tail_split")

    def __init__(self, block_n: int = 128, stages: int = 3, group_m: int = 8, persistent: bool = False,
                 tail_split: int = 1) -> None:
        if block_n not in (128, 192, 256):
            raise ValueError(f"WsConfig.block_n must be 128, 192 or 256, got {block_n}")
        if stages < 2:
            raise ValueError(f"WsConfig.stages must be >= 2, got {stages}")
        if group_m < 1:
            raise ValueError(f"WsConfig.group_m must be >= 1, got {group_m}")
        if not isinstance(persistent, bool):
            raise TypeError(f"WsConfig.persistent must be a bool, got {type(persistent).__name__}")
        if type(tail_split) is not int or not 1 <= tail_split <= TAIL_MAX_SPLIT:
            raise ValueError(f"WsConfig.tail_split must be an int from 1 to {TAIL_MAX_SPLIT}, got {tail_split!r}")
        if block_n == 128 and tail_split > 1 and stages > SPLIT_MAX_STAGES:
            raise ValueError(f"WsConfig: a split tail on 128-column tiles fits at most {SPLIT_MAX_STAGES} ring "
                             f"slots in shared memory, got stages={stages} with tail_split={tail_split}")
        self.block_n = block_n
        self.stages = stages
        self.group_m = group_m
        self.persistent = persistent
        self.tail_split = tail_split

    def _key(self) -> tuple[int, int, int, bool, int]:
        return self.block_n, self.stages, self.group_m, self.persistent, self.tail_split

    def __repr__(self) -> str:
        return (f"WsConfig(block_n={self.block_n}, stages={self.stages}, group_m={self.group_m}, "
                f"persistent={self.persistent}, tail_split={self.tail_split})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WsConfig) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# Where the last wave's tiles are split along K (tail_plan). The split path costs a fixed few
# microseconds (partials through L2, a GPU-scope fence and a second pass for the last program) and
# its whole tiles ran 3-5% slower at short K. H100 and H200, benchmarks/ws_gemm_ab.py
# (wsp128s4 against wsp128s4t4/t8/t16) and a probe with the counters handed in, CUDA graphs, the
# partials stored in the tensor cores' layout (in _PARTIAL_LAYOUT split cases take 0.89-0.94x that
# time):
# - K = 7168 with at most 8 whole waves: 0.83-0.97x (576x7168 M=4096 50.8 against 57.6 us, 1536x7168
#   M=3000 78.7 against 88.9, 2112x7168 M=2048 77.3 against 85.8 with 4 splits, 81.4 with 8, 92.0
#   with 16: the last program sums every split's partial);
# - K = 7168 at 17-27 waves (18432x7168 M=2048, 3000): 1.00-1.01x; K <= 2048: 1.04-2.0x
#   (576x576 M=1024 12.2 against 6.1 us; 7168x2048 M=1024 39.5 against 35.1; 24576x1536 M=8192 709
#   against 674).
# With _PARTIAL_LAYOUT and _sum_store (H200, forced plans, one run): K = 3584 (28 groups), 3584x3584
# M=640 in 4 pieces of 7, 26.6 against 26.9 unsplit; K = 2048, 7168x2048 M=1024 in 2 pieces of 8,
# 38.0 against 33.8; K = 4096, 4096x4096 M=640 in 4 pieces of 8, 29.3 against 31.7.
TAIL_MIN_K_GROUPS = 32
TAIL_MAX_WAVES = 8
# A tail tile's K split keeps at least this many 128-wide K groups per program.
TAIL_MIN_GROUPS = 2


def tail_plan(tiles: int, programs: int, k_groups: int, max_split: int) -> tuple[int, int, int]:
    """(whole tiles, splits per tail tile, K groups per split) of a launch of `tiles` output tiles
    over `programs` concurrent programs (the SMs).

    ``tiles % programs`` tiles are left for a last wave that would keep the rest of the SMs idle;
    where K has at least TAIL_MIN_K_GROUPS groups and the whole tiles take at most TAIL_MAX_WAVES
    waves, each of those is cut along K into up to ``programs // tail tiles`` pieces (at most
    `max_split`, each at least TAIL_MIN_GROUPS groups long), run by as many programs at once,
    whose fp32 partial tiles the last of them to finish sums in split order (deterministic). Whole
    tiles come first: the plan is (tiles, 1, k_groups) where nothing is split."""
    tail = tiles % programs
    if not tail or k_groups < TAIL_MIN_K_GROUPS or tiles // programs > TAIL_MAX_WAVES:
        return tiles, 1, k_groups
    split = min(programs // tail, k_groups // TAIL_MIN_GROUPS, max_split)
    if split < 2:
        return tiles, 1, k_groups
    per_split = -(-k_groups // split)
    return tiles - tail, -(-k_groups // per_split), per_split


def ws_plan(m: int, n: int, k: int, cfg: WsConfig, programs: int) -> tuple[int, int, int, int]:
    """(output tiles, whole tiles, pieces a tail tile, K groups a piece) of an (m, n, k) launch with
    `cfg` over `programs` concurrent programs: :func:`tail_plan` over its 128 x block_n tiles."""
    tiles = -(-m // (2 * _HALF_M)) * -(-n // cfg.block_n)
    return (tiles, *tail_plan(tiles, programs, -(-k // GROUP_SIZE), cfg.tail_split))


def sum_width(split: int) -> int:
    """The split tail sum's unrolled width (the kernel's MAX_SPLIT, see _sum_store) for a plan of
    `split` pieces a tile: `split` rounded up to a power of two (1: no split), so the loads past the
    last piece are fewer than `split`. Not the config's bound: a 2-piece split summed 2 wide takes
    0.91-0.99x the time of 4 wide, same bits (H200, 5 plans; docs/benchmarks.md, "What a split tail
    costs, step by step")."""
    return 1 if split <= 1 else 1 << (split - 1).bit_length()


# Shared memory a block may opt in to on an H100 or H200 (227 KB).
SHARED_LIMIT = 232_448
# Shared memory of the kernel besides its ring and output boxes: its barriers (16 bytes a ring slot
# and 192 more), 32 bytes with a split tail, and in a 128-column kernel with a split tail the
# partials' layout conversion (_PARTIAL_LAYOUT, both consumers). Measured as sm_90a compiled ahead
# of time with Triton 3.9 (the estimate is at most 8 bytes over the compiler's); the test that
# compiles the configs with the installed Triton checks it (tests/ops/test_ws_gemm.py).
_SHARED_PER_SLOT_BARRIERS = 16
_SHARED_OTHER = 192
_SHARED_SPLIT = 32
_SHARED_PARTIAL_CONVERSION = 65_328


def ws_shared_bytes(cfg: WsConfig, split: bool) -> int:
    """Shared memory of the kernel with `cfg` storing its tiles by TMA, `split`: with a split tail.
    The ring (two 64x128 x boxes and block_n rows of w a slot), each consumer's output boxes (64 x
    block_n 16-bit values), the barriers, and for a 128-column kernel with a split tail the partials'
    layout conversion."""
    ring = cfg.stages * (2 * _HALF_M * GROUP_SIZE + cfg.block_n * GROUP_SIZE)
    boxes = 2 * _HALF_M * cfg.block_n * 2
    conversion = _SHARED_PARTIAL_CONVERSION if cfg.block_n == _PRODUCT_COLS else 0
    tail = _SHARED_SPLIT + conversion if split else 0
    return ring + boxes + tail + cfg.stages * _SHARED_PER_SLOT_BARRIERS + _SHARED_OTHER


def tma_store_pays(cfg: WsConfig, units: int, programs: int) -> bool:
    """Whether the default stores whole tiles by TMA (where :func:`tma_store_ok`): in a persistent
    launch of 128-column tiles with more work units than programs (so programs run several), where a
    tile's store runs on while the consumers start the next one. H200, CUDA graphs, 7 shapes x M
    1000-8192, the TMA store forced on against the store from registers
    (benchmarks/ws_gemm_ab.py --store-ab): persistent 128x128 tiles with more units than SMs
    0.94-1.00x (7168x2048 M=8192 233.4 against 247.3 us, 576x576 M=8192 11.9 against 12.6), with one
    unit a program 1.00-1.03x; 128x192 tiles 0.96-1.03x (geomean 0.997: not taken); one program a
    tile 1.00-1.05x (the program's last store is waited for, nothing to overlap)."""
    return cfg.persistent and cfg.block_n == _PRODUCT_COLS and units > programs


def tma_store_ok(y: torch.Tensor, cfg: WsConfig, split: int) -> bool:
    """Whether the kernel can store output `y`'s whole tiles through shared memory by TMA with `cfg`
    and `split` pieces a tail tile: a 16-bit output (the kernel stages 16-bit boxes; fp32 outputs keep
    the register store) whose rows are a multiple of 16 bytes from a 16-byte aligned base (TMA), and
    room for the boxes beside the ring."""
    return (y.dtype in (torch.bfloat16, torch.float16) and y.stride(1) == 1 and (y.stride(0) * 2) % 16 == 0
            and y.data_ptr() % 16 == 0 and ws_shared_bytes(cfg, split > 1) <= SHARED_LIMIT)


def ws_accepts(x_q: torch.Tensor, w_q: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the kernel can take these operands: contiguous FP8 rows whose length K is a multiple
    of 16 bytes and 16-byte aligned bases (TMA), bf16/fp16/fp32 output."""
    return (HAS_GLUON_WS and x_q.is_cuda and x_q.is_contiguous() and w_q.is_contiguous()
            and x_q.shape[1] % 16 == 0 and x_q.data_ptr() % 16 == 0 and w_q.data_ptr() % 16 == 0
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32))


@lru_cache(maxsize=16)
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def ws_device_ok(device: torch.device) -> bool:
    """Whether the kernel runs on `device`: a Hopper GPU (sm_90) under CUDA, a Triton with Gluon's
    warp specialization, not Triton's CPU interpreter."""
    if not HAS_GLUON_WS or device.type != "cuda" or torch.version.hip is not None or interpreting():
        return False
    return _device_ok(device.index if device.index is not None else torch.cuda.current_device())


if HAS_GLUON_WS:
    # The split tail's fp32 partials of a consumer's 64x128 rows (_finish_split; a consumer is 4
    # warps): 4 consecutive columns a thread, a warp across a row. H200, CUDA graphs, against the
    # tensor cores' layout, the same bits, both with the partials summed in a runtime loop converted
    # back to the tensor cores' layout (benchmarks/ws_tail_plans.py forces the plans): every
    # 4096x4096 M=512 tile split in 4, 45.5 against 66.2 us; the shipped plans at 4096x4096 M=640 29.5
    # against 33.0, 576x7168 M=4096 44.1 against 47.1.
    _PARTIAL_LAYOUT: tl.constexpr = tl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0]))
    _PRODUCT_N: tl.constexpr = tl.constexpr(_PRODUCT_COLS)
    _CHUNK_N: tl.constexpr = tl.constexpr(_CHUNK_COLS)
    _HALF_ROWS: tl.constexpr = tl.constexpr(_HALF_M)
    _PAIR_MIN_STAGES: tl.constexpr = tl.constexpr(PAIR_MIN_STAGES)

    @gluon.jit
    def _tile_offsets(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """(row, column) offsets of output tile `tile` in grouped order, as fp8linear.ops.gemm._tile_coords."""
        num_pid_m = gl.cdiv(M, BLOCK_M)
        per_group = GROUP_M * gl.cdiv(N, BLOCK_N)
        first_m = (tile // per_group) * GROUP_M
        group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        return (first_m + (tile % per_group) % group_m) * BLOCK_M, ((tile % per_group) // group_m) * BLOCK_N

    @gluon.jit
    def _unit(u, whole_tiles, tail_split, groups_per_split, k_groups):
        """(tile, first K group, end K group) of work unit `u`: whole tiles first, then each tail tile
        as `tail_split` consecutive units of `groups_per_split` K groups (see tail_plan)."""
        tile = u
        first = u * 0
        end = first + k_groups
        if u >= whole_tiles:
            v = u - whole_tiles
            tile = whole_tiles + v // tail_split
            first = (v % tail_split) * groups_per_split
            end = gl.minimum(first + groups_per_split, k_groups)
        return tile, first, end

    @gluon.jit
    def _produce(x_desc, w_desc, y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr, bias_ptr,
                 part_ptr, count_ptr,
                 M, N, K, whole_tiles, tail_split, groups_per_split, stride_xsm, stride_wsn, stride_wsk, stride_ym,
                 WS_GROUP_N: gl.constexpr, W_SCALE_UNIFORM: gl.constexpr, HAS_BIAS: gl.constexpr,
                 GROUP_M: gl.constexpr, MAX_SPLIT: gl.constexpr,
                 RELEASE_EVERY: gl.constexpr, TMA_STORE: gl.constexpr):
        """The producer warp: fill the ring's slots with the K groups of the program's work units, in
        order, each slot once both consumers released it (so the next unit's first groups load while
        the consumers store the last one)."""
        stages: gl.constexpr = a_bufs.type.shape[0] // 2
        boxes: gl.constexpr = b_bufs.type.shape[0] // stages  # w boxes a slot
        half: gl.constexpr = x_desc.block_type.shape[0]
        block_k: gl.constexpr = x_desc.block_type.shape[1]
        box_n: gl.constexpr = w_desc.block_type.shape[0]
        block_n: gl.constexpr = boxes * box_n
        nbytes: gl.constexpr = 2 * x_desc.block_type.nbytes + boxes * w_desc.block_type.nbytes
        k_groups = gl.cdiv(K, block_k)
        num_tiles = gl.cdiv(M, 2 * half) * gl.cdiv(N, block_n)
        num_units = whole_tiles + (num_tiles - whole_tiles) * tail_split
        it = 0  # K groups loaded by this program so far: slot it % stages, round it // stages
        for u in range(gl.program_id(0), num_units, gl.num_programs(0)):
            tile, first, end = _unit(u, whole_tiles, tail_split, groups_per_split, k_groups)
            off_m, off_n = _tile_offsets(tile, M, N, 2 * half, block_n, GROUP_M)
            for k in range(first, end):
                s = it % stages
                # empty barriers start with phase 1 complete, so the first round does not wait
                mbarrier.wait(empty.index(s), ((it // stages) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                _tma_load(x_desc, [off_m, k * block_k], ready.index(s), a_bufs.index(2 * s))
                _tma_load(x_desc, [off_m + half, k * block_k], ready.index(s), a_bufs.index(2 * s + 1))
                for j in gl.static_range(boxes):
                    _tma_load(w_desc, [off_n + j * box_n, k * block_k], ready.index(s), b_bufs.index(s * boxes + j))
                it += 1

    @gluon.jit
    def _scale_ptrs(ws_ptr, off_n, N, stride_wsn, cols: gl.constexpr, WIDTH: gl.constexpr,
                    WS_GROUP_N: gl.constexpr, W_SCALE_UNIFORM: gl.constexpr):
        """Weight-scale pointers of K group 0 for output columns off_n .. off_n + WIDTH - 1: one scalar
        when they share a scale (per-tensor; 128x128 blocks, WIDTH = 128, off_n a multiple of 128),
        else one per column; columns past N point at valid scales (their outputs are masked)."""
        if W_SCALE_UNIFORM:
            return ws_ptr + gl.minimum(off_n // WS_GROUP_N, (N - 1) // WS_GROUP_N).to(gl.int64) * stride_wsn
        else:
            offs_n = off_n + gl.arange(0, WIDTH, layout=cols)
            return ws_ptr + (gl.where(offs_n < N, offs_n, 0) // WS_GROUP_N).to(gl.int64) * stride_wsn

    @gluon.jit
    def _promote(acc, product, x_s, w_s, W_SCALE_UNIFORM: gl.constexpr):
        """gemm_common.promote's arithmetic (the tiled kernel's bits)."""
        if W_SCALE_UNIFORM:
            return acc + product * (x_s * w_s)[:, None]
        else:
            return acc + product * (x_s[:, None] * w_s[None, :])

    @gluon.jit
    def _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS: gl.constexpr):
        """acc + bias[offs_n] in fp32 (offs_n in acc's column layout; columns past N read column 0)."""
        if HAS_BIAS:
            acc = acc + gl.load(bias_ptr + gl.where(offs_n < N, offs_n, 0)).to(gl.float32)[None, :]
        return acc

    @gluon.jit
    def _masked_store(y_ptr, out, offs_m, offs_n, M, N, stride_ym):
        """y[offs_m, offs_n] = out, masked to (M, N) (offs_m, offs_n in out's row and column layouts)."""
        y_ptrs = y_ptr + offs_m.to(gl.int64)[:, None] * stride_ym + offs_n[None, :]
        gl.store(y_ptrs, out, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])

    @gluon.jit
    def _store(y_ptr, bias_ptr, acc, off_m, off_n, M, N, stride_ym, cols: gl.constexpr, WIDTH: gl.constexpr,
               HAS_BIAS: gl.constexpr):
        """Add the bias (fp32), cast, and store a consumer's rows off_m .. +63 x columns off_n .. +WIDTH-1
        masked to (M, N). The tile goes from the tensor cores' register layout (a thread holds pairs of
        columns of 8-row strips) to one where each thread writes 16 contiguous bytes of a row: the
        conversion runs through shared memory, and the stores coalesce."""
        acc = _add_bias(acc, bias_ptr, off_n + gl.arange(0, WIDTH, layout=cols), N, HAS_BIAS)
        dtype: gl.constexpr = y_ptr.dtype.element_ty
        per_thread: gl.constexpr = 128 // dtype.primitive_bitwidth  # 16 bytes
        across: gl.constexpr = WIDTH // per_thread
        coalesced: gl.constexpr = gl.BlockedLayout([1, per_thread], [32 // across, across], [4, 1], [1, 0])
        _masked_store(y_ptr, gl.convert_layout(acc.to(dtype), coalesced),
                      off_m + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, coalesced)),
                      off_n + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, coalesced)), M, N, stride_ym)

    @gluon.jit
    def _stage_chunk(buf, bias_ptr, acc, off_n, N, cols: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Add the bias (fp32) to a consumer's accumulator of columns off_n .. + its width - 1, cast it to
        the output's dtype and write it to `buf`, its shared-memory box of the output tile (the tensor
        cores' register layout straight into the swizzled box: no conversion)."""
        acc = _add_bias(acc, bias_ptr, off_n + gl.arange(0, acc.shape[1], layout=cols), N, HAS_BIAS)
        buf.store(acc.to(buf.dtype))

    @gluon.jit
    def _sum_store(first, unit_stride, tail_split, y_ptr, bias_ptr, row0, off_n, M, N, stride_ym,
                   COLS: gl.constexpr, CHUNKS: gl.constexpr, HAS_BIAS: gl.constexpr, MAX_SPLIT: gl.constexpr):
        """Sum a consumer's `tail_split` (<= MAX_SPLIT) fp32 partials of a tail tile in split order, add
        the bias, cast and store them to rows row0 .. +63, columns off_n .. + CHUNKS * COLS - 1 of y.
        A partial is CHUNKS row-major 64 x COLS blocks, one every 64 * COLS floats; partial s starts at
        first + s * unit_stride. Rows go in pieces small enough that every partial's loads of a piece
        are in flight at once (64 registers a thread for MAX_SPLIT partials), 4 consecutive columns a
        thread, and the sums are stored from that layout (no conversion). What it and the rest of a
        split tail cost: docs/benchmarks.md, "What a split tail costs, step by step"."""
        across: gl.constexpr = COLS // 4
        flat: gl.constexpr = gl.BlockedLayout([1, 4], [32 // across, across], [4, 1], [1, 0])
        rows: gl.constexpr = _HALF_ROWS * 128 // COLS // MAX_SPLIT  # rows x COLS / 128 threads x MAX_SPLIT = 64
        piece_rows = gl.arange(0, rows, layout=gl.SliceLayout(1, flat))
        piece_cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, flat))
        offs = piece_rows[:, None] * COLS + piece_cols[None, :]
        dtype: gl.constexpr = y_ptr.dtype.element_ty
        for c in gl.static_range(CHUNKS):
            for r in gl.static_range(_HALF_ROWS // rows):
                piece = first + (c * _HALF_ROWS + r * rows) * COLS + offs
                acc = gl.load(piece, cache_modifier=".cg")
                for s in gl.static_range(1, MAX_SPLIT):  # no branch, so the loads can all be issued first
                    part = gl.load(piece + gl.minimum(s, tail_split - 1) * unit_stride, cache_modifier=".cg")
                    acc = gl.where(s < tail_split, acc + part, acc)
                offs_n = off_n + c * COLS + piece_cols
                acc = _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS)
                _masked_store(y_ptr, acc.to(dtype), row0 + r * rows + piece_rows, offs_n, M, N, stride_ym)

    @gluon.jit
    def _count_in(count_ptr, v, tail_split, HALF: gl.constexpr):
        """Once tail unit `v`'s partial is stored: count it in on its (tile, consumer) counter. True for
        the last of the tile's `tail_split` units to arrive, which sets the counter back to zero."""
        _thread_barrier()  # every thread's partial is written before the counter says so
        counter = count_ptr + (v // tail_split) * 2 + HALF
        last = gl.atomic_add(counter, 1, sem="acq_rel") == tail_split - 1
        if last:
            gl.atomic_xchg(counter, 0)
        return last

    @gluon.jit
    def _sum_if_last(part_ptr, count_ptr, v, tail_split, size: gl.constexpr, y_ptr, bias_ptr, row0, off_n, M, N,
                     stride_ym, COLS: gl.constexpr, CHUNKS: gl.constexpr, HAS_BIAS: gl.constexpr, HALF: gl.constexpr,
                     MAX_SPLIT: gl.constexpr):
        """Once tail unit `v`'s partial (`size` floats a consumer) is stored: count it in, and for the last
        of the tile's `tail_split` units to arrive, store the sum of the tile's partials (_sum_store)."""
        if _count_in(count_ptr, v, tail_split, HALF):
            first_part = part_ptr + ((v - v % tail_split) * 2 + HALF).to(gl.int64) * size
            _sum_store(first_part, 2 * size, tail_split, y_ptr, bias_ptr, row0, off_n, M, N, stride_ym, COLS, CHUNKS,
                       HAS_BIAS, MAX_SPLIT)

    @gluon.jit
    def _finish_split(part_ptr, count_ptr, acc, u, whole_tiles, tail_split, y_ptr, bias_ptr, row0, off_n, M, N,
                      stride_ym, HAS_BIAS: gl.constexpr, HALF: gl.constexpr, MAX_SPLIT: gl.constexpr):
        """A consumer's 64x128 rows of a tail unit: store its fp32 partial, count it in, and, for the last
        of the tile's `tail_split` units to arrive, store the sum of the partials in split order
        (_sum_store). Each consumer half counts on its own counter, left at zero.

        The partial goes through _PARTIAL_LAYOUT, where a warp writes whole 512-byte rows in 16-byte
        vectors, not the tensor cores' layout (a thread's pairs of fp32 scattered over 8-row strips)."""
        v = u - whole_tiles
        flat: gl.constexpr = _PARTIAL_LAYOUT
        offs = (gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, flat))[:, None] * acc.shape[1]
                + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, flat))[None, :])
        size: gl.constexpr = acc.shape[0] * acc.shape[1]
        gl.store(part_ptr + (v * 2 + HALF).to(gl.int64) * size + offs, gl.convert_layout(acc, flat))
        _sum_if_last(part_ptr, count_ptr, v, tail_split, size, y_ptr, bias_ptr, row0, off_n, M, N, stride_ym,
                     acc.shape[1], 1, HAS_BIAS, HALF, MAX_SPLIT)

    @gluon.jit
    def _group_product(a_bufs, b_bufs, ready, it, mma: gl.constexpr, HALF: gl.constexpr):
        """Wait for ring counter `it`'s slot and start the consumer's 64x128 tensor-core product of it
        (asynchronous; warpgroup_mma_wait gives it). A fresh product (zeros as the C operand, not
        added): holding the previous product's registers as C instead left the 1x128-weight consumer
        short of registers (ptxas spills)."""
        stages: gl.constexpr = a_bufs.type.shape[0] // 2  # two x boxes a slot
        s = it % stages
        mbarrier.wait(ready.index(s), (it // stages) & 1)
        return warpgroup_mma(a_bufs.index(2 * s + HALF), b_bufs.index(s).permute((1, 0)),
                             gl.zeros([_HALF_ROWS, _PRODUCT_N], gl.float32, layout=mma), use_acc=False, is_async=True)

    @gluon.jit
    def _k_loop(a_bufs, b_bufs, ready, empty, xs_ptrs, ws_ptrs, acc, first, end, it, stride_wsk, mma: gl.constexpr,
                W_SCALE_UNIFORM: gl.constexpr, HALF: gl.constexpr, RELEASE_EVERY: gl.constexpr):
        """K groups first .. end-1 of a consumer's rows of a 128-column tile into acc, the ring's slots
        taken from counter `it` on; -> (acc, it). RELEASE_EVERY 1: each group's slot is released once
        its product is in registers. 2 (with at least PAIR_MIN_STAGES slots): groups go in pairs, the
        second product started before the first is promoted, and both slots released together (an
        odd last group alone): a release is one thread's mbarrier arrive, which Gluon's lowering
        precedes with a sync of the warpgroup's 128 threads, and two back to back align the warps
        once. The pairs are a loop of their own: a release in a branch inside one loop makes the
        lowering sync before every wait too. The promotions run in the same order either way (the
        same bits). 1x128 weights (per-column scales, not W_SCALE_UNIFORM) go one group at a time:
        two groups' scales in registers spill (ptxas, sm_90a, Triton 3.9: 2.8 KB of spill loads a
        thread against 1.1 KB)."""
        stages: gl.constexpr = a_bufs.type.shape[0] // 2  # two x boxes a slot
        if RELEASE_EVERY == 2 and W_SCALE_UNIFORM and stages >= _PAIR_MIN_STAGES:
            pairs_end = first + (end - first) // 2 * 2
            for k in range(first, pairs_end, 2):
                p0 = _group_product(a_bufs, b_bufs, ready, it, mma, HALF)
                x0 = gl.load(xs_ptrs + k)  # the scales load while the tensor cores run
                w0 = gl.load(ws_ptrs + k * stride_wsk)
                p0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0,))
                p1 = _group_product(a_bufs, b_bufs, ready, it + 1, mma, HALF)
                x1 = gl.load(xs_ptrs + k + 1)
                w1 = gl.load(ws_ptrs + (k + 1) * stride_wsk)
                acc = _promote(acc, p0, x0, w0, W_SCALE_UNIFORM)
                p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
                mbarrier.arrive(empty.index(it % stages), count=1)
                mbarrier.arrive(empty.index((it + 1) % stages), count=1)
                acc = _promote(acc, p1, x1, w1, W_SCALE_UNIFORM)
                it += 2
            first = pairs_end
        for k in range(first, end):  # every group (RELEASE_EVERY 1), or the odd last one
            product = _group_product(a_bufs, b_bufs, ready, it, mma, HALF)
            x_s = gl.load(xs_ptrs + k)
            w_s = gl.load(ws_ptrs + k * stride_wsk)
            product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
            mbarrier.arrive(empty.index(it % stages), count=1)
            acc = _promote(acc, product, x_s, w_s, W_SCALE_UNIFORM)
            it += 1
        return acc, it

    @gluon.jit
    def _chunk_product(a, b_bufs, s, boxes: gl.constexpr, s_chunk: gl.constexpr, zeros):
        """Start the 64x64 product of consumer rows `a` with columns 64*s_chunk .. +63 of ring slot `s`'s
        weight tile (asynchronous; warpgroup_mma_wait gives it): a slice of the slot's one w box, or
        its box `s_chunk` where a slot holds `boxes` 64-row boxes."""
        if boxes == 1:
            b = b_bufs.index(s).slice(s_chunk * _CHUNK_N, _CHUNK_N)
        else:
            b = b_bufs.index(s * boxes + s_chunk)
        return warpgroup_mma(a, b.permute((1, 0)), zeros, use_acc=False, is_async=True)

    @gluon.jit
    def _wide_unit(y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr, bias_ptr, part_ptr, count_ptr,
                   off_m, off_n,
                   M, N, first, end, it, u, whole_tiles, tail_split, stride_xsm, stride_wsn, stride_wsk, stride_ym,
                   WS_GROUP_N: gl.constexpr, W_SCALE_UNIFORM: gl.constexpr, HAS_BIAS: gl.constexpr,
                   HALF: gl.constexpr, SPLIT: gl.constexpr, MAX_SPLIT: gl.constexpr, TMA_STORE: gl.constexpr):
        """Consumer HALF's rows of a 128x192 or 128x256 tile over K groups first .. end-1: per K group
        three or four 64-column products, each started before the one before it is promoted (two in
        flight), into as many 64x64 accumulators; then the store, or (SPLIT: a tail unit, see
        _finish_split) its fp32 partial, and for the last of the tile's units to arrive the sum of the
        partials in split order and the store. -> the ring counter after the unit's groups."""
        stages: gl.constexpr = a_bufs.type.shape[0] // 2
        boxes: gl.constexpr = b_bufs.type.shape[0] // stages
        chunks: gl.constexpr = boxes * b_bufs.type.shape[1] // _CHUNK_N  # 3 or 4
        half: gl.constexpr = _HALF_ROWS
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, _CHUNK_N, 32])
        x_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)  # 4 fp8 a 32-bit register
        rows: gl.constexpr = gl.SliceLayout(1, mma)
        cols: gl.constexpr = gl.SliceLayout(0, mma)
        offs_m = off_m + HALF * half + gl.arange(0, half, layout=rows)
        xs_ptrs = xs_ptr + gl.where(offs_m < M, offs_m, 0).to(gl.int64) * stride_xsm
        ws0 = _scale_ptrs(ws_ptr, off_n, N, stride_wsn, cols, _CHUNK_N, WS_GROUP_N, W_SCALE_UNIFORM)
        ws1 = _scale_ptrs(ws_ptr, off_n + _CHUNK_N, N, stride_wsn, cols, _CHUNK_N, WS_GROUP_N, W_SCALE_UNIFORM)
        ws2 = _scale_ptrs(ws_ptr, off_n + 2 * _CHUNK_N, N, stride_wsn, cols, _CHUNK_N, WS_GROUP_N, W_SCALE_UNIFORM)
        if chunks == 4:
            ws3 = _scale_ptrs(ws_ptr, off_n + 3 * _CHUNK_N, N, stride_wsn, cols, _CHUNK_N, WS_GROUP_N, W_SCALE_UNIFORM)
        zeros = gl.zeros([half, _CHUNK_N], gl.float32, layout=mma)
        acc0 = zeros
        acc1 = zeros
        acc2 = zeros
        acc3 = zeros  # 192 columns: stays zeros, never stored
        for k in range(first, end):
            s = it % stages
            mbarrier.wait(ready.index(s), (it // stages) & 1)
            a = a_bufs.index(2 * s + HALF)
            if chunks == 3:  # x from registers: one shared-memory read for the three products (see _CHUNK_COLS)
                a = a.load(x_operand)
            p0 = _chunk_product(a, b_bufs, s, boxes, 0, zeros)
            x_s = gl.load(xs_ptrs + k)
            w0 = gl.load(ws0 + k * stride_wsk)
            p1 = _chunk_product(a, b_bufs, s, boxes, 1, zeros)
            p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
            acc0 = _promote(acc0, p0, x_s, w0, W_SCALE_UNIFORM)
            p2 = _chunk_product(a, b_bufs, s, boxes, 2, zeros)
            w1 = gl.load(ws1 + k * stride_wsk)
            p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1,))
            acc1 = _promote(acc1, p1, x_s, w1, W_SCALE_UNIFORM)
            if chunks == 4:
                p3 = _chunk_product(a, b_bufs, s, boxes, 3, zeros)
                w2 = gl.load(ws2 + k * stride_wsk)
                p2 = warpgroup_mma_wait(num_outstanding=1, deps=(p2,))
                acc2 = _promote(acc2, p2, x_s, w2, W_SCALE_UNIFORM)
                w3 = gl.load(ws3 + k * stride_wsk)
                p3 = warpgroup_mma_wait(num_outstanding=0, deps=(p3,))
                mbarrier.arrive(empty.index(s), count=1)
                acc3 = _promote(acc3, p3, x_s, w3, W_SCALE_UNIFORM)
            else:
                w2 = gl.load(ws2 + k * stride_wsk)
                p2 = warpgroup_mma_wait(num_outstanding=0, deps=(p2,))
                mbarrier.arrive(empty.index(s), count=1)
                acc2 = _promote(acc2, p2, x_s, w2, W_SCALE_UNIFORM)
            it += 1
        row0 = off_m + HALF * half
        if SPLIT:
            chunk: gl.constexpr = half * _CHUNK_N
            size: gl.constexpr = chunks * chunk  # one consumer's 64 x (64 * chunks) partial
            v = u - whole_tiles
            offs = gl.arange(0, half, layout=rows)[:, None] * _CHUNK_N + gl.arange(0, _CHUNK_N, layout=cols)[None, :]
            mine = part_ptr + (v * 2 + HALF).to(gl.int64) * size + offs
            gl.store(mine, acc0)
            gl.store(mine + chunk, acc1)
            gl.store(mine + 2 * chunk, acc2)
            if chunks == 4:
                gl.store(mine + 3 * chunk, acc3)
            _sum_if_last(part_ptr, count_ptr, v, tail_split, size, y_ptr, bias_ptr, row0, off_n, M, N, stride_ym,
                         _CHUNK_N, chunks, HAS_BIAS, HALF, MAX_SPLIT)
        elif TMA_STORE:
            # the consumer's chunks go out through its boxes in shared memory, by TMA (clipped to M
            # and N); the consumer waits for its last tile's stores to have read them first
            tma.store_wait(0)
            _stage_chunk(c_bufs.index(HALF * chunks), bias_ptr, acc0, off_n, N, cols, HAS_BIAS)
            _stage_chunk(c_bufs.index(HALF * chunks + 1), bias_ptr, acc1, off_n + _CHUNK_N, N, cols, HAS_BIAS)
            _stage_chunk(c_bufs.index(HALF * chunks + 2), bias_ptr, acc2, off_n + 2 * _CHUNK_N, N, cols, HAS_BIAS)
            if chunks == 4:
                _stage_chunk(c_bufs.index(HALF * chunks + 3), bias_ptr, acc3, off_n + 3 * _CHUNK_N, N, cols, HAS_BIAS)
            fence_async_shared()
            for c in gl.static_range(chunks):
                _tma_store(y_desc, [row0, off_n + c * _CHUNK_N], c_bufs.index(HALF * chunks + c))
        else:
            _store(y_ptr, bias_ptr, acc0, row0, off_n, M, N, stride_ym, cols, _CHUNK_N, HAS_BIAS)
            _store(y_ptr, bias_ptr, acc1, row0, off_n + _CHUNK_N, M, N, stride_ym, cols, _CHUNK_N, HAS_BIAS)
            _store(y_ptr, bias_ptr, acc2, row0, off_n + 2 * _CHUNK_N, M, N, stride_ym, cols, _CHUNK_N, HAS_BIAS)
            if chunks == 4:
                _store(y_ptr, bias_ptr, acc3, row0, off_n + 3 * _CHUNK_N, M, N, stride_ym, cols, _CHUNK_N, HAS_BIAS)
        return it

    @gluon.jit
    def _consume(x_desc, w_desc, y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr, bias_ptr,
                 part_ptr, count_ptr,
                 M, N, K, whole_tiles, tail_split, groups_per_split, stride_xsm, stride_wsn, stride_wsk, stride_ym,
                 WS_GROUP_N: gl.constexpr, W_SCALE_UNIFORM: gl.constexpr, HAS_BIAS: gl.constexpr,
                 GROUP_M: gl.constexpr, MAX_SPLIT: gl.constexpr, HALF: gl.constexpr,
                 RELEASE_EVERY: gl.constexpr, TMA_STORE: gl.constexpr):
        """Consumer warpgroup HALF: rows 64*HALF .. +63 of each of the program's whole tiles, every K
        group, then the tile's store; then, with MAX_SPLIT > 1, its tail units (_finish_split). A tile 192
        or 256 columns wide runs :func:`_wide_unit`."""
        half: gl.constexpr = x_desc.block_type.shape[0]
        block_k: gl.constexpr = x_desc.block_type.shape[1]
        block_n: gl.constexpr = b_bufs.type.shape[0] // (a_bufs.type.shape[0] // 2) * w_desc.block_type.shape[0]
        WIDE: gl.constexpr = block_n != _PRODUCT_N
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, _PRODUCT_N, 32])
        rows: gl.constexpr = gl.SliceLayout(1, mma)
        cols: gl.constexpr = gl.SliceLayout(0, mma)
        k_groups = gl.cdiv(K, block_k)
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        it = 0  # K groups consumed by this program so far, as the producer counts them
        for tile in range(pid, whole_tiles, programs):
            off_m, off_n = _tile_offsets(tile, M, N, 2 * half, block_n, GROUP_M)
            if WIDE:
                it = _wide_unit(y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr, bias_ptr,
                                part_ptr, count_ptr,
                                off_m, off_n, M, N, 0, k_groups, it, tile, whole_tiles, tail_split, stride_xsm,
                                stride_wsn, stride_wsk, stride_ym, WS_GROUP_N, W_SCALE_UNIFORM, HAS_BIAS, HALF, False,
                                MAX_SPLIT, TMA_STORE)
            else:
                offs_m = off_m + HALF * half + gl.arange(0, half, layout=rows)
                # rows past M read row 0's scales (a valid address); TMA zero-filled their operands and
                # the store masks them
                xs_ptrs = xs_ptr + gl.where(offs_m < M, offs_m, 0).to(gl.int64) * stride_xsm
                ws_ptrs = _scale_ptrs(ws_ptr, off_n, N, stride_wsn, cols, _PRODUCT_N, WS_GROUP_N, W_SCALE_UNIFORM)
                acc = gl.zeros([half, _PRODUCT_N], gl.float32, layout=mma)
                acc, it = _k_loop(a_bufs, b_bufs, ready, empty, xs_ptrs, ws_ptrs, acc, 0, k_groups, it, stride_wsk,
                                  mma, W_SCALE_UNIFORM, HALF, RELEASE_EVERY)
                if TMA_STORE:  # through the consumer's box in shared memory, by TMA (see _wide_unit)
                    tma.store_wait(0)
                    _stage_chunk(c_bufs.index(HALF), bias_ptr, acc, off_n, N, cols, HAS_BIAS)
                    fence_async_shared()
                    _tma_store(y_desc, [off_m + HALF * half, off_n], c_bufs.index(HALF))
                else:
                    _store(y_ptr, bias_ptr, acc, off_m + HALF * half, off_n, M, N, stride_ym, cols, _PRODUCT_N,
                           HAS_BIAS)
        if MAX_SPLIT > 1:  # this program's units past the whole tiles
            num_units = whole_tiles + (gl.cdiv(M, 2 * half) * gl.cdiv(N, block_n) - whole_tiles) * tail_split
            for u in range(pid + gl.cdiv(gl.maximum(whole_tiles - pid, 0), programs) * programs, num_units, programs):
                tile, first, end = _unit(u, whole_tiles, tail_split, groups_per_split, k_groups)
                off_m, off_n = _tile_offsets(tile, M, N, 2 * half, block_n, GROUP_M)
                if WIDE:
                    it = _wide_unit(y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr, bias_ptr,
                                    part_ptr, count_ptr,
                                    off_m, off_n, M, N, first, end, it, u, whole_tiles, tail_split, stride_xsm,
                                    stride_wsn, stride_wsk, stride_ym, WS_GROUP_N, W_SCALE_UNIFORM, HAS_BIAS, HALF,
                                    True, MAX_SPLIT, TMA_STORE)
                else:
                    offs_m = off_m + HALF * half + gl.arange(0, half, layout=rows)
                    xs_ptrs = xs_ptr + gl.where(offs_m < M, offs_m, 0).to(gl.int64) * stride_xsm
                    ws_ptrs = _scale_ptrs(ws_ptr, off_n, N, stride_wsn, cols, _PRODUCT_N, WS_GROUP_N, W_SCALE_UNIFORM)
                    acc = gl.zeros([half, _PRODUCT_N], gl.float32, layout=mma)
                    acc, it = _k_loop(a_bufs, b_bufs, ready, empty, xs_ptrs, ws_ptrs, acc, first, end, it, stride_wsk,
                                      mma, W_SCALE_UNIFORM, HALF, RELEASE_EVERY)
                    _finish_split(part_ptr, count_ptr, acc, u, whole_tiles, tail_split, y_ptr, bias_ptr,
                                  off_m + HALF * half, off_n, M, N, stride_ym, HAS_BIAS, HALF, MAX_SPLIT)
        if TMA_STORE:
            tma.store_wait(0)  # the boxes stay allocated until the stores have read them

    # gl.warp_specialize takes one function per partition (no constexpr of its own): the two consumers
    # are _consume with HALF 0 and 1.
    @gluon.jit
    def _consume_first(x_desc, w_desc, y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr, bias_ptr,
                       part_ptr, count_ptr,
                       M, N, K, whole_tiles, tail_split, groups_per_split, stride_xsm, stride_wsn, stride_wsk,
                       stride_ym, WS_GROUP_N: gl.constexpr, W_SCALE_UNIFORM: gl.constexpr, HAS_BIAS: gl.constexpr,
                       GROUP_M: gl.constexpr, MAX_SPLIT: gl.constexpr, RELEASE_EVERY: gl.constexpr,
                       TMA_STORE: gl.constexpr):
        _consume(x_desc, w_desc, y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr, bias_ptr,
                 part_ptr, count_ptr,
                 M, N, K, whole_tiles, tail_split, groups_per_split, stride_xsm, stride_wsn, stride_wsk, stride_ym,
                 WS_GROUP_N, W_SCALE_UNIFORM, HAS_BIAS, GROUP_M, MAX_SPLIT, 0, RELEASE_EVERY, TMA_STORE)

    @gluon.jit
    def _consume_second(x_desc, w_desc, y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr, bias_ptr,
                        part_ptr, count_ptr,
                        M, N, K, whole_tiles, tail_split, groups_per_split, stride_xsm, stride_wsn, stride_wsk,
                        stride_ym, WS_GROUP_N: gl.constexpr, W_SCALE_UNIFORM: gl.constexpr, HAS_BIAS: gl.constexpr,
                        GROUP_M: gl.constexpr, MAX_SPLIT: gl.constexpr, RELEASE_EVERY: gl.constexpr,
                        TMA_STORE: gl.constexpr):
        _consume(x_desc, w_desc, y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr, bias_ptr,
                 part_ptr, count_ptr,
                 M, N, K, whole_tiles, tail_split, groups_per_split, stride_xsm, stride_wsn, stride_wsk, stride_ym,
                 WS_GROUP_N, W_SCALE_UNIFORM, HAS_BIAS, GROUP_M, MAX_SPLIT, 1, RELEASE_EVERY, TMA_STORE)

    @gluon.jit
    def _ws_fp8_gemm_kernel(
        x_desc, w_desc, y_desc, xs_ptr, ws_ptr, y_ptr, bias_ptr, part_ptr, count_ptr,
        M, N, K, whole_tiles, tail_split, groups_per_split,
        stride_xsm, stride_wsn, stride_wsk, stride_ym,
        WS_GROUP_N: gl.constexpr, W_SCALE_UNIFORM: gl.constexpr, HAS_BIAS: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, MAX_SPLIT: gl.constexpr, RELEASE_EVERY: gl.constexpr,
        BLOCK_N: gl.constexpr, TMA_STORE: gl.constexpr,
    ):
        """Program p runs work units p, p + P, p + 2P, ... (P programs): the first `whole_tiles` units
        are output tiles in grouped order, the rest K splits of the remaining tiles (tail_plan; only
        with MAX_SPLIT > 1). One unit each when P is the unit count, a persistent loop when smaller."""
        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES] + x_desc.block_type.shape, x_desc.layout)
        # a slot holds BLOCK_N rows of w in boxes of w_desc's (128x192 tiles: three 64-row boxes, TMA
        # boxes and shared-memory shapes being powers of two)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * (BLOCK_N // w_desc.block_type.shape[0])]
                                           + w_desc.block_type.shape, w_desc.layout)
        if TMA_STORE:  # each consumer's boxes of an output tile (BLOCK_N // box columns each)
            c_bufs = gl.allocate_shared_memory(y_desc.dtype, [2 * (BLOCK_N // y_desc.block_type.shape[1])]
                                               + y_desc.block_type.shape, y_desc.layout)
        else:
            c_bufs = a_bufs  # not used
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer

        # The partitions' arguments are written out in each tuple: a tuple assigned to a variable
        # first would turn its constexprs into runtime values.
        gl.warp_specialize([
            (_consume_first, (x_desc, w_desc, y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr,
                              bias_ptr,
                              part_ptr, count_ptr, M, N, K, whole_tiles, tail_split, groups_per_split,
                              stride_xsm, stride_wsn, stride_wsk, stride_ym,
                              WS_GROUP_N, W_SCALE_UNIFORM, HAS_BIAS, GROUP_M, MAX_SPLIT, RELEASE_EVERY, TMA_STORE)),
            (_produce, (x_desc, w_desc, y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr, bias_ptr,
                        part_ptr, count_ptr, M, N, K, whole_tiles, tail_split, groups_per_split,
                        stride_xsm, stride_wsn, stride_wsk, stride_ym,
                        WS_GROUP_N, W_SCALE_UNIFORM, HAS_BIAS, GROUP_M, MAX_SPLIT, RELEASE_EVERY, TMA_STORE)),
            (_consume_second, (x_desc, w_desc, y_desc, a_bufs, b_bufs, c_bufs, ready, empty, xs_ptr, ws_ptr, y_ptr,
                               bias_ptr,
                               part_ptr, count_ptr, M, N, K, whole_tiles, tail_split, groups_per_split,
                               stride_xsm, stride_wsn, stride_wsk, stride_ym,
                               WS_GROUP_N, W_SCALE_UNIFORM, HAS_BIAS, GROUP_M, MAX_SPLIT, RELEASE_EVERY, TMA_STORE)),
        ], [1, 4], [24, 240])  # warps and registers of the producer and the second consumer


def _gl_dtype(dtype: torch.dtype):
    return {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5, torch.bfloat16: gl.bfloat16,
            torch.float16: gl.float16}[dtype]


def _tma_store_refused(y: torch.Tensor, cfg: WsConfig, split: int) -> str:
    return (f"ws_fp8_gemm: tma_store=True needs a 16-bit output with rows of a multiple of 16 bytes and room "
            f"for the output boxes in shared memory (ws_shared_bytes <= {SHARED_LIMIT}); got {y.dtype} output "
            f"with rows of {y.stride(0) * y.element_size()} bytes, {cfg}, a tail split in {split}")


def ws_fp8_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, granularity: str,
                out_dtype: torch.dtype, bias: torch.Tensor | None = None, cfg: WsConfig | None = None,
                counters: torch.Tensor | None = None, release_every: int = RELEASE_EVERY,
                tma_store: bool | None = None) -> torch.Tensor:
    """y (M, N) in `out_dtype` for validated operands that :func:`ws_accepts`: x_q (M, K), w_q (N, K)
    FP8, x_s (M, K/128) row-major, w_s in `granularity`'s layout (0-d for "tensor").

    `counters`: int32 zeros (left zeroed) the split tail tiles count in, where it holds two per tail
    tile (a :func:`fp8linear.ops.splitk_gemm.splitk_counters` does); else fresh zeros per call.
    `release_every`: the consumers release the ring's slots after every K group (1) or in pairs (2,
    RELEASE_EVERY); the same bits either way (benchmarks/ws_gemm_ab.py times both).
    `tma_store`: whole tiles leave through shared memory by TMA (True) or by the consumers' own stores
    (False); None: TMA where :func:`tma_store_pays` and :func:`tma_store_ok`. The same bits either way."""
    if type(release_every) is not int or release_every not in (1, 2):
        raise ValueError(f"ws_fp8_gemm: release_every must be 1 or 2, got {release_every!r}")
    if tma_store is not None and not isinstance(tma_store, bool):
        raise TypeError(f"ws_fp8_gemm: tma_store must be a bool or None, got {type(tma_store).__name__}")
    from .gemm_common import weight_scale_layout  # imports Triton; the router imports this module without it

    cfg = cfg or WsConfig()
    m, k = x_q.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if tma_store and not tma_store_ok(y, cfg, 1):  # also where nothing is launched (the split: below)
        raise ValueError(_tma_store_refused(y, cfg, 1))
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    ws_group_n, stride_wsn, stride_wsk = weight_scale_layout(w_s, granularity)
    x_block = [_HALF_M, GROUP_SIZE]
    w_block = [_CHUNK_COLS if cfg.block_n == 192 else cfg.block_n, GROUP_SIZE]
    fp8 = _gl_dtype(x_q.dtype)
    x_desc = GluonTensorDescriptor.from_tensor(x_q, x_block, gl.NVMMASharedLayout.get_default_for(x_block, fp8))
    w_desc = GluonTensorDescriptor.from_tensor(w_q, w_block, gl.NVMMASharedLayout.get_default_for(w_block, fp8))
    x_s = x_s.contiguous()
    sms = sm_count(x_q.device)
    tiles, whole, split, per_split = ws_plan(m, n, k, cfg, sms)
    units = whole + (tiles - whole) * split
    part = count = y  # unused without a split
    if split > 1:
        tail = tiles - whole
        part = torch.empty((tail * split * 2 * _HALF_M * cfg.block_n,), dtype=torch.float32, device=y.device)
        count = counters if counters is not None and counters.numel() >= 2 * tail else torch.zeros(
            2 * tail, dtype=torch.int32, device=y.device)
    grid = (min(units, sms) if cfg.persistent else units,)  # one program per SM fits (shared memory)
    if tma_store is None:
        tma_store = tma_store_pays(cfg, units, grid[0]) and tma_store_ok(y, cfg, split)
    elif tma_store and not tma_store_ok(y, cfg, split):
        raise ValueError(_tma_store_refused(y, cfg, split))
    y_desc = x_desc  # not used without the TMA store
    if tma_store:
        y_box = [_HALF_M, _PRODUCT_COLS if cfg.block_n == 128 else _CHUNK_COLS]
        y_desc = GluonTensorDescriptor.from_tensor(y, y_box, gl.NVMMASharedLayout.get_default_for(
            y_box, _gl_dtype(y.dtype)))
    max_split = sum_width(split)  # the sum's unrolled width (_sum_store)
    _ws_fp8_gemm_kernel[grid](
        x_desc, w_desc, y_desc, x_s, w_s, y, bias if bias is not None else y, part, count,
        m, n, k, whole, split, per_split,
        x_s.stride(0), stride_wsn, stride_wsk, y.stride(0),
        WS_GROUP_N=ws_group_n, W_SCALE_UNIFORM=granularity != "row",
        HAS_BIAS=bias is not None, GROUP_M=cfg.group_m, STAGES=cfg.stages, MAX_SPLIT=max_split,
        RELEASE_EVERY=release_every, BLOCK_N=cfg.block_n, TMA_STORE=tma_store, num_warps=4, maxnreg=_MAXNREG,
    )
    return y
