// Tensor: one rank's dense strided N-d array (shape, strides in elements, dtype, device) over
// shared storage. Views (slice, view_box) share storage; copies are explicit.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/box.hpp"
#include "core/device.hpp"
#include "core/dtype.hpp"
#include "core/runtime/rank_context.hpp"

namespace tessera {

struct TensorBytes;  // core/estimate/estimate_mode.hpp

/// Owned memory block on one device, from that device's caching allocator. Device memory is
/// stream-ordered: allocated for, and returned on, the stream that was current for the device
/// when it was made. In estimate mode (core/estimate/estimate_mode.hpp) a block is shape-only:
/// no memory, its bytes only counted.
class Storage {
 public:
  /// Allocates `bytes` on `device` (uninitialised); in estimate mode allocates nothing.
  Storage(size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  /// True for a block made in estimate mode: `bytes()` long, with no memory behind it.
  bool shape_only() const { return shape_only_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
  Stream stream_;  // where a device block is returned to the allocator
  bool shape_only_ = false;
  std::shared_ptr<TensorBytes> counter_;  // the making rank's byte counter, if it had one
};

/// Row-major strides (in elements) of a contiguous tensor of `shape`.
std::vector<int64_t> contiguous_strides(const Shape& shape);

/// Number of elements of `shape`.
int64_t shape_numel(const Shape& shape);

class Tensor {
 public:
  /// An empty 0-element 1-d f32 tensor on cpu ("no tensor").
  Tensor();
  /// Uninitialised contiguous tensor.
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  /// Zero-filled contiguous tensor.
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  /// Contiguous cpu tensor holding a copy of `values` (size must equal the shape's numel).
  template <typename T>
  static Tensor from_values(const Shape& shape, std::span<const T> values);

  const Shape& shape() const { return shape_; }
  int64_t shape(int dim) const { return shape_.at(dim); }
  const std::vector<int64_t>& strides() const { return strides_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  /// Elements (computed once, checked against overflow, when the tensor is made).
  int64_t numel() const { return numel_; }
  size_t element_size() const { return dtype_size(dtype_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  /// True when the elements are laid out row-major with no gaps.
  bool is_contiguous() const;
  /// Pointer to the first element (may be null for a 0-element tensor). Throws for a shape-only
  /// tensor with elements (estimate mode: there is no data to touch).
  void* raw_data() const;
  /// True for a tensor made in estimate mode: shape, dtype and device, no data. Copies, fills and
  /// views of shape-only tensors are shape-only and move nothing.
  bool is_shape_only() const;
  /// The pointer communication carries as a payload: raw_data(), or null for a shape-only tensor
  /// (whose messages the estimate's communicator records without moving them). A payload is
  /// nbytes() contiguous bytes, so a strided view with elements raises an internal error here
  /// (call contiguous() first) instead of sending the bytes between its elements.
  void* comm_data() const;
  /// Where the first element lies in the storage, in elements (views share one storage).
  int64_t storage_offset() const { return offset_; }
  /// Typed pointer to the first element; throws when T does not match the dtype.
  template <typename T>
  T* data() const;

  /// View of indices [start, stop) along `dim`.
  Tensor slice(int dim, int64_t start, int64_t stop) const;
  /// View of the local index box `box` (coordinates of this tensor).
  Tensor view_box(const Box& box) const;
  /// The same elements with another shape of equal numel (a view when contiguous, else a copy).
  Tensor reshape(const Shape& shape) const;
  /// A contiguous tensor with the same values (this tensor itself when already contiguous).
  Tensor contiguous() const;
  /// A contiguous deep copy.
  Tensor clone() const;
  /// Deep copy onto `device` (this tensor itself when already there).
  Tensor to(Device device) const;
  /// Copy with elements converted to `dtype` on the same device (this tensor when dtype matches).
  Tensor to_dtype(DType dtype) const;

  /// Copies `source` (same shape and dtype, any strides and device) into this tensor.
  void copy_from(const Tensor& source);
  /// Copies the box `box` of this tensor into `dst` (memory of this tensor's device) as
  /// contiguous row-major bytes.
  void pack_box(const Box& box, void* dst) const;
  /// Copies contiguous row-major bytes from `src` (memory of this tensor's device) into the box
  /// `box` of this tensor.
  void unpack_box(const Box& box, const void* src);
  /// Sets every element to `value` (converted to the dtype).
  void fill(double value);

  /// Element at a multi-index, converted to double (cpu only; for tests and checks).
  double item_as_double(const std::vector<int64_t>& index) const;
  /// "f32 (4, 5) cpu".
  std::string str() const;

 private:
  Tensor(std::shared_ptr<Storage> storage, Shape shape, std::vector<int64_t> strides,
         int64_t offset, DType dtype);

  std::shared_ptr<Storage> storage_;
  Shape shape_;
  int64_t numel_ = 0;  // shape_numel(shape_)
  std::vector<int64_t> strides_;
  int64_t offset_ = 0;  // in elements, from the start of storage_
  DType dtype_ = DType::f32;
  Device device_;
};

/// This tensor as the backends' argument (data pointer, shape, strides); valid while it lives.
StridedRef strided_ref(const Tensor& tensor);

/// N-d strided element copy on the host; strides are in elements.
void copy_strided_host(void* dst, const int64_t* dst_strides, const void* src,
                       const int64_t* src_strides, const int64_t* shape, int ndim,
                       size_t element_size);

/// True when both tensors have the same shape, dtype and bit-identical elements (any device).
bool bitwise_equal(const Tensor& a, const Tensor& b);

/// Largest |a - b| over all elements (floating or integer tensors of the same shape).
double max_abs_diff(const Tensor& a, const Tensor& b);

template <typename T>
Tensor Tensor::from_values(const Shape& shape, std::span<const T> values) {
  check_arg(static_cast<int64_t>(values.size()) == shape_numel(shape), "tensor",
            "{} values given for shape {}", values.size(), shape);
  Tensor result = empty(shape, dtype_of<T>());
  if (!values.empty() && !result.is_shape_only())
    std::memcpy(result.raw_data(), values.data(), values.size_bytes());
  return result;
}

template <typename T>
T* Tensor::data() const {
  check_arg(dtype_of<T>() == dtype_, "tensor", "data<{}>() called on a {} tensor",
            dtype_name(dtype_of<T>()), dtype_name(dtype_));
  return static_cast<T*>(raw_data());
}

}  // namespace tessera
