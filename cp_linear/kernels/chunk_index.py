"""Chunk bookkeeping for packed sequences, on the device (no host round trip).

From ``cu`` (int32 [N + 1] token offsets) and n_h, one CTA of 1024 threads writes

* ``chunk_offsets`` int32 [N + 1]: exclusive prefix sum of ceil(len_n * n_h / 64) (the global id
  of each sequence's first chunk; ``chunk_offsets[N]`` is the number of chunks);
* ``chunk_start`` / ``chunk_len`` int32 [C_max]: the first step and the number of steps of every
  chunk, for kernels whose grid runs over chunks (one load instead of a chain of three).
  C_max = (S_all + 63 N) // 64 bounds the chunk count without reading ``cu``.

Each thread owns a contiguous run of sequences; a Hillis-Steele scan over the 1024 partial sums
gives every run its offset.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cp_linear.kernels.configs import CHUNK_SIZE, ChunkIndexConfig


class ChunkIndexKernel:
    def __init__(self, config: ChunkIndexConfig):
        config.validate()
        self.threads = config.threads

    @cute.jit
    def __call__(self, cu: cute.Tensor,  # int32 [N + 1]
                 chunk_offsets: cute.Tensor,  # int32 [N + 1]
                 chunk_start: cute.Tensor,  # int32 [C_max]
                 chunk_len: cute.Tensor,  # int32 [C_max]
                 num_householder: Int32, stream):
        num_seqs = cu.shape[0] - 1
        self.kernel(cu, chunk_offsets, chunk_start, chunk_len, num_seqs, num_householder).launch(
            grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, cu: cute.Tensor, chunk_offsets: cute.Tensor, chunk_start: cute.Tensor,
               chunk_len: cute.Tensor, num_seqs: Int32, num_householder: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        allocator = cutlass.memory.SmemAllocator()
        partial = allocator.allocate_tensor(Int32, cute.make_layout((self.threads,)), 16)

        per_thread = (num_seqs + self.threads - 1) // self.threads
        begin = cutlass.min(tidx * per_thread, num_seqs)
        end = cutlass.min(begin + per_thread, num_seqs)
        local = Int32(0)
        for n in range(begin, end):
            steps = (cu[n + 1] - cu[n]) * num_householder
            local += (steps + CHUNK_SIZE - 1) // CHUNK_SIZE
        partial[tidx] = local
        cute.arch.sync_threads()
        offset = 1
        while cutlass.const_expr(offset < self.threads):
            value = partial[tidx]
            if tidx >= offset:
                value += partial[tidx - offset]
            cute.arch.sync_threads()
            partial[tidx] = value
            cute.arch.sync_threads()
            offset *= 2
        running = partial[tidx] - local
        for n in range(begin, end):
            chunk_offsets[n] = running
            seq_start = cu[n] * num_householder  # read once: the stores below may alias cu for the compiler
            steps = cu[n + 1] * num_householder - seq_start
            count = (steps + CHUNK_SIZE - 1) // CHUNK_SIZE
            for m in range(count):
                chunk_start[running + m] = seq_start + CHUNK_SIZE * m
                chunk_len[running + m] = cutlass.min(steps - CHUNK_SIZE * m, CHUNK_SIZE)
            running += count
        if tidx == self.threads - 1:
            chunk_offsets[num_seqs] = partial[tidx]
