// Estimate mode's per-thread state and the tensor byte counters (see estimate_mode.hpp).
#include "core/estimate/estimate_mode.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/comm/comm.hpp"
#include "core/errors.hpp"

namespace tessera {

void TensorBytes::add(size_t bytes) {
  const size_t now = live.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  size_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

void TensorBytes::remove(size_t bytes) {
  live.fetch_sub(bytes, std::memory_order_relaxed);
}

namespace estimate {

namespace {

thread_local bool estimating = false;

std::shared_ptr<TensorBytes>& installed_bytes() {
  thread_local std::shared_ptr<TensorBytes> bytes;
  return bytes;
}

}  // namespace

bool active() {
  return estimating;
}

const std::shared_ptr<TensorBytes>& tensor_bytes() {
  return installed_bytes();
}

Scope::Scope(std::shared_ptr<TensorBytes> bytes)
    : previous_active_(estimating), previous_bytes_(std::move(installed_bytes())) {
  estimating = true;
  installed_bytes() = std::move(bytes);
}

Scope::~Scope() {
  estimating = previous_active_;
  installed_bytes() = std::move(previous_bytes_);
}

CountScope::CountScope(std::shared_ptr<TensorBytes> bytes)
    : previous_(std::move(installed_bytes())) {
  installed_bytes() = std::move(bytes);
}

CountScope::~CountScope() {
  installed_bytes() = std::move(previous_);
}

void throw_touched(std::string_view what, std::string_view tensor) {
  // The innermost op or collective scope names the path that has no estimate mode yet.
  const std::string op = current_comm_op();
  throw NotAvailable("estimate",
                     fmt::format("{}{} touched tensor data ({}, shape-only in estimate mode); "
                                 "this path has no estimate mode",
                                 op == "comm" ? "" : op + ": ", what, tensor));
}

}  // namespace estimate
}  // namespace tessera
