// Backend-independent parts of Comm: the timeout, op tagging, and host reduction kernels.
#include "core/comm/comm.hpp"

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "core/tensor.hpp"

namespace tessera {

namespace {
thread_local std::vector<std::string> comm_op_stack;
}

std::chrono::duration<double> comm_timeout() {
  if (const char* text = std::getenv("TESSERA_COMM_TIMEOUT")) {
    char* end = nullptr;
    const double seconds = std::strtod(text, &end);
    if (end != text && seconds > 0) return std::chrono::duration<double>(seconds);
  }
  return std::chrono::duration<double>(600.0);
}

std::string timeout_message(const std::string& collective, int rank, int size,
                            const std::string& peers) {
  return fmt::format(
      "{} timed out after {:g} s (TESSERA_COMM_TIMEOUT) on rank {} of {}: waiting "
      "for {}",
      collective, comm_timeout().count(), rank, size, peers);
}

std::string current_comm_op() {
  return comm_op_stack.empty() ? "comm" : comm_op_stack.back();
}

CommOpScope::CommOpScope(std::string op) {
  comm_op_stack.push_back(std::move(op));
}
CommOpScope::~CommOpScope() {
  comm_op_stack.pop_back();
}

size_t StridedBlock::count() const {
  return static_cast<size_t>(shape_numel(shape));
}

void Comm::all_to_all_w(const void* send_base, std::span<const StridedBlock> send_blocks,
                        void* recv_base, std::span<const StridedBlock> recv_blocks, DType dtype) {
  const size_t element = dtype_size(dtype);
  std::vector<size_t> send_counts, recv_counts;
  for (const StridedBlock& block : send_blocks) send_counts.push_back(block.count());
  for (const StridedBlock& block : recv_blocks) recv_counts.push_back(block.count());
  const std::vector<size_t> send_displs = displacements_of(send_counts);
  const std::vector<size_t> recv_displs = displacements_of(recv_counts);
  Tensor send_buffer = Tensor::empty(
      {static_cast<int64_t>((send_displs.back() + send_counts.back()) * element)}, DType::u8);
  Tensor recv_buffer = Tensor::empty(
      {static_cast<int64_t>((recv_displs.back() + recv_counts.back()) * element)}, DType::u8);
  auto* packed = static_cast<char*>(send_buffer.raw_data());
  for (size_t p = 0; p < send_blocks.size(); ++p) {
    const StridedBlock& block = send_blocks[p];
    const std::vector<int64_t> dense = contiguous_strides(block.shape);
    if (send_counts[p])
      copy_strided_host(packed + send_displs[p] * element, dense.data(),
                        static_cast<const char*>(send_base) + block.offset * element,
                        block.strides.data(), block.shape.data(),
                        static_cast<int>(block.shape.size()), element);
  }
  all_to_all_v(send_buffer.raw_data(), send_counts, send_displs, recv_buffer.raw_data(),
               recv_counts, recv_displs, dtype);
  const auto* received = static_cast<const char*>(recv_buffer.raw_data());
  for (size_t p = 0; p < recv_blocks.size(); ++p) {
    const StridedBlock& block = recv_blocks[p];
    const std::vector<int64_t> dense = contiguous_strides(block.shape);
    if (recv_counts[p])
      copy_strided_host(static_cast<char*>(recv_base) + block.offset * element,
                        block.strides.data(), received + recv_displs[p] * element, dense.data(),
                        block.shape.data(), static_cast<int>(block.shape.size()), element);
  }
}

std::vector<size_t> displacements_of(std::span<const size_t> counts) {
  std::vector<size_t> displs(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + counts[r - 1];
  return displs;
}

void reduce_into(void* inout, const void* in, size_t count, DType dtype, ReduceOp op) {
  dispatch_dtype(dtype, [&]<typename T>() {
    using Acc =
        std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;
    T* a = static_cast<T*>(inout);
    const T* b = static_cast<const T*>(in);
    for (size_t i = 0; i < count; ++i) {
      const Acc x = static_cast<Acc>(a[i]), y = static_cast<Acc>(b[i]);
      Acc result{};
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg: result = static_cast<Acc>(x + y); break;
        case ReduceOp::prod: result = static_cast<Acc>(x * y); break;
        case ReduceOp::max: result = std::max(x, y); break;
        case ReduceOp::min: result = std::min(x, y); break;
      }
      a[i] = T(result);
    }
  });
}

void divide_by(void* data, size_t count, DType dtype, int divisor) {
  dispatch_dtype(dtype, [&]<typename T>() {
    T* a = static_cast<T*>(data);
    for (size_t i = 0; i < count; ++i) {
      if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
        a[i] = T(static_cast<float>(a[i]) / static_cast<float>(divisor));
      else
        a[i] = static_cast<T>(a[i] / static_cast<T>(divisor));
    }
  });
}

}  // namespace tessera
