// Host-side preparation of device kernel arguments for elementwise work on strided arrays:
// dropping unit dims, merging neighbouring dims that are contiguous in every operand, choosing
// the widest word a copy can move at once, and the block count of the deterministic sum. Plain
// C++ (tested on cpu); the cuda backend hands the results to the kernels.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

/// An N-d strided operation on one or two operands with unit dims dropped and neighbouring dims
/// merged where the outer stride equals the inner stride times the inner extent in every
/// operand (outermost first, strides in elements). `count` is the element count: 0 when an
/// extent is 0 (then no dims are kept), 1 with no dims for a single element.
struct MergedDims {
  int64_t count = 0;
  std::vector<int64_t> extent, dst_strides, src_strides;
};

/// The merged dims of `shape` over dst (and src unless `src_strides` is null: its strides are
/// then 0). The one merging rule of every strided loop, host (copy_strided_host, the cpu
/// backend) and device (merge_dims).
MergedDims merge_strided_dims(const int64_t* shape, int ndim, const int64_t* dst_strides,
                              const int64_t* src_strides);

/// The contiguous runs a strided copy of `shape` makes (what copy_strided_host calls memcpy
/// for, after merge_strided_dims): the element count over the innermost merged extent when that
/// dim has stride 1 in both operands, else the element count; 0 for no elements. A null
/// `dst_strides` or `src_strides` is a dense row-major operand (packing to or unpacking from a
/// buffer). What the trace records of a copy, and the cost model prices per run.
int64_t strided_copy_runs(const int64_t* shape, int ndim, const int64_t* dst_strides,
                          const int64_t* src_strides);

/// Most dims an elementwise device kernel handles (after merging).
constexpr int kMaxKernelDims = 8;

/// One or two strided operands (dst, and src when there is one) over one shape. Strides are in
/// elements (or in words after in_words).
struct StridedPlan {
  int ndim = 0;
  int64_t count = 0;  ///< elements in all (1 for ndim 0, 0 when an extent is 0)
  std::array<int64_t, kMaxKernelDims> shape{};
  std::array<int64_t, kMaxKernelDims> dst_strides{};
  std::array<int64_t, kMaxKernelDims> src_strides{};
};

/// The plan of `shape` over dst (and src unless `src_strides` is null): unit dims dropped,
/// neighbours merged where the outer stride equals the inner stride times the inner extent in
/// every operand. Throws InvalidArgument tagged with `op` when more than kMaxKernelDims dims
/// remain.
StridedPlan merge_dims(const int64_t* shape, int ndim, const int64_t* dst_strides,
                       const int64_t* src_strides, const std::string& op);

/// True when every operand of `plan` is one dense run (a single memcpy or memset).
bool is_dense(const StridedPlan& plan);

/// The widest word (16, 8, 4 or 2 bytes, at least `element_size`) a copy of `plan` can move
/// at once: the innermost dim has stride 1 in every operand, its byte length and every outer
/// byte stride are multiples of the word, and both addresses are aligned to it. `element_size`
/// when none is wider.
size_t copy_word_bytes(const StridedPlan& plan, size_t element_size, uintptr_t dst_address,
                       uintptr_t src_address);

/// `plan` re-expressed in words of `word_bytes` (a multiple of `element_size` that
/// copy_word_bytes allowed): the innermost extent and every stride scaled down.
StridedPlan in_words(const StridedPlan& plan, size_t element_size, size_t word_bytes);

/// Threads per block of the deterministic sum.
constexpr int kSumThreads = 256;

/// Blocks of the first pass of the deterministic sum of `count` elements: a function of
/// `count` only (never of the device or timing), so the reduction order is fixed.
int sum_partial_count(int64_t count);

}  // namespace tessera
