// Streaming stores (see streaming_stores.hpp).
#include "core/streaming_stores.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <thread>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tessera {

namespace {

/// The last-level cache's size from sysfs (the highest cache index of cpu 0), 32 MiB if unknown.
int64_t last_level_cache_bytes() {
  int64_t best = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream file("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) +
                       "/size");
    std::string text;
    if (!(file >> text) || text.empty()) continue;
    int64_t value = 0;
    size_t digits = 0;
    while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9')
      value = value * 10 + (text[digits++] - '0');
    const char unit = digits < text.size() ? text[digits] : '\0';
    value *= unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : unit == 'G' ? 1024 * 1024 * 1024 : 1;
    best = std::max(best, value);
  }
  return best > 0 ? best : int64_t{32} << 20;
}

constexpr int64_t kAuto = -2;

/// The threshold TESSERA_STREAMING_STORES asks for, kAuto for the cache's share.
int64_t threshold_from_environment() {
  const char* text = std::getenv("TESSERA_STREAMING_STORES");
  const std::string value = text ? text : "";
  if (value.empty() || value == "auto") return kAuto;
  if (value == "off") return std::numeric_limits<int64_t>::max();
  char* end = nullptr;
  const long long bytes = std::strtoll(value.c_str(), &end, 10);
  check_arg(end && *end == '\0' && bytes >= 0, "tensor",
            "TESSERA_STREAMING_STORES={}: expected auto, off or a number of bytes", value);
  return bytes;
}

constexpr int64_t kUnset = -1;
std::atomic<int64_t> override_bytes{kUnset};

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TESSERA_STREAM_WIDE 1
/// 4 with AVX-512, 3 with AVX2, else 0 (the vector width of the streaming stores).
int stream_level() {
  static const int level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 4;
    if (__builtin_cpu_supports("avx2")) return 3;
    return 0;
  }();
  return level;
}

// One loop per vector width; src and dst advance by 64 bytes (dst aligned to 64).
__attribute__((target("avx512f"))) void stream_lines_512(char* dst, const char* src, size_t lines) {
  for (size_t i = 0; i < lines; ++i)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 64 * i),
                        _mm512_loadu_si512(reinterpret_cast<const void*>(src + 64 * i)));
}
__attribute__((target("avx2"))) void stream_lines_256(char* dst, const char* src, size_t lines) {
  for (size_t i = 0; i < lines; ++i) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64 * i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64 * i + 32), b);
  }
}
#endif
#if defined(__x86_64__)
void stream_lines_128(char* dst, const char* src, size_t lines) {
  for (size_t i = 0; i < lines; ++i)
    for (int part = 0; part < 4; ++part)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 64 * i + 16 * part),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 64 * i + 16 * part)));
}
#endif

}  // namespace

int64_t streaming_store_threshold() {
  const int64_t forced = override_bytes.load(std::memory_order_relaxed);
  if (forced != kUnset) return forced;
  static const int64_t asked = threshold_from_environment();
  if (asked != kAuto) return asked;
  // This rank's share of the cache: ranks running the same op at once split it by their cores.
  static const int64_t cache = last_level_cache_bytes();
  static const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  return cache * std::min<int64_t>(compute_threads(), cores) / cores;
}

void set_streaming_store_threshold(std::optional<int64_t> bytes) {
  override_bytes.store(bytes ? std::max<int64_t>(0, *bytes) : kUnset, std::memory_order_relaxed);
}

namespace {
thread_local int64_t scoped_traffic = 0;
}  // namespace

StreamingScope::StreamingScope(int64_t traffic_bytes) : previous_(scoped_traffic) {
  scoped_traffic = traffic_bytes;
}

StreamingScope::~StreamingScope() {
  scoped_traffic = previous_;
}

int64_t StreamingScope::current() {
  return scoped_traffic;
}

void stream_bytes(void* destination, const void* source, size_t bytes) {
  char* dst = static_cast<char*>(destination);
  const char* src = static_cast<const char*>(source);
#if defined(__x86_64__)
  const size_t head = std::min(bytes, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
  const size_t lines = bytes / 64;
#if defined(TESSERA_STREAM_WIDE)
  const int level = stream_level();
  if (level == 4)
    stream_lines_512(dst, src, lines);
  else if (level == 3)
    stream_lines_256(dst, src, lines);
  else
#endif
    stream_lines_128(dst, src, lines);
  dst += 64 * lines, src += 64 * lines, bytes -= 64 * lines;
#endif
  std::memcpy(dst, src, bytes);
}

void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace tessera
