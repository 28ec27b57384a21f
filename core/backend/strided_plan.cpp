// Host-side preparation of device kernel arguments (see strided_plan.hpp).
#include "core/backend/strided_plan.hpp"

#include <algorithm>
#include <vector>

#include "core/errors.hpp"

namespace tessera {

MergedDims merge_strided_dims(const int64_t* shape, int ndim, const int64_t* dst_strides,
                              const int64_t* src_strides) {
  MergedDims merged;
  merged.count = 1;
  for (int d = 0; d < ndim; ++d) merged.count *= shape[d];
  if (merged.count == 0) return merged;
  // Walk from the outermost dim inwards: a dim continues the previous (outer) merged dim when
  // that dim's stride is this dim's stride times this dim's extent in every operand.
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] == 1) continue;
    const int64_t dst = dst_strides[d], src = src_strides ? src_strides[d] : 0;
    if (!merged.extent.empty() && merged.dst_strides.back() == dst * shape[d] &&
        merged.src_strides.back() == src * shape[d]) {
      merged.extent.back() *= shape[d];
      merged.dst_strides.back() = dst;
      merged.src_strides.back() = src;
      continue;
    }
    merged.extent.push_back(shape[d]);
    merged.dst_strides.push_back(dst);
    merged.src_strides.push_back(src);
  }
  return merged;
}

int64_t strided_copy_runs(const int64_t* shape, int ndim, const int64_t* dst_strides,
                          const int64_t* src_strides) {
  std::vector<int64_t> dense(static_cast<size_t>(std::max(ndim, 0)), 1);
  for (int d = ndim - 2; d >= 0; --d) dense[d] = dense[d + 1] * shape[d + 1];
  const MergedDims merged =
      merge_strided_dims(shape, ndim, dst_strides ? dst_strides : dense.data(),
                         src_strides ? src_strides : dense.data());
  if (merged.count == 0) return 0;
  if (merged.extent.empty()) return 1;
  const size_t last = merged.extent.size() - 1;
  if (merged.dst_strides[last] != 1 || merged.src_strides[last] != 1) return merged.count;
  return merged.count / merged.extent[last];
}

StridedPlan merge_dims(const int64_t* shape, int ndim, const int64_t* dst_strides,
                       const int64_t* src_strides, const std::string& op) {
  const MergedDims merged = merge_strided_dims(shape, ndim, dst_strides, src_strides);
  StridedPlan plan;
  plan.count = merged.count;
  check_arg(merged.extent.size() <= static_cast<size_t>(kMaxKernelDims), op,
            "a strided device operation over {} dims that cannot be merged (at most {})",
            merged.extent.size(), kMaxKernelDims);
  plan.ndim = static_cast<int>(merged.extent.size());
  for (int d = 0; d < plan.ndim; ++d) {
    plan.shape[d] = merged.extent[d];
    plan.dst_strides[d] = merged.dst_strides[d];
    plan.src_strides[d] = merged.src_strides[d];
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
