// Device: where a tensor's storage lives (host memory or one CUDA device).
#pragma once

#include <string>

namespace tessera {

/// A memory space: the host, or CUDA device `index`.
struct Device {
  enum class Kind : uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  /// Host memory.
  static Device cpu() { return {Kind::cpu, 0}; }
  /// CUDA device `index`.
  static Device cuda(int index = 0) { return {Kind::cuda, index}; }
  bool is_cpu() const { return kind == Kind::cpu; }
  bool is_cuda() const { return kind == Kind::cuda; }
  /// "cpu" or "cuda:N".
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
  /// Parses "cpu", "cuda" or "cuda:N".
  static Device parse(const std::string& text);
  bool operator==(const Device&) const = default;
};

}  // namespace tessera
