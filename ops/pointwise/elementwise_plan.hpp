// Argument preparation of the elementwise kernels: the iteration space (output shape with
// adjacent dims merged), each operand's per-dim strides (0 along a broadcast dim), the view of a
// broadcast operand over the local box of the sharded one, and the choice of 128-bit vector
// accesses. Plain C++17 with no project headers, so the cuda launch interfaces (.cuh) can use
// the structs; the functions are defined in elementwise_plan.cpp and tested on cpu.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tessera::ops {

/// Most dims an elementwise or reduction kernel indexes (after merging adjacent dims).
constexpr int kMaxKernelDims = 8;
/// Most strided input operands of one elementwise kernel.
constexpr int kMaxOperands = 3;
/// Bytes of one vector access of the contiguous elementwise kernels.
constexpr int kVectorBytes = 16;

/// The iteration space of an elementwise kernel: flat index i runs row-major over `extent`
/// (the output's shape, merged); input operand k reads the element at sum_d index_d *
/// stride[k][d]. Outputs are written contiguously at i.
struct ElementwiseLayout {
  int ndim = 0;       ///< dims after merging (0 for a single element)
  int operands = 0;   ///< input operands described by `stride`
  int64_t count = 0;  ///< number of elements
  int64_t extent[kMaxKernelDims] = {};
  int64_t stride[kMaxOperands][kMaxKernelDims] = {};
  bool contiguous = false;  ///< every operand reads element i at index i (dense, row-major)
};

/// The layout over `shape` of operands with the given strides (elements; one vector of the
/// shape's rank per operand, 0 along broadcast dims): extent-1 dims dropped, adjacent dims that
/// every operand walks as one merged. Throws InvalidArgument when more than kMaxKernelDims dims
/// or kMaxOperands operands remain.
ElementwiseLayout elementwise_layout(const std::vector<int64_t>& shape,
                                     const std::vector<std::vector<int64_t>>& operand_strides);

/// Elements per vector access: kVectorBytes / element_size when the layout is contiguous and
/// every pointer (inputs and outputs) is kVectorBytes-aligned, else 1 (scalar accesses).
int vector_width(const ElementwiseLayout& layout, const std::vector<const void*>& pointers,
                 size_t element_size);

/// Operand b (shape b_shape, strides b_strides) seen over the local box of a: per-dim strides
/// of a's rank (0 where b broadcasts or has no dim) and the element offset of the box's first
/// element in b. b's dims sit at a's dims [offset, offset + b.ndim).
struct OperandView {
  std::vector<int64_t> strides;
  int64_t start = 0;
};

/// The view of b over a's local box starting at global index `a_box_lo` (see OperandView).
OperandView broadcast_operand_view(const std::vector<int64_t>& b_shape,
                                   const std::vector<int64_t>& b_strides,
                                   const std::vector<int64_t>& a_box_lo, int offset);

}  // namespace tessera::ops
