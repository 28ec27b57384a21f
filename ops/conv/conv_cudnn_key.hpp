// The host-side half of the cuDNN convolution: the descriptor math (dims and strides of the
// cuDNN tensor and filter descriptors for channels-first and channels-last operands, conv1d
// lifted to a conv2d with a unit height), the math-mode rule, the choice among measured
// algorithms, and the key and cache of chosen algorithms. Plain C++ with no cuDNN include, so
// all of it is tested on machines without a GPU (tests/unit/conv_cudnn_key_test.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/box.hpp"
#include "core/dtype.hpp"

namespace tessera::ops {

/// Which cuDNN convolution call a key is for.
enum class CudnnDirection : uint8_t { forward, backward_data, backward_filter };

/// cuDNN's math modes that Tessera uses (cudnnMathType_t): `fma` never uses tensor cores (f32
/// and f64 by default: no TF32 rounding); `default_math` lets cuDNN use TF32 tensor cores for
/// f32 (only when the user allows TF32); `tensor_op` for f16 and bf16.
enum class CudnnMath : uint8_t { fma, default_math, tensor_op };

/// How the elements of an activation [N, C, spatial..] are ordered in memory.
enum class ActivationLayout : uint8_t { channels_first, channels_last };

/// The dims and strides of one cuDNN tensor descriptor (4 entries for conv1d/2d, 5 for conv3d).
struct CudnnTensorDims {
  int rank = 4;
  std::array<int, 5> dims{};
  std::array<int, 5> strides{};
  bool operator==(const CudnnTensorDims&) const = default;
};

/// The dims of one cuDNN filter descriptor, always in [K, C/groups, spatial..] order, and the
/// memory format (NCHW for [Cout, Cin/g, k..] row-major weights, NHWC for [Cout, k.., Cin/g]).
struct CudnnFilterDims {
  int rank = 4;
  std::array<int, 5> dims{};
  bool channels_last = false;
  bool operator==(const CudnnFilterDims&) const = default;
};

/// The strides (elements) of the filter `w` describes, in its dims' order [K, C/groups, k..]:
/// packed row-major for the NCHW format, packed [K, k.., C/groups] for NHWC (the graph API takes
/// strides where the legacy filter descriptor takes a format).
std::array<int64_t, 5> cudnn_filter_strides(const CudnnFilterDims& w);

/// Padding, stride and dilation of a cuDNN convolution descriptor (2 entries for conv1d/2d, 3
/// for conv3d). Padding is always zero: Tessera's conv is valid on the haloed piece.
struct CudnnConvParams {
  int spatial = 2;
  std::array<int, 3> padding{};
  std::array<int, 3> stride{1, 1, 1};
  std::array<int, 3> dilation{1, 1, 1};
  bool operator==(const CudnnConvParams&) const = default;
};

/// The layout of an activation of `shape` [N, C, spatial..] with `strides` (elements):
/// channels-last when the channel stride is below every stride of a spatial dim of extent > 1
/// (and at most the batch stride), channels-first otherwise.
ActivationLayout activation_layout(const Shape& shape, const std::vector<int64_t>& strides);

/// The cuDNN tensor descriptor of an activation [N, C, spatial..] (3-, 4- or 5-d) with any
/// strides: a 3-d (conv1d) activation gets a unit height at dim 2 whose stride is
/// extent(W) * stride(W), so packed NCW / NWC map to packed NCHW / NHWC. Throws InvalidArgument
/// tagged `op` when an extent or stride does not fit cuDNN's int.
CudnnTensorDims cudnn_tensor_dims(const Shape& shape, const std::vector<int64_t>& strides,
                                  const std::string& op);

/// The cuDNN filter descriptor of weights [Cout, Cin/g, k..] with `strides`: packed row-major
/// (NCHW format) or packed channels-last [Cout, k.., Cin/g] (NHWC format); conv1d weights get a
/// unit kernel height. Throws InvalidArgument tagged `op` for any other strides.
CudnnFilterDims cudnn_filter_dims(const Shape& shape, const std::vector<int64_t>& strides,
                                  const std::string& op);

/// The convolution descriptor's arrays for `spatial_dims` (1, 2 or 3) dims of stride, dilation
/// and (symmetric) zero padding, one entry per dim (empty padding: none); conv1d gets stride and
/// dilation 1 and no padding along the unit height.
CudnnConvParams cudnn_conv_params(int spatial_dims, const std::vector<int64_t>& stride,
                                  const std::vector<int64_t>& dilation, const std::string& op,
                                  const std::vector<int64_t>& padding = {});

/// Row-major strides of `shape` stored channels-last: [N, spatial.., C] in memory, returned in
/// the order of `shape` ([N, C, spatial..]).
std::vector<int64_t> channels_last_strides(const Shape& shape);

/// The math mode of a conv on `dtype`: f16/bf16 tensor_op; f32 default_math when `allow_tf32`,
/// else fma; f64 fma.
CudnnMath cudnn_math_for(DType dtype, bool allow_tf32);
/// True when the value of TESSERA_ALLOW_TF32 (null when unset) allows TF32: "1" only.
bool allow_tf32_from_env(const char* value);

/// One algorithm's result in a measurement (cudnnFind*AlgorithmEx), in cuDNN's order (fastest
/// first).
struct CudnnAlgoMeasurement {
  int algorithm = 0;
  bool ok = false;  ///< status was CUDNN_STATUS_SUCCESS
  float milliseconds = 0;
  size_t workspace_bytes = 0;
  bool deterministic = true;
  int math = 0;  ///< cudnnMathType_t the measurement ran with
};

/// The algorithm chosen for one key: what the convolution call is given.
struct CudnnAlgoChoice {
  int algorithm = 0;
  int math = 0;  ///< cudnnMathType_t to set on the convolution descriptor
  size_t workspace_bytes = 0;
  bool operator==(const CudnnAlgoChoice&) const = default;
};

/// The most workspace a measurement offers one convolution on a device with `total_bytes` of
/// memory, `free_bytes` of them free or held in the caching allocator's cache (which it gives
/// back when an allocation would fail): `cap_mb` MiB (TESSERA_CUDNN_WORKSPACE_MB; null: an eighth
/// of the device's memory, at least 2 GiB), never more than half the free memory. (10 GB on an 80
/// GB H100: a fixed 2 GiB kept out the fast algorithms of 1-GiB activations, and ranks sharing a
/// GPU each hold their own workspace.) A `cap_mb` other than decimal digits throws
/// InvalidArgument; "" counts as unset.
size_t cudnn_workspace_limit(const char* cap_mb, size_t total_bytes, size_t free_bytes);

/// Which measured algorithms may be chosen: any; the deterministic ones when one qualifies, else
/// any (preferred); only the deterministic ones (required).
enum class CudnnDeterminism { any, preferred, required };

/// The determinism rule of a conv on `dtype`: required when TESSERA_CUDNN_DETERMINISTIC asks
/// (`required`); else preferred for f16/bf16, whose non-deterministic backward algorithms add
/// partial sums into the output with atomics, so in the half type itself (an error that grows
/// with the number of partial sums, beyond one rounding of an f32 sum); else any.
CudnnDeterminism cudnn_determinism_for(DType dtype, bool required);

/// The fastest measured algorithm that ran, fits `workspace_limit` and meets `determinism`;
/// nullopt when none qualifies.
std::optional<CudnnAlgoChoice> choose_algorithm(
    const std::vector<CudnnAlgoMeasurement>& measurements, CudnnDeterminism determinism,
    size_t workspace_limit);

/// Which cuDNN API runs the convolutions (TESSERA_CUDNN_API): `graph` (the default: the backend
/// graph API, every engine that cuDNN's heuristics list for the conv, each timed on the
/// operands; it reaches engines the legacy enums do not name) or `legacy`
/// (cudnnFind*AlgorithmEx and cudnnConvolution*, the algorithms of cuDNN 7's enums).
enum class CudnnApi { legacy, graph };

/// The API TESSERA_CUDNN_API's value names: null or "" or "graph" graph, "legacy" legacy;
/// another value throws InvalidArgument ("expected graph or legacy").
CudnnApi cudnn_api_from_env(const char* value);

/// How many of the graph API's candidate engines a measurement times, from
/// TESSERA_CUDNN_GRAPH_CANDIDATES: null or "" 10 (the first ten the heuristics rank, as PyTorch's
/// cudnn.benchmark_limit), a count, or 0 for all of them; another value throws InvalidArgument.
size_t cudnn_graph_candidates_from_env(const char* value);

/// The notes of one graph-API engine that the choice looks at (cuDNN's numerical notes).
struct CudnnEngineNotes {
  bool tensor_core = false;                  ///< runs on tensor cores (f32 inputs: TF32)
  bool down_convert_inputs = false;          ///< converts its inputs to a narrower type
  bool reduced_precision_reduction = false;  ///< sums in the data type (f16/bf16), not f32
  bool nondeterministic = false;             ///< results may differ run to run (atomics)
};

/// Whether an engine with `notes` keeps the numerical contract of a conv of `dtype` run with
/// `math`, as the legacy path keeps it through the math mode: no engine that down-converts its
/// inputs; under fma math (f32 without TF32, f64) no tensor-core engine; for f16 and bf16 none
/// that sums in the half type; and with `determinism` required none that is non-deterministic
/// (preferred is settled among the measured engines by choose_algorithm).
bool cudnn_engine_allowed(const CudnnEngineNotes& notes, DType dtype, CudnnMath math,
                          CudnnDeterminism determinism);

/// Everything a cuDNN convolution's algorithm choice depends on: direction, dtype and math,
/// the device, layouts, dims and strides of the three operands, and the conv parameters.
struct CudnnConvKey {
  CudnnDirection direction = CudnnDirection::forward;
  DType dtype = DType::f32;
  CudnnMath math = CudnnMath::fma;
  bool deterministic = false;
  int device = 0;
  ActivationLayout layout = ActivationLayout::channels_first;
  CudnnTensorDims x, y;
  CudnnFilterDims w;
  CudnnConvParams params;
  int groups = 1;
  bool operator==(const CudnnConvKey&) const = default;
};

/// Hash of every field of a CudnnConvKey.
struct CudnnConvKeyHash {
  size_t operator()(const CudnnConvKey& key) const;
};

/// "forward f32 fma cuda:0 x (1,2,1,9)/(18,9,9,1) w (4,2,1,3) nchw y ... stride (1,1) ...": a key
/// in error messages and logs.
std::string describe(const CudnnConvKey& key);

/// A process-wide, thread-safe map of keys to chosen algorithms (each shape is measured once).
class CudnnAlgoCache {
 public:
  /// The choice cached for `key`, if any.
  std::optional<CudnnAlgoChoice> find(const CudnnConvKey& key) const;
  /// Caches `choice` for `key` (a later insert of the same key keeps the first choice).
  CudnnAlgoChoice insert(const CudnnConvKey& key, const CudnnAlgoChoice& choice);
  /// Number of cached keys.
  size_t size() const;
  /// Every cached key with its choice, in no particular order.
  std::vector<std::pair<CudnnConvKey, CudnnAlgoChoice>> entries() const;
  /// Forgets every choice.
  void clear();

 private:
  mutable std::mutex mu_;
  std::unordered_map<CudnnConvKey, CudnnAlgoChoice, CudnnConvKeyHash> choices_;
};

}  // namespace tessera::ops
