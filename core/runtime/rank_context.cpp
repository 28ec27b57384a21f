// Rank contexts and stream ordering (see rank_context.hpp).
#include "core/runtime/rank_context.hpp"

#include <map>

#include "core/errors.hpp"

namespace tessera {

namespace {

std::shared_ptr<RankContext>& installed_context() {
  thread_local std::shared_ptr<RankContext> context;
  return context;
}

/// Contexts of devices other than the rank's own, used from this thread (created on first use).
std::map<int, std::shared_ptr<RankContext>>& side_contexts() {
  thread_local std::map<int, std::shared_ptr<RankContext>> contexts;
  return contexts;
}

}  // namespace

RankContext::RankContext(Device device) : device_(device) {
  compute_.device = device;
  comm_.device = device;
  if (device.is_cpu()) return;
  gpu::check_device(device.index, "device");
  compute_.handle = gpu::create_stream(device.index);
  comm_.handle = gpu::create_stream(device.index);
}

RankContext::~RankContext() {
  if (device_.is_cpu()) return;
  // Queued work still completes: cudaStreamDestroy returns at once and frees the stream after.
  gpu::destroy_stream(compute_.handle, device_.index);
  gpu::destroy_stream(comm_.handle, device_.index);
}

RankContext& current_rank_context() {
  std::shared_ptr<RankContext>& context = installed_context();
  if (!context) {
    static const auto cpu_context = std::make_shared<RankContext>(Device::cpu());
    return *cpu_context;
  }
  return *context;
}

Stream compute_stream_for(Device device) {
  if (device.is_cpu()) return Stream{};
  RankContext& context = current_rank_context();
  if (context.device() == device) return context.compute();
  auto& contexts = side_contexts();
  auto it = contexts.find(device.index);
  if (it == contexts.end())
    it = contexts.emplace(device.index, std::make_shared<RankContext>(device)).first;
  return it->second->compute();
}

RankContextScope::RankContextScope(std::shared_ptr<RankContext> context)
    : previous_(std::move(installed_context())) {
  installed_context() = std::move(context);
}

RankContextScope::~RankContextScope() {
  installed_context() = std::move(previous_);
}

Device default_rank_device(const std::string& requested, int local_rank, int device_count) {
  if (requested.empty() || requested == "cpu") return Device::cpu();
  const Device device = Device::parse(requested);
  check_arg(device_count > 0, "device",
            "TESSERA_DEVICE={} asks for a GPU, but no CUDA device is visible", requested);
  if (requested == "cuda") return Device::cuda(local_rank % device_count);
  check_arg(device.index < device_count, "device",
            "TESSERA_DEVICE={}: device index {} is beyond the {} visible CUDA device(s)", requested,
            device.index, device_count);
  return device;
}

namespace {

/// The calling thread's ordering event on `device`, created on first use and reused: a stream
/// wait captures the event's most recent record at the time of the wait call, so the event may be
/// recorded again right after (no event is created or destroyed per order_after).
gpu::EventHandle ordering_event(int device) {
  struct Events {
    std::map<int, gpu::EventHandle> by_device;
    ~Events() {
      for (const auto& [index, event] : by_device) gpu::destroy_event(event, index);
    }
  };
  thread_local Events events;
  gpu::EventHandle& event = events.by_device[device];
  if (event == nullptr) event = gpu::create_event(device);
  return event;
}

}  // namespace

void order_after(const Stream& waiter, const Stream& producer) {
  if (waiter.is_cpu() || producer.is_cpu() || waiter.handle == producer.handle) return;
  const int device = producer.device.index;
  gpu::EventHandle event = ordering_event(device);
  gpu::record_event(event, producer.handle, device);
  gpu::stream_wait_event(waiter.handle, event, waiter.device.index);
}

void synchronize(const Stream& stream) {
  if (stream.is_cpu()) return;
  gpu::synchronize_stream(stream.handle, stream.device.index);
}

}  // namespace tessera
