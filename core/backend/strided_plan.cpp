// Host-side preparation of device kernel arguments (see strided_plan.hpp).
#include "core/backend/strided_plan.hpp"

#include <algorithm>
#include <vector>

#include "core/errors.hpp"

namespace tessera {

StridedPlan merge_dims(const int64_t* shape, int ndim, const int64_t* dst_strides,
                       const int64_t* src_strides, const std::string& op) {
  StridedPlan plan;
  plan.count = 1;
  for (int d = 0; d < ndim; ++d) plan.count *= shape[d];
  if (plan.count == 0) return plan;
  // Walk from the innermost dim outwards, growing the current merged dim while the next outer
  // dim continues it in every operand.
  struct Dim {
    int64_t extent, dst_stride, src_stride;
  };
  std::vector<Dim> merged;  // innermost first
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] == 1) continue;
    const Dim dim{shape[d], dst_strides[d], src_strides ? src_strides[d] : 0};
    if (!merged.empty()) {
      Dim& inner = merged.back();
      if (dim.dst_stride == inner.dst_stride * inner.extent &&
          dim.src_stride == inner.src_stride * inner.extent) {
        inner.extent *= dim.extent;
        continue;
      }
    }
    merged.push_back(dim);
  }
  check_arg(static_cast<int>(merged.size()) <= kMaxKernelDims, op,
            "a strided device operation over {} dims that cannot be merged (at most {})",
            merged.size(), kMaxKernelDims);
  plan.ndim = static_cast<int>(merged.size());
  for (int d = 0; d < plan.ndim; ++d) {
    const Dim& dim = merged[plan.ndim - 1 - d];
    plan.shape[d] = dim.extent;
    plan.dst_strides[d] = dim.dst_stride;
    plan.src_strides[d] = dim.src_stride;
  }
  return plan;
}

bool is_dense(const StridedPlan& plan) {
  if (plan.ndim == 0) return true;
  return plan.ndim == 1 && plan.dst_strides[0] == 1 && plan.src_strides[0] == 1;
}

size_t copy_word_bytes(const StridedPlan& plan, size_t element_size, uintptr_t dst_address,
                       uintptr_t src_address) {
  if (plan.ndim == 0 || plan.count == 0) return element_size;
  const int inner = plan.ndim - 1;
  if (plan.dst_strides[inner] != 1 || plan.src_strides[inner] != 1) return element_size;
  for (size_t word : {size_t{16}, size_t{8}, size_t{4}, size_t{2}}) {
    if (word <= element_size) break;
    if (word % element_size != 0) continue;
    bool fits = dst_address % word == 0 && src_address % word == 0 &&
                (static_cast<size_t>(plan.shape[inner]) * element_size) % word == 0;
    for (int d = 0; d < inner && fits; ++d)
      fits = (static_cast<size_t>(plan.dst_strides[d]) * element_size) % word == 0 &&
             (static_cast<size_t>(plan.src_strides[d]) * element_size) % word == 0;
    if (fits) return word;
  }
  return element_size;
}

StridedPlan in_words(const StridedPlan& plan, size_t element_size, size_t word_bytes) {
  if (word_bytes == element_size || plan.ndim == 0) return plan;
  const int64_t ratio = static_cast<int64_t>(word_bytes / element_size);
  StridedPlan words = plan;
  const int inner = plan.ndim - 1;
  words.shape[inner] = plan.shape[inner] / ratio;
  for (int d = 0; d < inner; ++d) {
    words.dst_strides[d] = plan.dst_strides[d] / ratio;
    words.src_strides[d] = plan.src_strides[d] / ratio;
  }
  words.count = plan.count / ratio;
  return words;
}

int sum_partial_count(int64_t count) {
  // About 8 elements per thread in the first pass, at most 1024 blocks (the second pass reads
  // them with one block).
  const int64_t per_block = int64_t{kSumThreads} * 8;
  return static_cast<int>(std::clamp<int64_t>((count + per_block - 1) / per_block, 1, 1024));
}

}  // namespace tessera
