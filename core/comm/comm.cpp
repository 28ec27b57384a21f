// Backend-independent parts of Comm: the timeout, op tagging, and host reduction kernels.
#include "core/comm/comm.hpp"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <optional>
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

namespace {

/// True when `block` is one dense run of memory (row-major over its non-unit dims).
bool is_dense(const StridedBlock& block) {
  int64_t expected = 1;
  for (size_t d = block.shape.size(); d-- > 0;) {
    if (block.shape[d] == 1) continue;
    if (block.strides[d] != expected) return false;
    expected *= block.shape[d];
  }
  return true;
}

/// The element displacements of `blocks` from their base when every non-empty block is dense
/// and ends below INT_MAX elements, so all_to_all_v can move it in place; nullopt otherwise.
std::optional<std::vector<size_t>> in_place_displacements(std::span<const StridedBlock> blocks) {
  std::vector<size_t> displs(blocks.size(), 0);
  for (size_t p = 0; p < blocks.size(); ++p) {
    const size_t count = blocks[p].count();
    if (count == 0) continue;
    if (!is_dense(blocks[p]) || blocks[p].offset < 0 ||
        static_cast<size_t>(blocks[p].offset) + count > static_cast<size_t>(INT_MAX))
      return std::nullopt;
    displs[p] = static_cast<size_t>(blocks[p].offset);
  }
  return displs;
}

/// The bytes [first, last) that `counts` elements at `displs` span from `base`.
std::pair<const char*, const char*> byte_span(const void* base, std::span<const size_t> counts,
                                              std::span<const size_t> displs, size_t element) {
  size_t lo = SIZE_MAX, hi = 0;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] == 0) continue;
    lo = std::min(lo, displs[p]);
    hi = std::max(hi, displs[p] + counts[p]);
  }
  const auto* bytes = static_cast<const char*>(base);
  if (hi == 0) return {bytes, bytes};
  return {bytes + lo * element, bytes + hi * element};
}

}  // namespace

namespace {

/// A collective that completed before start_* returned.
class CompletedCollective final : public PendingCollective {
 public:
  void wait() override {}
};

}  // namespace

std::unique_ptr<PendingCollective> Comm::start_all_reduce(const void* send, void* recv,
                                                          size_t count, DType dtype, ReduceOp op) {
  all_reduce(send, recv, count, dtype, op);
  return std::make_unique<CompletedCollective>();
}

std::unique_ptr<PendingCollective> Comm::start_all_gather_v(const void* send, size_t send_count,
                                                            void* recv,
                                                            std::span<const size_t> recv_counts,
                                                            DType dtype) {
  all_gather_v(send, send_count, recv, recv_counts, dtype);
  return std::make_unique<CompletedCollective>();
}

void Comm::all_to_all_w(const void* send_base, std::span<const StridedBlock> send_blocks,
                        void* recv_base, std::span<const StridedBlock> recv_blocks, DType dtype) {
  const size_t element = dtype_size(dtype);
  std::vector<size_t> send_counts, recv_counts;
  for (const StridedBlock& block : send_blocks) send_counts.push_back(block.count());
  for (const StridedBlock& block : recv_blocks) recv_counts.push_back(block.count());
  // Dense blocks move in place (no staging buffer, no copy); the others are packed into, or
  // unpacked from, a staging buffer in rank order.
  std::optional<std::vector<size_t>> send_in_place = in_place_displacements(send_blocks);
  const std::optional<std::vector<size_t>> recv_in_place = in_place_displacements(recv_blocks);
  if (send_in_place && recv_in_place) {
    // MPI may not read and write the same memory in one call: pack the sends when they overlap.
    const auto send_span = byte_span(send_base, send_counts, *send_in_place, element);
    const auto recv_span = byte_span(recv_base, recv_counts, *recv_in_place, element);
    if (send_span.first < recv_span.second && recv_span.first < send_span.second)
      send_in_place.reset();
  }
  const std::vector<size_t> send_displs =
      send_in_place ? *send_in_place : displacements_of(send_counts);
  const std::vector<size_t> recv_displs =
      recv_in_place ? *recv_in_place : displacements_of(recv_counts);
  Tensor send_buffer, recv_buffer;
  const void* send = send_base;
  void* recv = recv_base;
  if (!send_in_place) {
    send_buffer = Tensor::empty(
        {static_cast<int64_t>((send_displs.back() + send_counts.back()) * element)}, DType::u8);
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
    send = packed;
  }
  if (!recv_in_place) {
    recv_buffer = Tensor::empty(
        {static_cast<int64_t>((recv_displs.back() + recv_counts.back()) * element)}, DType::u8);
    recv = recv_buffer.raw_data();
  }
  all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
  if (recv_in_place) return;
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
