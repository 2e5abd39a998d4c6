"""Warp-level tensor-core helpers shared by the GDP kernels (imported only when compiling).

Products run on ``mma.sync`` m16n8k16 (bf16/fp16 operands, float32 accumulation), tiled over
the CTA's warps along M: warp w owns rows [16 w, 16 w + 16) of every product, so a product
whose rows are the state's rows never needs another warp's data. Operands come either from
shared memory through ``ldmatrix`` (``SmemOperand``) or from registers, by reading a float32
accumulator as an A operand (``accumulator_as_a``: the C fragment of two adjacent n8 tiles is
the A fragment of one k16 slice).

Shared-memory tiles are bf16/fp16, rows of 64 elements swizzled (3, 3, 3) so that ``ldmatrix``
and the 16-byte ``cp.async`` stores are free of bank conflicts.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

COPY_BITS = 128


def smem_tile_layout(rows: int, cols: int):
    """Swizzled [rows, cols] layout for 16-bit elements (cols a multiple of 64, rows of 8)."""
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
    return cute.tile_to_shape(atom, (rows, cols), (0, 1))


def transposed_view(tile: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
    """[cols, rows] view of a [rows, cols] tile (element (c, r) is tile[r, c])."""
    return cute.composition(tile, cute.make_layout((cols, rows), stride=(rows, 1)))


def make_tiled_mma(dtype, warps: int):
    return cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)), (warps, 1, 1),
                               permutation_mnk=(warps * 16, 16, 16))


def make_step_rows_mma(dtype, warps: int):
    """mma.sync tiled over 64 rows (steps) by 4 warps, the other warps splitting N."""
    return cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)), (4, warps // 4, 1),
                               permutation_mnk=(64, 16, 16))


def make_g2s_copy(dtype, threads: int):
    """cp.async of 16-byte vectors; 8 threads cover one 64-element row."""
    elems = COPY_BITS // dtype.width
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=COPY_BITS)
    per_row = 64 // elems
    return cute.make_tiled_copy_tv(atom, cute.make_layout((threads // per_row, per_row), stride=(per_row, 1)),
                                   cute.make_layout((1, elems)))


@cute.jit
def copy_rows(tiled_copy: cute.TiledCopy, tidx, src: cute.Tensor, dst: cute.Tensor, valid_rows,
              zero_fill: cutlass.Constexpr):
    """Copy the rows r < ``valid_rows`` of ``src`` [rows, cols] to ``dst`` with ``tiled_copy``; with
    ``zero_fill`` the other rows of ``dst`` are set to zero instead."""
    thr = tiled_copy.get_slice(tidx)
    s = thr.partition_S(src)
    d = thr.partition_D(dst)
    coords = thr.partition_S(cute.make_identity_tensor(src.shape))
    for m in cutlass.range_constexpr(cute.size(s.shape[1])):
        if coords[0, m, 0][0] < valid_rows:
            cute.copy(tiled_copy, s[None, m, None], d[None, m, None])
        else:
            if cutlass.const_expr(zero_fill):
                d[None, m, None].fill(0)


@cute.jit
def copy_rows_g2s(tiled_copy: cute.TiledCopy, tidx, src: cute.Tensor, dst: cute.Tensor, valid_rows):
    """Asynchronously copy ``src`` [rows, cols] (global) to ``dst`` (shared); rows >= valid_rows
    are zero-filled instead, so padded rows never carry stale or non-finite data."""
    copy_rows(tiled_copy, tidx, src, dst, valid_rows, True)


@cute.jit
def load_row_flags(tiled_copy: cute.TiledCopy, tidx, tile_shape, flags: cute.Tensor, valid_rows, rows_per_flag,
                   out: cute.Tensor):
    """out[m] <- the flag of this thread's m-th row of a [rows, cols] tile copied with ``tiled_copy``:
    ``flags[row // rows_per_flag]`` (uint8: one head's token flags from the tile's first token), the index
    clamped to the rows below ``valid_rows`` (rows past them are zero-filled anyway), for
    ``zero_flagged_rows``. Rows of the same index m are the same rows in every tile of as many rows,
    whatever its columns."""
    thr = tiled_copy.get_slice(tidx)
    coords = thr.partition_S(cute.make_identity_tensor(tile_shape))
    last = cutlass.max(valid_rows - 1, 0)
    for m in cutlass.range_constexpr(cute.size(coords.shape[1])):
        out[m] = flags[cutlass.min(coords[0, m, 0][0], last) // rows_per_flag]


@cute.jit
def zero_flagged_rows(tiled_copy: cute.TiledCopy, tidx, dst: cute.Tensor, row_flags: cute.Tensor):
    """Zero this thread's rows of the shared tile ``dst`` whose ``load_row_flags`` value is nonzero. Call it
    after the copies' wait and before the barrier that publishes the tile: a thread zeroes only the vectors
    it copied itself, so no barrier is needed in between."""
    thr = tiled_copy.get_slice(tidx)
    d = thr.partition_D(dst)
    for m in cutlass.range_constexpr(cute.size(d.shape[1])):
        if row_flags[m] != cutlass.Uint8(0):
            d[None, m, None].fill(0)


@cute.jit
def store_row_flags(tiled_copy: cute.TiledCopy, tidx, tile_shape, row_flags: cute.Tensor, dst: cute.Tensor):
    """dst[row] <- the ``load_row_flags`` value of each of this thread's rows of a [rows, cols] tile (``dst``:
    uint8 [rows] in shared memory). The threads that copy a row store the same value; publish it with the
    barrier that publishes the tile."""
    thr = tiled_copy.get_slice(tidx)
    coords = thr.partition_S(cute.make_identity_tensor(tile_shape))
    for m in cutlass.range_constexpr(cute.size(coords.shape[1])):
        dst[coords[0, m, 0][0]] = row_flags[m]


def row_flags_fragment(tiled_copy: cute.TiledCopy, tidx, tile_shape) -> cute.Tensor:
    """A uint8 register tensor for ``load_row_flags`` of a tile of ``tile_shape``."""
    rows = cute.size(tiled_copy.get_slice(tidx).partition_S(cute.make_identity_tensor(tile_shape)).shape[1])
    return cute.make_rmem_tensor(cute.make_layout((rows,)), cutlass.Uint8)


def make_s2g_copy(dtype, threads: int, cols: int = 64):
    """16-byte vector stores from a shared tile (rows of ``cols`` elements, 16-byte aligned) to global
    memory: full 32-byte sectors, unlike per-element stores from MMA fragments."""
    elems = COPY_BITS // dtype.width
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=COPY_BITS)
    per_row = cols // elems
    return cute.make_tiled_copy_tv(atom, cute.make_layout((threads // per_row, per_row), stride=(per_row, 1)),
                                   cute.make_layout((1, elems)))


@cute.jit
def copy_tile_s2g(tiled_copy: cute.TiledCopy, tidx, src: cute.Tensor, dst: cute.Tensor):
    """Copy the shared tile ``src`` [rows, cols] to ``dst`` (global, 16-byte aligned rows), all rows."""
    thr = tiled_copy.get_slice(tidx)
    cute.copy(tiled_copy, thr.partition_S(src), thr.partition_D(dst))


@cute.jit
def copy_rows_s2g(tiled_copy: cute.TiledCopy, tidx, src: cute.Tensor, dst: cute.Tensor, valid_rows):
    """Copy the rows r < ``valid_rows`` of the shared tile ``src`` [rows, cols] to ``dst`` (global)."""
    copy_rows(tiled_copy, tidx, src, dst, valid_rows, False)


def staging_view(buffer: cute.Tensor, dtype, rows: int, cols: int, transpose: bool = False) -> cute.Tensor:
    """A [rows, cols] row-major view of the shared staging ``buffer`` in ``dtype``, rows padded by 16 bytes
    (fewer bank conflicts when MMA fragments are written in); ``transpose``: the [cols, rows] view of it."""
    pitch = cols + 128 // dtype.width
    pointer = cute.recast_ptr(buffer.iterator, dtype=dtype)
    if transpose:
        return cute.make_tensor(pointer, cute.make_layout((cols, rows), stride=(1, pitch)))
    return cute.make_tensor(pointer, cute.make_layout((rows, cols), stride=(pitch, 1)))


@cute.jit
def stage_accumulator(acc: cute.Tensor, coords: cute.Tensor, view: cute.Tensor, col_scales=None, row0=None,
                      col0=None):
    """view[r, c] = acc (times ``col_scales[c]``), converted to the view's dtype, at each element's
    coordinates; with ``row0`` (or ``col0``) only the rows (columns) from there that the view holds,
    shifted to its origin: one 64-wide slice of a wider accumulator."""
    for e in cutlass.range_constexpr(cute.size(acc)):
        r, c = coords[e]
        value = acc[e]
        if cutlass.const_expr(col_scales is not None):
            value = value * col_scales[c]
        if cutlass.const_expr(row0 is not None):
            if (r >= row0) & (r < row0 + cute.size(view, mode=[0])):
                view[r - row0, c] = value.to(view.element_type)
        elif cutlass.const_expr(col0 is not None):
            if (c >= col0) & (c < col0 + cute.size(view, mode=[1])):
                view[r, c - col0] = value.to(view.element_type)
        else:
            view[r, c] = value.to(view.element_type)


def make_stmatrix_copy_c(tiled_mma, dtype) -> cute.TiledCopy:
    """``stmatrix`` (four 8x8 matrices of 16-bit elements per warp instruction) tiled over the C layout
    of ``tiled_mma`` (``mma.sync`` or warpgroup MMA): each lane stores 16 bytes per instruction, a row of
    8 elements of one matrix, instead of one 2-byte element per store."""
    atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    return cute.make_tiled_copy_C(atom, tiled_mma)


def stmatrix_c_partitions(tiled_copy: cute.TiledCopy, tidx, acc: cute.Tensor, view: cute.Tensor):
    """(source, destination) of thread ``tidx`` for ``make_stmatrix_copy_c``, each (8, instructions):
    column j is the 8 values one stmatrix instruction takes from this thread (``acc``, in the MMA's C
    layout, retiled) and the row of ``view`` it stores this thread's address for. The copy's partitions
    are ((8 values of an instruction, repeats), M, N): an instruction's values come first in their flat
    order, so the (8, n) compact view of the flat order groups them."""
    thr_copy = tiled_copy.get_slice(tidx)
    dst = thr_copy.partition_D(view)
    per_call = cute.make_layout((8, cute.size(dst) // 8))
    return cute.composition(thr_copy.retile(acc), per_call), cute.composition(dst, per_call)


def stage_accumulator_stmatrix(tiled_mma, tidx, acc: cute.Tensor, view: cute.Tensor) -> None:
    """``stage_accumulator(acc, coords, view)`` (coords: ``tiled_mma``'s C partition of the view's
    shape) through ``stmatrix``: the float32 accumulator ``acc`` of ``tiled_mma`` is converted to the
    view's 16-bit dtype in registers, 8 values at a time (a whole-fragment conversion kept 32 more
    registers live and spilled in one mma.sync config), and stored 16 bytes per lane. ``view`` [rows,
    cols] in shared memory: any layout whose rows hold runs of 8 contiguous, 16-byte aligned elements
    (``smem_tile_layout``: its (3, 3, 3) swizzle moves whole 8-element runs). A plain function: its loop
    runs at trace time (callable inside run-time loops)."""
    dtype = view.element_type
    tiled_copy = make_stmatrix_copy_c(tiled_mma, dtype)
    src, dst = stmatrix_c_partitions(tiled_copy, tidx, acc, view)
    piece = cute.make_rmem_tensor(cute.make_layout((8,)), dtype)
    for j in range(cute.size(dst, mode=[1])):
        piece.store(src[None, j].load().to(dtype))
        cute.copy(tiled_copy, piece, dst[None, j])


class SmemOperand:
    """One shared-memory operand (A or B) of ``tiled_mma``, loaded k-slice by k-slice by ldmatrix."""

    def __init__(self, tiled_mma, tidx, tile: cute.Tensor, dtype, *, operand: str, transpose: bool):
        thr_mma = tiled_mma.get_slice(tidx)
        atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), dtype)
        if operand == "A":
            self.fragment = thr_mma.make_fragment_A(thr_mma.partition_A(tile))
            tiled_copy = cute.make_tiled_copy_A(atom, tiled_mma)
        else:
            self.fragment = thr_mma.make_fragment_B(thr_mma.partition_B(tile))
            tiled_copy = cute.make_tiled_copy_B(atom, tiled_mma)
        thr_copy = tiled_copy.get_slice(tidx)
        self.tiled_copy = tiled_copy
        self.source = thr_copy.partition_S(tile)
        self.view = thr_copy.retile(self.fragment)

    def k_slices(self) -> int:
        return cute.size(self.source.shape[2])

    def load(self, k: int):
        cute.copy(self.tiled_copy, self.source[None, None, k], self.view[None, None, k])


def accumulator_as_a(acc: cute.Tensor, dtype) -> cute.Tensor:
    """The float32 accumulator ``acc`` (C layout, N extent n) rounded to ``dtype`` and viewed as
    the A operand of a product with K extent n: (4, M, N) -> ((4, 2), M, N / 2)."""
    converted = cute.make_fragment_like(acc, dtype)
    converted.store(acc.load().to(dtype))
    divided = cute.logical_divide(converted.layout, (None, None, 2))
    view = cute.make_layout(
        ((divided.shape[0], divided.shape[2][0]), divided.shape[1], divided.shape[2][1]),
        stride=((divided.stride[0], divided.stride[2][0]), divided.stride[1], divided.stride[2][1]))
    return cute.make_tensor(converted.iterator, view)


@cute.jit
def gemm_smem_b(tiled_mma, acc: cute.Tensor, a_fragment: cute.Tensor, b: SmemOperand):
    """acc += A B^T over every k-slice, B from shared memory (A already in registers)."""
    b.load(0)
    for k in cutlass.range_constexpr(b.k_slices()):
        if cutlass.const_expr(k + 1 < b.k_slices()):
            b.load(k + 1)
        cute.gemm(tiled_mma, acc, a_fragment[None, None, k], b.fragment[None, None, k], acc)


@cute.jit
def gemm_smem_ab(tiled_mma, acc: cute.Tensor, a: SmemOperand, b: SmemOperand):
    """acc += A B^T over every k-slice, both operands from shared memory."""
    a.load(0)
    b.load(0)
    for k in cutlass.range_constexpr(b.k_slices()):
        if cutlass.const_expr(k + 1 < b.k_slices()):
            a.load(k + 1)
            b.load(k + 1)
        cute.gemm(tiled_mma, acc, a.fragment[None, None, k], b.fragment[None, None, k], acc)


@cute.jit
def gemm_smem_ab_rolled(tiled_mma, acc: cute.Tensor, a: SmemOperand, b: SmemOperand):
    """``gemm_smem_ab`` as a run-time loop over k-slices (no prefetch): for code that runs once per
    CTA, where unrolled instructions are fetched once and never reused."""
    a_copy, a_source, a_view, a_fragment = a.tiled_copy, a.source, a.view, a.fragment
    b_copy, b_source, b_view, b_fragment = b.tiled_copy, b.source, b.view, b.fragment
    for k in cutlass.range(b.k_slices(), unroll=1):
        cute.copy(a_copy, a_source[None, None, k], a_view[None, None, 0])
        cute.copy(b_copy, b_source[None, None, k], b_view[None, None, 0])
        cute.gemm(tiled_mma, acc, a_fragment[None, None, 0], b_fragment[None, None, 0], acc)


# ------------------------------------------------------------------------------------------ wgmma (Hopper)


def wgmma_tile_layout(dtype, rows: int, cols: int, stages: int):
    """[rows, cols, stages] shared tile, ``cols`` contiguous, in the 128-byte-swizzled K-major layout
    that warpgroup MMAs read directly (cols a multiple of 64 for 16-bit types, rows of 8)."""
    from cutlass.cute.nvgpu import warpgroup

    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def wgmma_tile(allocator, dtype, rows: int, cols: int) -> cute.Tensor:
    """A single [rows, cols] shared tile in ``wgmma_tile_layout`` (the swizzle on the pointer, as warpgroup
    MMA descriptors want it)."""
    layout = wgmma_tile_layout(dtype, rows, cols, 1)
    return allocator.allocate_tensor(dtype, layout.outer, 1024, swizzle=layout.inner)[None, None, 0]


def wgmma_tile_at(region: cute.Tensor, byte_offset: int, dtype, rows: int, cols: int) -> cute.Tensor:
    """A [rows, cols] ``wgmma_tile_layout`` tile carved out of the float32 shared ``region`` at
    ``byte_offset`` (a multiple of 1024): tiles that share memory with a later use of the region."""
    return wgmma_tile_on(region.iterator + byte_offset // 4, dtype, rows, cols)


def wgmma_tile_on(pointer, dtype, rows: int, cols: int) -> cute.Tensor:
    """A [rows, cols] ``wgmma_tile_layout`` tile at the shared ``pointer`` (1024-byte aligned)."""
    layout = wgmma_tile_layout(dtype, rows, cols, 1)
    return cute.make_tensor(cute.recast_ptr(pointer, layout.inner, dtype), layout.outer)[None, None, 0]


def as_wgmma_tile(tile: cute.Tensor, dtype, rows: int, cols: int) -> cute.Tensor:
    """A 16-bit ``smem_tile_layout`` tile (1024-byte aligned) as a warpgroup-MMA tile: the same memory, its
    swizzle on the pointer (the 128-byte swizzle of 16-bit elements is ``smem_tile_layout``'s (3, 3, 3))."""
    return wgmma_tile_on(tile.iterator, dtype, rows, cols)


def wgmma_transposed_view(tile: cute.Tensor, dtype, rows: int, cols: int, stages: int) -> cute.Tensor:
    """The memory of a ``wgmma_tile_layout(dtype, rows, cols, stages)`` tile indexed [cols, rows, stages],
    as an MN-major operand: the MN-major 128-byte atom, tiled K mode first, maps (c, r) to the offset
    the K-major tile gives (r, c)."""
    from cutlass.cute.nvgpu import warpgroup

    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dtype)
    layout = cute.tile_to_shape(atom, (cols, rows, stages), (1, 0, 2))
    return cute.make_tensor(cute.recast_ptr(tile.iterator, layout.inner, dtype), layout.outer)


def wgmma_transposed(tile: cute.Tensor, dtype, rows: int, cols: int) -> cute.Tensor:
    """The [cols, rows] MN-major view of a single-stage [rows, cols] ``wgmma_tile_layout`` tile."""
    return wgmma_transposed_view(tile, dtype, rows, cols, 1)[None, None, 0]


def make_wgmma(dtype, warpgroups: int, n: int, *, a_from_smem: bool = False, a_mn_major: bool = False,
               b_mn_major: bool = False):
    """Warpgroup MMA tiled over ``warpgroups`` x 64 rows, N = ``n``: A from registers (K-major) or
    from shared memory (K-major or MN-major), B from shared memory (K-major or MN-major)."""
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    if a_mn_major and not a_from_smem:
        raise ValueError("an A operand from registers is K-major")
    op = warpgroup.MmaF16BF16Op(
        dtype, cutlass.Float32, (64, n, 16),
        warpgroup.OperandSource.SMEM if a_from_smem else warpgroup.OperandSource.RMEM,
        OperandMajorMode.MN if a_mn_major else OperandMajorMode.K,
        OperandMajorMode.MN if b_mn_major else OperandMajorMode.K)
    return cute.make_tiled_mma(cute.make_mma_atom(op), cute.make_layout((warpgroups, 1, 1)))


def wgmma_operand(thr, tile: cute.Tensor, operand: str) -> cute.Tensor:
    """The warpgroup-MMA fragment (shared-memory descriptors) of ``tile`` as operand "A" or "B" of ``thr``."""
    if operand == "A":
        return thr.make_fragment_A(thr.partition_A(tile))
    return thr.make_fragment_B(thr.partition_B(tile))


def scaled(acc: cute.Tensor, scale: float) -> cute.Tensor:
    """A float32 copy of the register tensor ``acc`` times the trace-time constant ``scale``."""
    out = cute.make_fragment_like(acc, cutlass.Float32)
    for e in range(cute.size(acc)):  # trace-time loop
        out[e] = acc[e] * scale
    return out


def accumulator_as_wgmma_a(acc: cute.Tensor, tiled_mma, dtype) -> cute.Tensor:
    """A float32 warpgroup-MMA accumulator rounded to ``dtype`` and laid out as the register A
    operand of ``tiled_mma`` (whose K extent is the accumulator's N): each (2, 2, N/8) value mode
    is regrouped into k16 slices of (2, 2, 2) values."""
    a_values = tiled_mma.tv_layout_A.shape[1]
    c = acc.layout
    slices = cute.size(c, mode=[0]) // cute.size(a_values)
    layout = cute.make_layout(
        (a_values, c.shape[1], (c.shape[2], slices)),
        stride=(c.stride[0], c.stride[1], (c.stride[2], cute.size(a_values, mode=[2]) * c.stride[0][2])))
    operand = cute.make_rmem_tensor_like(layout, dtype)
    cute.make_tensor(operand.iterator, c).store(acc.load().to(dtype))
    return operand


def wgmma(tiled_mma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, accumulate: bool) -> None:
    """acc (+)= A B^T over every k-slice on the warpgroup tensor cores, then wait for completion
    (``wgmma_sum`` of one product).

    ``accumulate`` False starts from zero (the accumulator's registers are not read)."""
    wgmma_sum(acc, [(tiled_mma, a, b)], accumulate)


def wgmma_sum(acc: cute.Tensor, products, accumulate: bool = True) -> None:
    """acc (+)= sum of A B^T over ``products`` [(tiled_mma, A, B)] (MMAs of one C layout) on the warpgroup
    tensor cores: every product issued, one commit, one wait (``accumulate`` False: acc starts at zero)."""
    from cutlass.cute.nvgpu import warpgroup

    warpgroup.fence()
    for index, (tiled_mma, a, b) in enumerate(products):
        for k in range(cute.size(a, mode=[2])):  # trace-time loops (a plain function, not cute.jit)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, accumulate or index > 0 or k > 0)
            cute.gemm(tiled_mma, acc, a[None, None, k], b[None, None, k], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


# ------------------------------------------------------------------ float32 products on bf16 tensor cores


def _fragment(view: cute.Tensor, dtype) -> cute.Tensor:
    """A register operand shaped like the partition ``view``, compact in its logical (column-major)
    order: ``mma.sync`` packs adjacent elements into one register, so the order must be the MMA's
    own, not ``make_fragment_like``'s copy of the shared-memory stride order (wrong for a
    transposed view)."""
    return cute.make_rmem_tensor(cute.make_layout(view.shape), dtype)


@cute.jit
def _split_bf16(values, big: cute.Tensor, small: cute.Tensor):
    """float32 ``values`` -> big = bf16(values), small = bf16(values - big): big + small carries 16
    significant bits (relative error <= 2^-17)."""
    rounded = values.to(cutlass.BFloat16)
    big.store(rounded)
    small.store((values - rounded.to(cutlass.Float32)).to(cutlass.BFloat16))


@cute.jit
def gemm_f32_split(tiled_mma, tidx, acc: cute.Tensor, a_tile: cute.Tensor, b_tile: cute.Tensor):
    """acc += A B^T to about float32 accuracy on a bf16 ``tiled_mma``: A [M, Kx] and B [N, Kx] float32
    in shared memory, any layout (plain or transposed views). Both are split into bf16 big + small and
    the product is big big + big small + small big (the 3xTF32 recipe with bf16 halves: relative
    error ~2^-16)."""
    thr = tiled_mma.get_slice(tidx)
    part_a = thr.partition_A(a_tile)
    part_b = thr.partition_B(b_tile)
    a_big = _fragment(part_a[None, None, 0], cutlass.BFloat16)
    a_small = _fragment(part_a[None, None, 0], cutlass.BFloat16)
    b_big = _fragment(part_b[None, None, 0], cutlass.BFloat16)
    b_small = _fragment(part_b[None, None, 0], cutlass.BFloat16)
    # a rolled loop: these kernels run each product once per CTA, so unrolled code is fetched once
    # and never reused (ncu: half the stall cycles were instruction fetch)
    for k in cutlass.range(cute.size(part_a, mode=[2]), unroll=1):
        _split_bf16(part_a[None, None, k].load(), a_big, a_small)
        _split_bf16(part_b[None, None, k].load(), b_big, b_small)
        cute.gemm(tiled_mma, acc, a_small, b_big, acc)
        cute.gemm(tiled_mma, acc, a_big, b_small, acc)
        cute.gemm(tiled_mma, acc, a_big, b_big, acc)


@cute.jit
def gemm_f32_by_16bit(tiled_mma, tidx, acc: cute.Tensor, a_tile: cute.Tensor, b: SmemOperand,
                      b_is_bf16: cutlass.Constexpr):
    """acc += A B^T with A [M, Kx] float32 in shared memory (split into bf16 big + small) and B a
    16-bit ``SmemOperand`` (ldmatrix): bf16 B is exact (two products); fp16 B is split too (exactly:
    11 significant bits fit in two bf16 halves; three products)."""
    thr = tiled_mma.get_slice(tidx)
    part_a = thr.partition_A(a_tile)
    a_big = _fragment(part_a[None, None, 0], cutlass.BFloat16)
    a_small = _fragment(part_a[None, None, 0], cutlass.BFloat16)
    # laid out like the ldmatrix fragment they replace, in the MMA's type (bf16 even for an fp16 B)
    b_big = cute.make_fragment_like(b.fragment[None, None, 0], cutlass.BFloat16)
    b_small = cute.make_fragment_like(b.fragment[None, None, 0], cutlass.BFloat16)
    # rolled, as in gemm_f32_split; the operand's pieces as plain tensors (a Python object cannot be
    # carried through a run-time loop)
    b_copy, b_source, b_view, b_fragment = b.tiled_copy, b.source, b.view, b.fragment
    for k in cutlass.range(b.k_slices(), unroll=1):
        cute.copy(b_copy, b_source[None, None, k], b_view[None, None, 0])
        _split_bf16(part_a[None, None, k].load(), a_big, a_small)
        if cutlass.const_expr(b_is_bf16):
            cute.gemm(tiled_mma, acc, a_small, b_fragment[None, None, 0], acc)
            cute.gemm(tiled_mma, acc, a_big, b_fragment[None, None, 0], acc)
        else:
            _split_bf16(b_fragment[None, None, 0].load().to(cutlass.Float32), b_big, b_small)
            cute.gemm(tiled_mma, acc, a_small, b_big, acc)
            cute.gemm(tiled_mma, acc, a_big, b_small, acc)
            cute.gemm(tiled_mma, acc, a_big, b_big, acc)
