// Argument preparation of the elementwise kernels (shared by the cpu broadcast helpers and the
// cuda launches).
#include "ops/pointwise/elementwise_plan.hpp"

#include <cstdint>

#include "core/errors.hpp"

namespace tessera::ops {

ElementwiseLayout elementwise_layout(const std::vector<int64_t>& shape,
                                     const std::vector<std::vector<int64_t>>& operand_strides) {
  const int operands = static_cast<int>(operand_strides.size());
  check_arg(operands <= kMaxOperands, "elementwise", "{} operands (at most {})", operands,
            kMaxOperands);
  for (const std::vector<int64_t>& strides : operand_strides)
    check_arg(strides.size() == shape.size(), "elementwise",
              "operand strides of rank {} for a {}-d shape", strides.size(), shape.size());
  ElementwiseLayout layout;
  layout.operands = operands;
  layout.count = 1;
  for (int64_t extent : shape) layout.count *= extent;
  // Walk from the innermost dim out, merging dim d into the current innermost merged dim when
  // every operand steps over d exactly as over the whole merged dim.
  std::vector<int64_t> extents;                         // innermost first
  std::vector<std::vector<int64_t>> strides(operands);  // innermost first
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    if (shape[d] == 1) continue;
    bool merge = !extents.empty();
    for (int k = 0; k < operands && merge; ++k)
      merge = operand_strides[k][d] == strides[k].back() * extents.back();
    if (merge) {
      extents.back() *= shape[d];
      continue;
    }
    extents.push_back(shape[d]);
    for (int k = 0; k < operands; ++k) strides[k].push_back(operand_strides[k][d]);
  }
  layout.ndim = static_cast<int>(extents.size());
  check_arg(layout.ndim <= kMaxKernelDims, "elementwise",
            "{} dims remain after merging (at most {})", layout.ndim, kMaxKernelDims);
  layout.contiguous = true;
  for (int i = 0; i < layout.ndim; ++i) {
    const int d = layout.ndim - 1 - i;  // row-major position of the i-th innermost dim
    layout.extent[d] = extents[i];
    for (int k = 0; k < operands; ++k) layout.stride[k][d] = strides[k][i];
  }
  // Contiguous: one merged dim of unit stride for every operand (or at most one element).
  if (layout.ndim > 1) layout.contiguous = false;
  for (int k = 0; k < operands && layout.ndim == 1; ++k)
    if (layout.stride[k][0] != 1) layout.contiguous = false;
  return layout;
}

int vector_width(const ElementwiseLayout& layout, const std::vector<const void*>& pointers,
                 size_t element_size) {
  if (!layout.contiguous || element_size == 0 || kVectorBytes % element_size != 0) return 1;
  for (const void* pointer : pointers)
    if (reinterpret_cast<uintptr_t>(pointer) % kVectorBytes != 0) return 1;
  return static_cast<int>(kVectorBytes / element_size);
}

OperandView broadcast_operand_view(const std::vector<int64_t>& b_shape,
                                   const std::vector<int64_t>& b_strides,
                                   const std::vector<int64_t>& a_box_lo, int offset) {
  const int a_ndim = static_cast<int>(a_box_lo.size());
  const int b_ndim = static_cast<int>(b_shape.size());
  check_arg(offset >= 0 && offset + b_ndim <= a_ndim && b_strides.size() == b_shape.size(),
            "elementwise", "operand of rank {} at dim {} of a {}-d tensor", b_ndim, offset, a_ndim);
  OperandView view;
  view.strides.assign(a_ndim, 0);
  for (int j = 0; j < b_ndim; ++j) {
    if (b_shape[j] == 1) continue;
    view.strides[offset + j] = b_strides[j];
    view.start += a_box_lo[offset + j] * b_strides[j];
  }
  return view;
}

}  // namespace tessera::ops
