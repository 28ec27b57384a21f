// Estimate mode's per-thread state and the tensor byte counters (see estimate_mode.hpp).
#include "core/estimate/estimate_mode.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <string>

#include "core/comm/comm.hpp"
#include "core/errors.hpp"
#include "core/estimate/real_data.hpp"

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

namespace {

struct KernelOps {
  std::mutex mutex;
  std::set<std::string, std::less<>> names;
};

KernelOps& kernel_ops() {
  static KernelOps ops;
  return ops;
}

}  // namespace

void run_kernel_in_estimate_mode(const std::string& op) {
  KernelOps& ops = kernel_ops();
  const std::lock_guard lock(ops.mutex);
  ops.names.insert(op);
}

bool runs_kernel_in_estimate_mode(std::string_view op) {
  KernelOps& ops = kernel_ops();
  const std::lock_guard lock(ops.mutex);
  return ops.names.find(op) != ops.names.end();
}

RealDataScope::RealDataScope() : previous_active_(estimating) {
  estimating = false;
}

RealDataScope::~RealDataScope() {
  estimating = previous_active_;
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
