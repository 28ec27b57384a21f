// Streaming (non-temporal) stores for cpu loops and copies bound by memory traffic.
//
// An ordinary store first reads the output's cache line from memory (to own it) and leaves it in
// the caches, pushing the inputs out. When an op's traffic (the bytes it reads and writes) is
// larger than its share of the last-level cache, neither pays: its output will not be in cache
// for the next op anyway. Such loops write their output with non-temporal stores, which write
// whole lines without reading them (ops/cpu_stream.hpp for the elementwise loops; large
// contiguous runs of copy_strided_host). The results are the same bits either way.
// TESSERA_STREAMING_STORES sets the threshold: unset or "auto" (this rank's share of the
// last-level cache: its size times the rank's compute threads over the cores), "off", or a number
// of bytes (0: always).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

namespace tessera {

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

/// While alive, the copies of this thread (copy_strided_host) weigh their traffic as at least
/// `traffic_bytes`: an op made of several copies (concat's pieces into one output) decides for
/// all of them by the whole op's traffic. Scopes nest (the innermost counts).
class StreamingScope {
 public:
  explicit StreamingScope(int64_t traffic_bytes);
  ~StreamingScope();
  StreamingScope(const StreamingScope&) = delete;
  StreamingScope& operator=(const StreamingScope&) = delete;

  /// The traffic of the innermost scope alive on this thread, 0 outside any.
  static int64_t current();

 private:
  int64_t previous_;
};

/// Copies `bytes` from src to dst with non-temporal stores (the widest vectors the cpu has: 512,
/// 256 or 128 bits); dst's bytes before its first 64-byte boundary and after its last are stored
/// normally, so no cache line takes both kinds of store. No fence: call stream_fence() before
/// another thread reads dst.
void stream_bytes(void* dst, const void* src, size_t bytes);

/// Orders this thread's streaming stores before its later stores (sfence on x86).
void stream_fence();

}  // namespace tessera
