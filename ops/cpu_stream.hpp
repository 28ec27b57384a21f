// Streaming (non-temporal) stores for the outputs of the cpu loops bound by memory traffic.
//
// An ordinary store first reads the output's cache line from memory (to own it) and leaves it in
// the caches, pushing the inputs out. When an op's traffic (the bytes it reads and writes) is
// larger than the last-level cache, neither pays: its output will not be in cache for the next op
// anyway. Such loops compute each block of 1 KiB of output into a buffer on the stack (in the L1)
// and copy it to the output with non-temporal stores, which write whole lines without reading
// them. The results are the same bits either way. TESSERA_STREAMING_STORES sets the threshold:
// unset or "auto" (this rank's share of the last-level cache: its size times the rank's compute
// threads over the cores), "off", or a number of bytes (0: always).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace tessera::ops {

/// The traffic in bytes from which an op streams its output (INT64_MAX when off): this rank's
/// share of the last-level cache (its size from sysfs, else 32 MiB, times compute_threads() over
/// the cores) unless TESSERA_STREAMING_STORES says otherwise (InvalidArgument for a value that is
/// neither "auto", "off" nor a byte count; read once); set_streaming_store_threshold overrides
/// it (tests).
int64_t streaming_store_threshold();

/// Overrides the threshold (nullopt: back to the environment's or the cache's).
void set_streaming_store_threshold(std::optional<int64_t> bytes);

/// Whether an op moving `traffic_bytes` streams its output.
inline bool streams_output(int64_t traffic_bytes) {
  return traffic_bytes >= streaming_store_threshold();
}

/// Copies `bytes` from src to dst with non-temporal stores (the widest the cpu_isa_level() has:
/// 512, 256 or 128 bits); dst's bytes before its first 64-byte boundary and after its last are
/// stored normally. No fence: call stream_fence() before another thread reads dst.
void stream_bytes(void* dst, const void* src, size_t bytes);

/// Orders this thread's streaming stores before its later stores (sfence on x86).
void stream_fence();

/// Writes out[lo, hi) through fill(dst, a, b), which stores the values of elements [a, b) to
/// dst[0, b - a): straight into out + a, or with `stream` block by block (1 KiB) into a buffer
/// that stream_bytes copies to out, then a fence. fill must be inlined into its caller's
/// instruction set (a TESSERA_LOOP_BODY lambda); it sees the same element ranges either way
/// apart from their split into blocks, so an element's value must not depend on the split.
template <typename T, typename Fill>
[[gnu::always_inline]] inline void write_output(bool stream, T* out, int64_t lo, int64_t hi,
                                                const Fill& fill) {
  constexpr int64_t kBlock = 1024 / static_cast<int64_t>(sizeof(T));
  if (!stream || hi - lo < 4 * kBlock) {
    fill(out + lo, lo, hi);
    return;
  }
  alignas(64) T buffer[kBlock];
  // Up to out's first 64-byte boundary directly (stream_bytes would store it normally anyway).
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(out + lo) % 64);
  int64_t at = lo;
  if (misaligned != 0 && misaligned % static_cast<int64_t>(sizeof(T)) == 0) {
    const int64_t head = (64 - misaligned) / static_cast<int64_t>(sizeof(T));
    fill(out + at, at, at + head);
    at += head;
  }
  for (; at < hi; at += kBlock) {
    const int64_t end = std::min(hi, at + kBlock);
    fill(buffer, at, end);
    stream_bytes(out + at, buffer, static_cast<size_t>(end - at) * sizeof(T));
  }
  stream_fence();
}

/// write_output for loops with two outputs of one layout: fill(dst1, dst2, a, b) stores the
/// values of elements [a, b) to dst1[0, b - a) and dst2[0, b - a).
template <typename T, typename Fill>
[[gnu::always_inline]] inline void write_outputs(bool stream, T* first, T* second, int64_t lo,
                                                 int64_t hi, const Fill& fill) {
  constexpr int64_t kBlock = 1024 / static_cast<int64_t>(sizeof(T));
  if (!stream || hi - lo < 4 * kBlock) {
    fill(first + lo, second + lo, lo, hi);
    return;
  }
  alignas(64) T buffers[2][kBlock];
  for (int64_t at = lo; at < hi; at += kBlock) {
    const int64_t end = std::min(hi, at + kBlock);
    fill(buffers[0], buffers[1], at, end);
    stream_bytes(first + at, buffers[0], static_cast<size_t>(end - at) * sizeof(T));
    stream_bytes(second + at, buffers[1], static_cast<size_t>(end - at) * sizeof(T));
  }
  stream_fence();
}

}  // namespace tessera::ops
