// A cpu emulation of the CUDA thread model and of the warp primitives the register-tiled (mma)
// neighborhood-attention kernels use (ops/attention/na_mma.cuh), so that the same kernel source
// runs in the unit tests on a machine without a GPU.
//
// One thread block at a time runs as N cooperative user-level threads (ucontext) on the calling
// OS thread, with a deterministic schedule: a thread runs until it blocks at a __syncthreads or a
// warp collective (or exits), then the next runnable thread in index order (or in reverse order,
// LaunchOptions::reverse) continues. The primitives follow the PTX ISA's definitions:
//  - cp.async (copy_async / commit_async / wait_async<N>): a thread's copies are queued in
//    commit groups and land in shared memory only when that thread's wait_group asks for them,
//    so a stage read before its wait (or by another thread before a barrier) shows what was there
//    before: the fill pattern (NaN as f16/bf16/f32) or an older chunk;
//  - ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 and mma.sync.aligned.m16n8k16.row.col with
//    f32 accumulation (f16, bf16): warp collectives computed from all 32 lanes' operands with the
//    ISA's fragment layouts; products are exact and the sum is rounded to f32 once;
//  - __shfl_xor_sync on any trivially copyable value of up to 8 bytes, __reduce_or_sync.
// Every collective checks its participants: all 32 lanes of the warp at the same collective (the
// same call site), all threads of the block at the same __syncthreads, no thread exited while
// others wait for it, shared-memory operands inside the block's shared memory and aligned. The
// shared memory the asynchronous copies write and ldmatrix reads is checked for races per 16-byte
// granule and barrier interval: a read of bytes whose copy has not landed (no wait_async of the
// copying thread yet) or landed from another warp since the last __syncthreads, and a copy into
// bytes another warp read, or another thread is still copying into, since the last barrier.
// Plain loads and stores of shared memory are not seen by these checks.
// A violation (and __trap) prints a message naming the block, the threads and the call sites and
// aborts: it is a kernel bug.
//
// What this proves and what not: the kernels' indexing, masking, arithmetic, softmax, fragment
// bookkeeping and synchronisation as the ISA defines the instructions; not the hardware's timing,
// bank conflicts, register pressure, or the real instructions beyond their ISA definition.
//
// Use: include this header (it includes the kernel headers after defining what they need) and
// run a kernel with emu::launch(grid, threads, shared_bytes, [&] { kernel<...>(args...); }).
#pragma once

#define TESSERA_NA_EMULATE 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <source_location>
#include <string>
#include <type_traits>

namespace tessera::emu {

/// How launch runs the blocks.
struct LaunchOptions {
  /// Schedule the threads in descending index order (a missing barrier between a write and a
  /// read of shared memory shows in one of the two orders).
  bool reverse = false;
  /// The byte shared memory is filled with before each block (0xFF: NaN as f16, bf16 and f32).
  unsigned char shared_fill = 0xFF;
  /// Stack bytes of each emulated thread.
  size_t stack_bytes = size_t(256) << 10;
};

/// What the last launch did (for the tests' reports).
struct LaunchStats {
  uint64_t blocks = 0, switches = 0, barriers = 0, warp_collectives = 0, async_copies = 0;
};

/// Runs `kernel` once per thread of every block of `grid` (blocks one after another, x fastest),
/// `threads` threads per block (1-d blocks), with `shared_bytes` of dynamic shared memory.
void launch(dim3 grid, unsigned threads, size_t shared_bytes, const std::function<void()>& kernel,
            const LaunchOptions& options = {});

/// The counters of the last launch on this OS thread.
const LaunchStats& last_launch_stats();

/// The current emulated thread's built-in variables.
const uint3& thread_index();
const uint3& block_index();
const dim3& block_dim();
const dim3& grid_dim();

/// The current block's dynamic shared memory (128-byte aligned).
unsigned char* shared_memory();

/// Prints `message` with the current block and thread and aborts (a kernel bug).
[[noreturn]] void fail(const std::string& message);

/// A block barrier: every thread of the block must reach this same call site.
void sync_threads(std::source_location site);

/// A warp collective computed from all lanes' operands: `op(in, out)` runs once, when the last
/// of the 32 lanes arrives, with each lane's `in` and `out` pointers (the lanes' own variables,
/// alive while they wait). `name` and the call site must agree over the warp.
using WarpOp = void (*)(const void* const in[32], void* const out[32]);
void warp_collective(const char* name, WarpOp op, const void* in, void* out,
                     std::source_location site);

/// Aborts unless [address, address + bytes) lies in the block's shared memory and address is a
/// multiple of `alignment`.
void check_shared(const void* address, size_t bytes, size_t alignment, const char* what,
                  std::source_location site);

/// Records an ldmatrix read of the 16 shared bytes at `address` by warp `warp`; aborts when a
/// cp.async into them has not landed, or landed from another warp since the last barrier.
void check_shared_read(const void* address, int warp, std::source_location site);

/// cp.async of 16 bytes for the current thread (zeros when !valid), its commit and its wait.
void async_copy(void* shared, const void* global, bool valid, std::source_location site);
void async_commit();
void async_wait(int pending);

namespace detail {
struct ShuffleIn {
  const void* value;
  int lane_mask;
  size_t bytes;
};
void shuffle_xor(const void* const in[32], void* const out[32]);
void reduce_or(const void* const in[32], void* const out[32]);
}  // namespace detail

}  // namespace tessera::emu

// The CUDA built-ins the kernels name. The CUDA headers compiled by a host compiler define
// __device__, __global__ and __forceinline__ (as nothing or plain inline); __launch_bounds__ is
// device-only.
#if !defined(__launch_bounds__)
#define __launch_bounds__(...)
#endif
#define threadIdx (::tessera::emu::thread_index())
#define blockIdx (::tessera::emu::block_index())
#define blockDim (::tessera::emu::block_dim())
#define gridDim (::tessera::emu::grid_dim())

inline void __syncthreads(std::source_location site = std::source_location::current()) {
  ::tessera::emu::sync_threads(site);
}

/// The value of lane (this lane ^ lane_mask); every lane of the warp must call it (full masks
/// only: the kernels use no other).
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32,
                  std::source_location site = std::source_location::current()) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                "__shfl_xor_sync exchanges values of up to 8 bytes");
  if (mask != 0xffffffffu || width != 32)
    ::tessera::emu::fail(
        "__shfl_xor_sync with a partial mask or width: the emulator supports "
        "full warps only");
  if (lane_mask < 0 || lane_mask > 31) ::tessera::emu::fail("__shfl_xor_sync lane mask past 31");
  const ::tessera::emu::detail::ShuffleIn in{&value, lane_mask, sizeof(T)};
  T result;
  ::tessera::emu::warp_collective("__shfl_xor_sync", ::tessera::emu::detail::shuffle_xor, &in,
                                  &result, site);
  return result;
}

/// The bitwise or of every lane's value (__reduce_or_sync, sm_80); full masks only.
inline unsigned __reduce_or_sync(unsigned mask, unsigned value,
                                 std::source_location site = std::source_location::current()) {
  if (mask != 0xffffffffu)
    ::tessera::emu::fail("__reduce_or_sync with a partial mask: the emulator supports full warps");
  unsigned result = 0;
  ::tessera::emu::warp_collective("__reduce_or_sync", ::tessera::emu::detail::reduce_or, &value,
                                  &result, site);
  return result;
}

[[noreturn]] inline void __trap() {
  ::tessera::emu::fail("__trap()");
}

// What na_mma.cuh expects from an emulation.
#define TESSERA_NA_MMA 1
#define TESSERA_NA_DYNAMIC_SHARED(name) unsigned char* name = ::tessera::emu::shared_memory()

namespace tessera::ops::kernels::mma_detail {

/// 16 bytes from global to shared memory, landing at this thread's wait_async that covers its
/// group; zeros when !valid (global is not read).
inline void copy_async(void* shared, const void* global, bool valid,
                       std::source_location site = std::source_location::current()) {
  ::tessera::emu::async_copy(shared, global, valid, site);
}
inline void commit_async() {
  ::tessera::emu::async_commit();
}
/// Lands this thread's oldest groups until at most N are pending.
template <int N>
void wait_async() {
  ::tessera::emu::async_wait(N);
}

/// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane l gives the address of row l % 8 of matrix
/// l / 8; r[i] holds elements (l / 4, 2 (l % 4)) (low half) and (l / 4, 2 (l % 4) + 1) of
/// matrix i.
void load_matrices(uint32_t r[4], const void* row,
                   std::source_location site = std::source_location::current());
/// The same with .trans: r[i] holds elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
void load_matrices_transposed(uint32_t r[4], const void* row,
                              std::source_location site = std::source_location::current());

/// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.f32: c += A B over the warp's fragments
/// (group g = l / 4, t = l % 4: a = A[g][2t..], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..];
/// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; c = C[g][2t..2t+1], C[g+8][2t..2t+1]).
void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __nv_bfloat16,
         std::source_location site = std::source_location::current());
void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __half,
         std::source_location site = std::source_location::current());

}  // namespace tessera::ops::kernels::mma_detail

#include "ops/attention/na_mma.cuh"
#include "ops/attention/na_mma_forward.cuh"
