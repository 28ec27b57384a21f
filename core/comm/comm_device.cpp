// Device helpers of the Comm backends (see comm_device.hpp).
#include "core/comm/comm_device.hpp"

#include "core/backend/backend.hpp"

namespace tessera::comm_device {

int buffer_device(const void* pointer) {
  static const bool any_gpu = gpu::device_count() > 0;
  if (!any_gpu || pointer == nullptr) return -1;
  return gpu::pointer_device(pointer);
}

Stream comm_stream_for(int device) {
  const RankContext& context = current_rank_context();
  if (context.device() == Device::cuda(device)) return context.comm();
  return compute_stream_for(Device::cuda(device));
}

Stream compute_stream_of(int device) {
  return compute_stream_for(Device::cuda(device));
}

SharedEvent::SharedEvent(int device)
    : device_(device), event_(gpu::create_event(device), [device](void* event) {
        gpu::destroy_event(event, device);
      }) {}

void SharedEvent::record(const Stream& stream) const {
  gpu::record_event(event_.get(), stream.handle, device_);
}

void SharedEvent::wait_on(const Stream& stream) const {
  if (stream.is_cpu())
    synchronize();
  else
    gpu::stream_wait_event(stream.handle, event_.get(), stream.device.index);
}

void SharedEvent::synchronize() const {
  gpu::synchronize_event(event_.get(), device_);
}

bool SharedEvent::query() const {
  return gpu::event_done(event_.get(), device_);
}

DeviceScratch::DeviceScratch(size_t bytes, int device, const Stream& stream, const std::string& op)
    : bytes_(bytes), device_(device), stream_(stream) {
  if (bytes_)
    data_ = backend_for(Device::cuda(device)).allocate(bytes, Device::cuda(device), stream, op);
}

DeviceScratch::~DeviceScratch() {
  if (data_)
    backend_for(Device::cuda(device_)).release(data_, bytes_, Device::cuda(device_), stream_);
}

}  // namespace tessera::comm_device
