// Tensor storage, views and copies. Every element operation goes through the device's backend
// (core/backend/backend.hpp) on the stream current for the device; host<->device copies go
// through transfer_bytes, which counts them.
#include "core/tensor.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/backend/strided_plan.hpp"
#include "core/backend/transfer.hpp"
#include "core/checked_math.hpp"
#include "core/compute_threads.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/parallel_for.hpp"
#include "core/streaming_stores.hpp"

namespace tessera {

Device Device::parse(const std::string& text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.rfind("cuda:", 0) == 0) {
    const std::string index = text.substr(5);
    if (!index.empty() && index.find_first_not_of("0123456789") == std::string::npos)
      return cuda(std::stoi(index));
  }
  throw InvalidArgument("device", fmt::format("cannot parse device '{}' (expected cpu, cuda or "
                                              "cuda:N)",
                                              text));
}

Storage::Storage(size_t bytes, Device device)
    : bytes_(bytes),
      device_(device),
      shape_only_(estimate::active()),
      counter_(estimate::tensor_bytes()) {
  if (counter_) counter_->add(bytes);
  // A shape-only block asks nothing of the device (an estimate of cuda ranks needs no GPU).
  if (shape_only_ || bytes == 0) return;
  stream_ = compute_stream_for(device);
  data_ = backend_for(device).allocate(bytes, device, stream_, "tensor");
}

Storage::~Storage() {
  if (counter_) counter_->remove(bytes_);
  if (data_) backend_for(device_).release(data_, bytes_, device_, stream_);
}

StridedRef strided_ref(const Tensor& tensor) {
  return {tensor.raw_data(), tensor.shape().data(), tensor.strides().data(), tensor.ndim()};
}

std::vector<int64_t> contiguous_strides(const Shape& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;)
    strides[d - 1] = strides[d] * std::max<int64_t>(shape[d], 1);
  return strides;
}

int64_t shape_numel(const Shape& shape) {
  return checked_numel(shape, "tensor");
}

Tensor::Tensor() : Tensor(nullptr, Shape{0}, {1}, 0, DType::f32) {}

Tensor::Tensor(std::shared_ptr<Storage> storage, Shape shape, std::vector<int64_t> strides,
               int64_t offset, DType dtype)
    : storage_(std::move(storage)),
      shape_(std::move(shape)),
      numel_(shape_numel(shape_)),
      strides_(std::move(strides)),
      offset_(offset),
      dtype_(dtype),
      device_(storage_ ? storage_->device() : Device::cpu()) {}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t extent : shape)
    check_arg(extent >= 0, "tensor", "shape {} has a negative extent", shape);
  auto storage = std::make_shared<Storage>(
      checked_tensor_bytes(shape, dtype_size(dtype), dtype_name(dtype), "tensor"), device);
  return Tensor(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor result = empty(shape, dtype, device);
  result.fill(0);
  return result;
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t d = shape_.size(); d-- > 0;) {
    if (shape_[d] == 1) continue;
    if (shape_[d] == 0) return true;
    if (strides_[d] != expected) return false;
    expected *= shape_[d];
  }
  return true;
}

bool Tensor::is_shape_only() const {
  return storage_ && storage_->shape_only();
}

void* Tensor::comm_data() const {
  if (numel_ > 0 && !is_contiguous())
    throw Error("tensor", fmt::format("internal error: {} is a strided view, not a contiguous "
                                      "payload for communication",
                                      str()));
  return is_shape_only() ? nullptr : raw_data();
}

void* Tensor::raw_data() const {
  if (is_shape_only() && numel_ > 0) estimate::throw_touched("a kernel or element loop", str());
  if (!storage_ || !storage_->data()) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(element_size());
}

Tensor Tensor::slice(int dim, int64_t start, int64_t stop) const {
  check_arg(dim >= 0 && dim < ndim(), "tensor", "slice dim {} of a {}-d tensor", dim, ndim());
  check_arg(0 <= start && start <= stop && stop <= shape_[dim], "tensor",
            "slice [{}, {}) of dim {} with extent {}", start, stop, dim, shape_[dim]);
  Shape shape = shape_;
  shape[dim] = stop - start;
  return Tensor(storage_, shape, strides_, offset_ + start * strides_[dim], dtype_);
}

Tensor Tensor::view_box(const Box& box) const {
  // The messages are formatted only on failure: views are made on every copy path.
  if (static_cast<int>(box.ndim()) != ndim())
    throw InvalidArgument(
        "tensor", fmt::format("{}-d box {} on a {}-d tensor", box.ndim(), box.str(), ndim()));
  int64_t offset = offset_;
  Shape shape(ndim());
  for (int d = 0; d < ndim(); ++d) {
    if (!(0 <= box.lo[d] && box.lo[d] <= box.hi[d] && box.hi[d] <= shape_[d]))
      throw InvalidArgument(
          "tensor", fmt::format("box {} is outside the tensor shape {}", box.str(), shape_));
    offset += box.lo[d] * strides_[d];
    shape[d] = box.hi[d] - box.lo[d];
  }
  return Tensor(storage_, shape, strides_, offset, dtype_);
}

Tensor Tensor::reshape(const Shape& shape) const {
  check_arg(shape_numel(shape) == numel(), "tensor", "cannot reshape {} to {}", str(), shape);
  const Tensor source = contiguous();
  return Tensor(source.storage_, shape, contiguous_strides(shape), source.offset_, dtype_);
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor copy = empty(shape_, dtype_, device_);
  copy.copy_from(*this);
  return copy;
}

Tensor Tensor::to(Device device) const {
  if (device == device_) return *this;
  Tensor copy = empty(shape_, dtype_, device);
  copy.copy_from(*this);
  return copy;
}

Tensor Tensor::to_dtype(DType dtype) const {
  if (dtype == dtype_) return *this;
  const Tensor source = contiguous();
  Tensor result = empty(shape_, dtype, device_);
  if (numel() > 0 && !result.is_shape_only())
    backend_for(device_).convert(result.raw_data(), dtype, source.raw_data(), dtype_,
                                 static_cast<size_t>(numel()), compute_stream_for(device_));
  return result;
}

namespace {

/// n elements of `Word` from `in` (stride `in_step` elements) to `out` (stride `out_step`).
template <typename Word>
void copy_words(char* out, int64_t out_step, const char* in, int64_t in_step, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    Word word;
    std::memcpy(&word, in + i * in_step * static_cast<int64_t>(sizeof(Word)), sizeof(Word));
    std::memcpy(out + i * out_step * static_cast<int64_t>(sizeof(Word)), &word, sizeof(Word));
  }
}

/// n elements of `element_size` bytes at strides `out_step` / `in_step` elements: one load and
/// one store an element for the sizes of the dtypes (a strided face of a halo, a transposed
/// block), memcpy an element otherwise.
void copy_strided_row(char* out, int64_t out_step, const char* in, int64_t in_step, int64_t n,
                      size_t element_size) {
  switch (element_size) {
    case 1: return copy_words<uint8_t>(out, out_step, in, in_step, n);
    case 2: return copy_words<uint16_t>(out, out_step, in, in_step, n);
    case 4: return copy_words<uint32_t>(out, out_step, in, in_step, n);
    case 8: return copy_words<uint64_t>(out, out_step, in, in_step, n);
    default: break;
  }
  const auto bytes = static_cast<int64_t>(element_size);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(out + i * out_step * bytes, in + i * in_step * bytes, element_size);
}

/// Copies elements [begin, end) of the row-major order over `merged`'s dims: whole rows by one
/// memcpy (stream_bytes when `stream`, then a fence) when the innermost dim is contiguous in
/// both, else element by element.
void copy_element_range(char* out, const char* in, const MergedDims& merged, size_t element_size,
                        int64_t begin, int64_t end, bool stream) {
  const std::vector<int64_t>& extent = merged.extent;
  const std::vector<int64_t>& dstride = merged.dst_strides;
  const std::vector<int64_t>& sstride = merged.src_strides;
  const int dims = static_cast<int>(extent.size());
  const int last = dims - 1;
  const int64_t row = extent[last];
  const bool rows_contiguous = dstride[last] == 1 && sstride[last] == 1;
  const auto bytes = static_cast<int64_t>(element_size);
  std::vector<int64_t> index(dims, 0);
  int64_t out_offset = 0, in_offset = 0;  // elements, of the current element
  for (int64_t rest = begin, d = last; d >= 0; --d) {
    index[d] = rest % extent[d];
    rest /= extent[d];
    out_offset += index[d] * dstride[d];
    in_offset += index[d] * sstride[d];
  }
  for (int64_t e = begin; e < end;) {
    const int64_t first = index[last];
    const int64_t n = std::min(row - first, end - e);
    if (rows_contiguous) {
      if (stream)
        stream_bytes(out + out_offset * bytes, in + in_offset * bytes, n * element_size);
      else
        std::memcpy(out + out_offset * bytes, in + in_offset * bytes, n * element_size);
    } else {
      copy_strided_row(out + out_offset * bytes, dstride[last], in + in_offset * bytes,
                       sstride[last], n, element_size);
    }
    e += n;
    if (e == end) break;
    // The next row: back to its start, then the odometer over the outer dims.
    out_offset -= first * dstride[last];
    in_offset -= first * sstride[last];
    index[last] = 0;
    for (int d = last - 1; d >= 0; --d) {
      out_offset += dstride[d];
      in_offset += sstride[d];
      if (++index[d] < extent[d]) break;
      out_offset -= extent[d] * dstride[d];
      in_offset -= extent[d] * sstride[d];
      index[d] = 0;
    }
  }
  if (stream) stream_fence();
}

/// Copies of at least this many bytes run on the rank's compute threads (memory bandwidth grows
/// with the cores that stream; below it the threads' start costs more than they save).
constexpr int64_t kParallelCopyBytes = int64_t{1} << 20;

}  // namespace

void copy_strided_host(void* dst, const int64_t* dst_strides, const void* src,
                       const int64_t* src_strides, const int64_t* shape, int ndim,
                       size_t element_size) {
  // Unit dims dropped and neighbours contiguous in both tensors merged, so the common cases
  // become a few long memcpy calls; large copies are split by elements over the compute threads.
  const MergedDims merged = merge_strided_dims(shape, ndim, dst_strides, src_strides);
  if (merged.count == 0) return;
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  if (merged.extent.empty()) {
    std::memcpy(out, in, element_size);
    return;
  }
  const int threads = compute_threads();
  const int64_t bytes = merged.count * static_cast<int64_t>(element_size);
  // Rows of at least 4 KiB past the caches when the copy (read and written) outgrows this
  // rank's share of them (core/streaming_stores.hpp).
  const bool stream = merged.extent.back() * static_cast<int64_t>(element_size) >= 4096 &&
                      streams_output(std::max(2 * bytes, StreamingScope::current()));
  if (threads > 1 && bytes >= kParallelCopyBytes) {
    parallel_for(merged.count, threads, [&](int64_t begin, int64_t end, int) {
      copy_element_range(out, in, merged, element_size, begin, end, stream);
    });
    return;
  }
  copy_element_range(out, in, merged, element_size, 0, merged.count, stream);
}

void Tensor::copy_from(const Tensor& source) {
  if (source.shape_ != shape_ || source.dtype_ != dtype_)  // formatted only on failure
    throw InvalidArgument("tensor", fmt::format("copy of {} into {}", source.str(), str()));
  if (numel() == 0) return;
  // Estimate mode moves no data; a real tensor cannot take a shape-only one's values.
  if (is_shape_only()) return;
  if (source.is_shape_only()) estimate::throw_touched("a copy into a real tensor", source.str());
  if (device_ == source.device_) {
    backend_for(device_).copy(strided_ref(*this), strided_ref(source), element_size(),
                              compute_stream_for(device_));
    return;
  }
  // Across devices: one contiguous transfer, then a strided copy on this side if needed.
  const Tensor packed = source.contiguous();
  if (is_contiguous()) {
    transfer_bytes(raw_data(), device_, packed.raw_data(), source.device_, nbytes());
    return;
  }
  Tensor staged = empty(shape_, dtype_, device_);
  transfer_bytes(staged.raw_data(), device_, packed.raw_data(), source.device_, nbytes());
  copy_from(staged);
}

void Tensor::pack_box(const Box& box, void* dst) const {
  const Tensor view = view_box(box);
  const std::vector<int64_t> dst_strides = contiguous_strides(view.shape_);
  if (view.numel() == 0) return;
  if (is_shape_only() && dst == nullptr) return;  // estimate mode: a message without payload
  backend_for(device_).copy({dst, view.shape_.data(), dst_strides.data(), ndim()},
                            strided_ref(view), element_size(), compute_stream_for(device_));
}

void Tensor::unpack_box(const Box& box, const void* src) {
  Tensor view = view_box(box);
  const std::vector<int64_t> src_strides = contiguous_strides(view.shape_);
  if (view.numel() == 0) return;
  if (is_shape_only() && src == nullptr) return;  // estimate mode: a message without payload
  backend_for(device_).copy(
      strided_ref(view), {const_cast<void*>(src), view.shape_.data(), src_strides.data(), ndim()},
      element_size(), compute_stream_for(device_));
}

void Tensor::fill(double value) {
  if (numel() == 0 || is_shape_only()) return;
  backend_for(device_).fill(strided_ref(*this), dtype_, value, compute_stream_for(device_));
}

double Tensor::item_as_double(const std::vector<int64_t>& index) const {
  TESSERA_CHECK_ARG(device_.is_cpu(), "tensor", "item_as_double on a {} tensor", device_.str());
  check_arg(static_cast<int>(index.size()) == ndim(), "tensor", "{}-d index into a {}-d tensor",
            index.size(), ndim());
  int64_t offset = 0;
  for (int d = 0; d < ndim(); ++d) {
    check_arg(index[d] >= 0 && index[d] < shape_[d], "tensor", "index {} outside shape {}", index,
              shape_);
    offset += index[d] * strides_[d];
  }
  return dispatch_dtype(dtype_, [&]<typename T>() -> double {
    const T element = static_cast<const T*>(raw_data())[offset];
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
      return static_cast<float>(element);
    else
      return static_cast<double>(element);
  });
}

std::string Tensor::str() const {
  return fmt::format("{} ({}) {}", dtype_name(dtype_), fmt::join(shape_, ", "), device_.str());
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ha = a.to(Device::cpu()).contiguous();
  const Tensor hb = b.to(Device::cpu()).contiguous();
  return a.nbytes() == 0 || std::memcmp(ha.raw_data(), hb.raw_data(), a.nbytes()) == 0;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  check_arg(a.shape() == b.shape(), "tensor", "max_abs_diff of shapes {} and {}", a.shape(),
            b.shape());
  const Tensor ha = a.to(Device::cpu()).to_dtype(DType::f64).contiguous();
  const Tensor hb = b.to(Device::cpu()).to_dtype(DType::f64).contiguous();
  const double* x = ha.data<double>();
  const double* y = hb.data<double>();
  double worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double diff = std::fabs(x[i] - y[i]);
    if (std::isnan(diff)) return diff;
    worst = std::max(worst, diff);
  }
  return worst;
}

}  // namespace tessera
