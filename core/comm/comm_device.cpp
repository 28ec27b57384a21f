// Device helpers of the Comm backends (see comm_device.hpp).
#include "core/comm/comm_device.hpp"

#include "core/backend/backend.hpp"
#include "core/tensor.hpp"

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

void all_to_all_w_on_device(Comm& comm, int device, const void* send_base,
                            std::span<const StridedBlock> send_blocks, void* recv_base,
                            std::span<const StridedBlock> recv_blocks, DType dtype) {
  const size_t element = dtype_size(dtype);
  std::vector<size_t> send_counts, recv_counts;
  for (const StridedBlock& block : send_blocks) send_counts.push_back(block.count());
  for (const StridedBlock& block : recv_blocks) recv_counts.push_back(block.count());
  const std::vector<size_t> send_displs = displacements_of(send_counts);
  const std::vector<size_t> recv_displs = displacements_of(recv_counts);
  const Stream stream = compute_stream_of(device);
  DeviceScratch packed((send_displs.back() + send_counts.back()) * element, device, stream,
                       "all_to_all_w");
  DeviceScratch received((recv_displs.back() + recv_counts.back()) * element, device, stream,
                         "all_to_all_w");
  DeviceBackend& backend = backend_for(Device::cuda(device));
  auto move_block = [&](const StridedBlock& block, void* base, void* dense_base, bool pack) {
    if (block.count() == 0) return;
    const std::vector<int64_t> dense = contiguous_strides(block.shape);
    const int ndim = static_cast<int>(block.shape.size());
    const StridedRef strided{static_cast<char*>(base) + block.offset * element, block.shape.data(),
                             block.strides.data(), ndim};
    const StridedRef contiguous{dense_base, block.shape.data(), dense.data(), ndim};
    backend.copy(pack ? contiguous : strided, pack ? strided : contiguous, element, stream);
  };
  for (size_t p = 0; p < send_blocks.size(); ++p)
    move_block(send_blocks[p], const_cast<void*>(send_base),
               static_cast<char*>(packed.data()) + send_displs[p] * element, true);
  comm.all_to_all_v(packed.data(), send_counts, send_displs, received.data(), recv_counts,
                    recv_displs, dtype);
  for (size_t p = 0; p < recv_blocks.size(); ++p)
    move_block(recv_blocks[p], recv_base,
               static_cast<char*>(received.data()) + recv_displs[p] * element, false);
}

}  // namespace tessera::comm_device
