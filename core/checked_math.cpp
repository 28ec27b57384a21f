// Overflow-checked size arithmetic (checked_math.hpp).
#include "core/checked_math.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>

#include "core/errors.hpp"

namespace tessera {

namespace {

/// "[op] <what> <value> = <approximate> exceeds the limit of <limit>".
[[noreturn]] void too_large(std::string_view op, std::string_view what, const std::string& value,
                            double approximate, int64_t limit) {
  throw InvalidArgument(std::string(op), fmt::format("{} {} = {:.4g} exceeds the limit of {}", what,
                                                     value, approximate, limit));
}

}  // namespace

int64_t checked_mul(int64_t a, int64_t b, std::string_view op, std::string_view what,
                    int64_t limit) {
  check_arg(a >= 0 && b >= 0, op, "{} {} x {} has a negative factor", what, a, b);
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product) || product > limit)
    too_large(op, what, fmt::format("{} x {}", a, b), double(a) * double(b), limit);
  return product;
}

int64_t checked_add(int64_t a, int64_t b, std::string_view op, std::string_view what,
                    int64_t limit) {
  int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum) || sum > limit || sum < -limit)
    too_large(op, what, fmt::format("{} + {}", a, b), double(a) + double(b), limit);
  return sum;
}

int64_t checked_numel(std::span<const int64_t> extents, std::string_view op,
                      std::string_view what) {
  double approximate = 1;
  for (int64_t extent : extents) {
    check_arg(extent >= 0, op, "{} {} has a negative extent", what, extents);
    approximate *= double(extent);
  }
  if (approximate == 0) return 0;  // an empty shape is fine however large its other extents
  int64_t count = 1;
  for (int64_t extent : extents)
    if (__builtin_mul_overflow(count, extent, &count) || count > kMaxTensorSize)
      throw InvalidArgument(std::string(op),
                            fmt::format("{} {} holds {:.4g} elements, more than the limit of {}",
                                        what, extents, approximate, kMaxTensorSize));
  return count;
}

size_t checked_bytes(int64_t numel, size_t element_size, std::string_view op,
                     std::string_view what) {
  int64_t bytes = 0;
  check_arg(numel >= 0, op, "{}: {} elements", what, numel);
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(element_size), &bytes) ||
      bytes > kMaxTensorSize)
    throw InvalidArgument(std::string(op),
                          fmt::format("{}: {} elements x {} bytes = {:.4g} bytes, more than the "
                                      "limit of {}",
                                      what, numel, element_size,
                                      double(numel) * double(element_size), kMaxTensorSize));
  return static_cast<size_t>(bytes);
}

size_t checked_tensor_bytes(std::span<const int64_t> shape, size_t element_size,
                            std::string_view dtype, std::string_view op) {
  const int64_t numel = checked_numel(shape, op);
  int64_t bytes = 0;
  if (!__builtin_mul_overflow(numel, static_cast<int64_t>(element_size), &bytes) &&
      bytes <= kMaxTensorSize)
    return static_cast<size_t>(bytes);
  return checked_bytes(numel, element_size, op, fmt::format("{} tensor {}", dtype, shape));
}

}  // namespace tessera
