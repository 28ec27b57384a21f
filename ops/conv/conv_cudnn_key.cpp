// Descriptor math, math-mode rule, algorithm choice and algorithm cache of the cuDNN conv
// (see conv_cudnn_key.hpp). No cuDNN include: everything here runs and is tested on the cpu.
#include "ops/conv/conv_cudnn_key.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <functional>
#include <limits>
#include <optional>
#include <string>

#include "core/errors.hpp"
#include "core/tensor.hpp"

namespace tessera::ops {
namespace {

int to_int(int64_t value, const char* what, const Shape& shape, const std::string& op) {
  check_arg(value >= 0 && value <= INT_MAX, op,
            "{} {} of an operand of shape {} does not fit cuDNN's 32-bit int", what, value, shape);
  return static_cast<int>(value);
}

void check_activation(const Shape& shape, const std::vector<int64_t>& strides,
                      const std::string& op) {
  check_arg(shape.size() >= 3 && shape.size() <= 5 && strides.size() == shape.size(), op,
            "a cuDNN conv operand needs a 3-, 4- or 5-d shape [N, C, spatial..] and one stride per "
            "dim, got shape {} and strides {}",
            shape, strides);
}

const char* direction_name(CudnnDirection direction) {
  switch (direction) {
    case CudnnDirection::forward: return "forward";
    case CudnnDirection::backward_data: return "backward data";
    case CudnnDirection::backward_filter: return "backward filter";
  }
  return "?";
}

const char* math_name(CudnnMath math) {
  switch (math) {
    case CudnnMath::fma: return "fma";
    case CudnnMath::default_math: return "default (tf32 allowed)";
    case CudnnMath::tensor_op: return "tensor op";
  }
  return "?";
}

}  // namespace

ActivationLayout activation_layout(const Shape& shape, const std::vector<int64_t>& strides) {
  if (shape.size() < 3 || strides.size() != shape.size() || shape[1] <= 1)
    return ActivationLayout::channels_first;
  for (size_t d = 2; d < shape.size(); ++d)
    if (shape[d] > 1 && strides[1] >= strides[d]) return ActivationLayout::channels_first;
  if (shape[0] > 1 && strides[1] > strides[0]) return ActivationLayout::channels_first;
  return ActivationLayout::channels_last;
}

CudnnTensorDims cudnn_tensor_dims(const Shape& shape, const std::vector<int64_t>& strides,
                                  const std::string& op) {
  check_activation(shape, strides, op);
  Shape lifted_shape = shape;
  std::vector<int64_t> lifted_strides = strides;
  if (shape.size() == 3) {  // conv1d: [N, C, W] -> [N, C, 1, W]
    lifted_shape.insert(lifted_shape.begin() + 2, 1);
    lifted_strides.insert(lifted_strides.begin() + 2, shape[2] * strides[2]);
  }
  CudnnTensorDims dims;
  dims.rank = static_cast<int>(lifted_shape.size());
  for (int d = 0; d < dims.rank; ++d) {
    dims.dims[d] = to_int(lifted_shape[d], "extent", shape, op);
    // A stride of a unit dim is never used to address memory, but cuDNN rejects 0.
    dims.strides[d] = std::max(1, to_int(lifted_strides[d], "stride", shape, op));
  }
  return dims;
}

std::vector<int64_t> channels_last_strides(const Shape& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  if (shape.size() < 3) return strides;
  // Memory order [N, spatial.., C]: C is innermost, then the last spatial dim outward.
  int64_t step = shape[1];
  for (size_t d = shape.size() - 1; d >= 2; --d) {
    strides[d] = step;
    step *= shape[d];
  }
  strides[0] = step;
  return strides;
}

CudnnFilterDims cudnn_filter_dims(const Shape& shape, const std::vector<int64_t>& strides,
                                  const std::string& op) {
  check_activation(shape, strides, op);
  CudnnFilterDims dims;
  const bool row_major = strides == contiguous_strides(shape);
  dims.channels_last = !row_major && strides == channels_last_strides(shape);
  check_arg(row_major || dims.channels_last, op,
            "weights of shape {} with strides {}: cuDNN takes packed [Cout, Cin/g, k..] or packed "
            "channels-last [Cout, k.., Cin/g] weights",
            shape, strides);
  Shape lifted = shape;
  if (shape.size() == 3) lifted.insert(lifted.begin() + 2, 1);
  dims.rank = static_cast<int>(lifted.size());
  for (int d = 0; d < dims.rank; ++d) dims.dims[d] = to_int(lifted[d], "extent", shape, op);
  return dims;
}

CudnnConvParams cudnn_conv_params(int spatial_dims, const std::vector<int64_t>& stride,
                                  const std::vector<int64_t>& dilation, const std::string& op,
                                  const std::vector<int64_t>& padding) {
  check_arg(spatial_dims >= 1 && spatial_dims <= 3 &&
                (stride.empty() || static_cast<int>(stride.size()) == spatial_dims) &&
                (dilation.empty() || static_cast<int>(dilation.size()) == spatial_dims),
            op, "conv{}d with stride {} and dilation {}", spatial_dims, stride, dilation);
  CudnnConvParams params;
  params.spatial = spatial_dims == 3 ? 3 : 2;
  const int first = params.spatial - spatial_dims;  // 1 for conv1d (the unit height), else 0
  for (int d = 0; d < spatial_dims; ++d) {
    const int64_t s = stride.empty() ? 1 : stride[d];
    const int64_t l = dilation.empty() ? 1 : dilation[d];
    check_arg(s >= 1 && s <= INT_MAX && l >= 1 && l <= INT_MAX, op,
              "stride {} and dilation {} must be positive ints", stride, dilation);
    params.stride[first + d] = static_cast<int>(s);
    params.dilation[first + d] = static_cast<int>(l);
  }
  check_arg(padding.empty() || static_cast<int>(padding.size()) == spatial_dims, op,
            "conv{}d with padding {}", spatial_dims, padding);
  for (size_t d = 0; d < padding.size(); ++d) {
    check_arg(padding[d] >= 0 && padding[d] <= INT_MAX, op, "padding {} must be non-negative ints",
              padding);
    params.padding[first + d] = static_cast<int>(padding[d]);
  }
  return params;
}

CudnnMath cudnn_math_for(DType dtype, bool allow_tf32) {
  if (dtype == DType::f16 || dtype == DType::bf16) return CudnnMath::tensor_op;
  if (dtype == DType::f32 && allow_tf32) return CudnnMath::default_math;
  return CudnnMath::fma;
}

bool allow_tf32_from_env(const char* value) {
  return value != nullptr && std::string(value) == "1";
}

namespace {

/// A count written in decimal digits only (at most `digits` of them), or nullopt.
std::optional<size_t> parse_count(const std::string& text, size_t digits) {
  if (text.empty() || text.size() > digits ||
      !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return static_cast<size_t>(std::stoull(text));
}

}  // namespace

size_t cudnn_workspace_limit(const char* cap_mb, size_t total_bytes, size_t free_bytes) {
  const std::string text = cap_mb != nullptr ? cap_mb : "";
  size_t cap = std::max<size_t>(size_t{2} << 30, total_bytes / 8);
  if (!text.empty()) {
    const std::optional<size_t> mib = parse_count(text, 9);
    check_arg(mib.has_value(), "conv", "TESSERA_CUDNN_WORKSPACE_MB='{}' (expected a count of MiB)",
              text);
    cap = *mib << 20;
  }
  return std::min(cap, free_bytes / 2);
}

std::array<int64_t, 5> cudnn_filter_strides(const CudnnFilterDims& w) {
  std::array<int64_t, 5> strides{};
  const int rank = w.rank;
  if (!w.channels_last) {
    strides[rank - 1] = 1;
    for (int d = rank - 2; d >= 0; --d) strides[d] = strides[d + 1] * w.dims[d + 1];
    return strides;
  }
  strides[1] = 1;
  int64_t stride = w.dims[1];
  for (int d = rank - 1; d >= 2; --d) {
    strides[d] = stride;
    stride *= w.dims[d];
  }
  strides[0] = stride;
  return strides;
}

size_t cudnn_graph_candidates_from_env(const char* value) {
  const std::string text = value != nullptr ? value : "";
  if (text.empty()) return 10;
  const std::optional<size_t> count = parse_count(text, 6);
  check_arg(count.has_value(), "conv",
            "TESSERA_CUDNN_GRAPH_CANDIDATES='{}' (expected a count, 0 for all)", text);
  return *count == 0 ? std::numeric_limits<size_t>::max() : *count;
}

CudnnApi cudnn_api_from_env(const char* value) {
  const std::string name = value != nullptr ? value : "";
  if (name.empty() || name == "graph") return CudnnApi::graph;
  check_arg(name == "legacy", "conv", "TESSERA_CUDNN_API='{}' (expected graph or legacy)", name);
  return CudnnApi::legacy;
}

bool cudnn_engine_allowed(const CudnnEngineNotes& notes, DType dtype, CudnnMath math,
                          CudnnDeterminism determinism) {
  if (notes.down_convert_inputs) return false;
  if (math == CudnnMath::fma && notes.tensor_core) return false;
  if ((dtype == DType::f16 || dtype == DType::bf16) && notes.reduced_precision_reduction)
    return false;
  if (determinism == CudnnDeterminism::required && notes.nondeterministic) return false;
  return true;
}

CudnnDeterminism cudnn_determinism_for(DType dtype, bool required) {
  if (required) return CudnnDeterminism::required;
  if (dtype == DType::f16 || dtype == DType::bf16) return CudnnDeterminism::preferred;
  return CudnnDeterminism::any;
}

std::optional<CudnnAlgoChoice> choose_algorithm(
    const std::vector<CudnnAlgoMeasurement>& measurements, CudnnDeterminism determinism,
    size_t workspace_limit) {
  // The fastest that ran, fits and (when `deterministic_only`) is deterministic.
  auto fastest = [&](bool deterministic_only) -> const CudnnAlgoMeasurement* {
    const CudnnAlgoMeasurement* best = nullptr;
    for (const CudnnAlgoMeasurement& m : measurements) {
      if (!m.ok || m.workspace_bytes > workspace_limit || (deterministic_only && !m.deterministic))
        continue;
      // cuDNN lists them fastest first; the comparison keeps that order on ties.
      if (best == nullptr || m.milliseconds < best->milliseconds) best = &m;
    }
    return best;
  };
  const CudnnAlgoMeasurement* best = fastest(determinism != CudnnDeterminism::any);
  if (best == nullptr && determinism == CudnnDeterminism::preferred) best = fastest(false);
  if (best == nullptr) return std::nullopt;
  return CudnnAlgoChoice{best->algorithm, best->math, best->workspace_bytes};
}

size_t CudnnConvKeyHash::operator()(const CudnnConvKey& key) const {
  size_t hash = 0;
  auto mix = [&hash](int64_t value) {
    hash ^= std::hash<int64_t>{}(value) + 0x9e3779b97f4a7c15ULL + (hash << 6) + (hash >> 2);
  };
  mix(static_cast<int64_t>(key.direction));
  mix(static_cast<int64_t>(key.dtype));
  mix(static_cast<int64_t>(key.math));
  mix(key.deterministic ? 1 : 0);
  mix(key.device);
  mix(static_cast<int64_t>(key.layout));
  for (const CudnnTensorDims* tensor : {&key.x, &key.y}) {
    mix(tensor->rank);
    for (int d = 0; d < tensor->rank; ++d) {
      mix(tensor->dims[d]);
      mix(tensor->strides[d]);
    }
  }
  mix(key.w.rank);
  mix(key.w.channels_last ? 1 : 0);
  for (int d = 0; d < key.w.rank; ++d) mix(key.w.dims[d]);
  mix(key.params.spatial);
  for (int d = 0; d < key.params.spatial; ++d) {
    mix(key.params.padding[d]);
    mix(key.params.stride[d]);
    mix(key.params.dilation[d]);
  }
  mix(key.groups);
  return hash;
}

std::string describe(const CudnnConvKey& key) {
  auto tensor = [](const CudnnTensorDims& t) {
    return fmt::format("({})/({})", fmt::join(t.dims.begin(), t.dims.begin() + t.rank, ","),
                       fmt::join(t.strides.begin(), t.strides.begin() + t.rank, ","));
  };
  auto spatial = [&key](const std::array<int, 3>& values) {
    return fmt::format("({})", fmt::join(values.begin(), values.begin() + key.params.spatial, ","));
  };
  return fmt::format(
      "{} {} math {} on cuda:{}, {} x {} w ({}) {} y {} stride {} dilation {} groups {}{}",
      direction_name(key.direction), dtype_name(key.dtype), math_name(key.math), key.device,
      key.layout == ActivationLayout::channels_last ? "channels-last" : "channels-first",
      tensor(key.x), fmt::join(key.w.dims.begin(), key.w.dims.begin() + key.w.rank, ","),
      key.w.channels_last ? "nhwc" : "nchw", tensor(key.y), spatial(key.params.stride),
      spatial(key.params.dilation), key.groups, key.deterministic ? " deterministic" : "");
}

std::optional<CudnnAlgoChoice> CudnnAlgoCache::find(const CudnnConvKey& key) const {
  std::lock_guard lock(mu_);
  const auto it = choices_.find(key);
  if (it == choices_.end()) return std::nullopt;
  return it->second;
}

CudnnAlgoChoice CudnnAlgoCache::insert(const CudnnConvKey& key, const CudnnAlgoChoice& choice) {
  std::lock_guard lock(mu_);
  return choices_.emplace(key, choice).first->second;
}

size_t CudnnAlgoCache::size() const {
  std::lock_guard lock(mu_);
  return choices_.size();
}

std::vector<std::pair<CudnnConvKey, CudnnAlgoChoice>> CudnnAlgoCache::entries() const {
  std::lock_guard lock(mu_);
  return {choices_.begin(), choices_.end()};
}

void CudnnAlgoCache::clear() {
  std::lock_guard lock(mu_);
  choices_.clear();
}

}  // namespace tessera::ops
