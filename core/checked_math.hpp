// Overflow-checked size arithmetic for every size computed from numbers a user gave (shapes,
// paddings, extents, halo boxes, file dataspaces): a result past the limit raises one agreed
// error, "[op] <what> <value> exceeds the limit <limit>", before anything is allocated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace tessera {

/// The largest element count or byte count Tessera accepts for one tensor: 2^62, so that
/// numel * element size (at most 8 bytes) and the signed offsets of views never overflow.
inline constexpr int64_t kMaxTensorSize = int64_t{1} << 62;

/// a * b; throws InvalidArgument "[op] <what> a x b exceeds the limit ..." when either is
/// negative or the product passes `limit`.
int64_t checked_mul(int64_t a, int64_t b, std::string_view op, std::string_view what,
                    int64_t limit = kMaxTensorSize);
/// a + b; throws InvalidArgument "[op] <what> a + b exceeds the limit ..." when the sum passes
/// `limit` in either direction (|a + b| > limit).
int64_t checked_add(int64_t a, int64_t b, std::string_view op, std::string_view what,
                    int64_t limit = kMaxTensorSize);
/// Product of `extents` (1 for none); throws InvalidArgument naming the extents when one is
/// negative or the product passes kMaxTensorSize.
int64_t checked_numel(std::span<const int64_t> extents, std::string_view op,
                      std::string_view what = "shape");
/// Bytes of `numel` elements of `element_size` bytes, checked like checked_numel; the error
/// names `what` (e.g. "f32 tensor [4, 5]").
size_t checked_bytes(int64_t numel, size_t element_size, std::string_view op,
                     std::string_view what = "tensor");

/// Bytes of a tensor of `shape` with elements of `element_size` bytes (`dtype` names them in the
/// error): checked_numel, then checked_bytes; formats nothing unless it throws.
size_t checked_tensor_bytes(std::span<const int64_t> shape, size_t element_size,
                            std::string_view dtype, std::string_view op);

}  // namespace tessera
