// The cuDNN conv on a GPU (skipped, with the reason printed, when none is visible):
//  - every PyTorch fixture (tests/fixtures/conv), padded on the host as the op's halo plan would,
//    through cuDNN forward, backward data, backward filter and backward bias against the cpu
//    reference kernels in f64: f32 (TF32 off) within 1e-4 of the largest reference value, f16 and
//    bf16 within an elementwise bound from their unit roundoff (see half_precision_bound);
//  - the same in channels-last (NHWC / NDHWC operands and weights, through ConvOperand strides);
//  - the sharded conv (ops::conv through apply_op, halo exchange on the device) on 1, 2 and 4
//    local ranks sharing the GPU equals the same conv on one rank, forward and gradients, on the
//    random cases of the cpu sweep (tests/dist/conv_cases.hpp), with and without halo overlap.
// These run on the API TESSERA_CUDNN_API names (the graph API by default; gpu-check.sh runs them
// again with legacy). One test needs no GPU and runs everywhere cuDNN is built in: the graph
// API's descriptors finalize for every direction, layout, dtype and geometry.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/autograd.hpp"
#include "core/gpu_runtime.hpp"
#include "core/op_registry.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/conv/conv_cudnn.hpp"
#include "ops/conv/conv_cudnn_graph.hpp"
#include "ops/conv/conv_cudnn_key.hpp"
#include "ops/conv/conv_kernels.hpp"
#include "ops/ops.hpp"
#include "tests/common/fixtures.hpp"
#include "tests/common/roundoff.hpp"
#include "tests/dist/conv_cases.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera::ops {
namespace {

using Json = nlohmann::json;
const std::string kFixtureDir = testing::fixture_dir("conv");
const Device kGpu = Device::cuda(0);

#define SKIP_WITHOUT_GPU()                                                                      \
  if (gpu::device_count() == 0)                                                                 \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the cuDNN conv tests " \
                  "need a GPU"

// ---- the graph API's descriptors, without a GPU ----

TEST(ConvCudnnGraph, DescriptorsFinalizeForEveryDirectionLayoutDtypeAndGeometry) {
  struct Geometry {
    Shape x, w;
    std::vector<int64_t> stride, dilation, padding;
    int groups;
  };
  const std::vector<Geometry> geometries{
      {{2, 4, 19}, {6, 4, 5}, {1}, {1}, {2}, 1},                       // conv1d, padded
      {{1, 6, 12, 10}, {4, 3, 3, 3}, {2, 1}, {1, 2}, {1, 0}, 2},       // conv2d, groups 2
      {{1, 2, 7, 8, 9}, {3, 2, 3, 2, 3}, {1, 2, 1}, {2, 1, 1}, {}, 1}  // conv3d
  };
  int built = 0;
  for (const Geometry& g : geometries) {
    const int spatial = static_cast<int>(g.x.size()) - 2;
    Shape y{g.x[0], g.w[0]};
    for (int d = 0; d < spatial; ++d) {
      const int64_t pad = g.padding.empty() ? 0 : g.padding[d];
      y.push_back((g.x[2 + d] + 2 * pad - g.dilation[d] * (g.w[2 + d] - 1) - 1) / g.stride[d] + 1);
    }
    for (bool channels_last : {false, true})
      for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16})
        for (CudnnDirection direction : {CudnnDirection::forward, CudnnDirection::backward_data,
                                         CudnnDirection::backward_filter}) {
          const auto strides = [&](const Shape& shape) {
            return channels_last ? channels_last_strides(shape) : contiguous_strides(shape);
          };
          CudnnConvKey key;
          key.direction = direction;
          key.dtype = dtype;
          key.math = cudnn_math_for(dtype, false);
          key.layout =
              channels_last ? ActivationLayout::channels_last : ActivationLayout::channels_first;
          key.x = cudnn_tensor_dims(g.x, strides(g.x), "conv");
          key.y = cudnn_tensor_dims(y, strides(y), "conv");
          key.w = cudnn_filter_dims(g.w, strides(g.w), "conv");
          key.params = cudnn_conv_params(spatial, g.stride, g.dilation, "conv", g.padding);
          key.groups = g.groups;
          EXPECT_NO_THROW(conv_graph_check_descriptors(key)) << describe(key);
          ++built;
        }
  }
  EXPECT_EQ(built, 3 * 2 * 4 * 3);
  // And cuDNN checks what it is given: an output one element too long is refused.
  const Shape x{1, 2, 9, 9}, w{3, 2, 3, 3}, y_wrong{1, 3, 8, 7};
  CudnnConvKey key;
  key.x = cudnn_tensor_dims(x, contiguous_strides(x), "conv");
  key.y = cudnn_tensor_dims(y_wrong, contiguous_strides(y_wrong), "conv");
  key.w = cudnn_filter_dims(w, contiguous_strides(w), "conv");
  key.params = cudnn_conv_params(2, {1, 1}, {1, 1}, "conv");
  EXPECT_THROW(conv_graph_check_descriptors(key), Error);
}

// ---- host helpers (f64 on the cpu) ----

/// `x` [N, C, S..] with `lo`/`hi` cells added along every spatial dim: zeros, or the periodic
/// continuation (circular), as the op's halo plan fills them.
Tensor pad(const Tensor& x, const std::vector<int64_t>& lo, const std::vector<int64_t>& hi,
           bool circular) {
  Shape shape = x.shape();
  const int spatial = x.ndim() - 2;
  for (int d = 0; d < spatial; ++d) shape[2 + d] += lo[d] + hi[d];
  Tensor out = Tensor::zeros(shape, DType::f64);
  const Tensor in = x.contiguous();
  const std::vector<int64_t> in_strides = contiguous_strides(x.shape());
  std::vector<int64_t> index(shape.size(), 0);
  for (int64_t flat = 0; flat < out.numel(); ++flat) {
    int64_t rest = flat, source = 0;
    bool inside = true;
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      index[d] = rest % shape[d];
      rest /= shape[d];
    }
    for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
      int64_t i = index[d];
      if (d >= 2) {
        const int64_t length = x.shape(d);
        i -= lo[d - 2];
        if (i < 0 || i >= length) {
          if (!circular) inside = false;
          i = ((i % length) + length) % length;
        }
      }
      source += i * in_strides[d];
    }
    if (inside) out.data<double>()[flat] = in.data<double>()[source];
  }
  return out;
}

/// Elementwise |t| (f64, cpu).
Tensor absolute(const Tensor& t) {
  Tensor out = t.contiguous().clone();
  for (int64_t i = 0; i < out.numel(); ++i)
    out.data<double>()[i] = std::fabs(out.data<double>()[i]);
  return out;
}

/// [N, C, S..] values stored channels-last ([N, S.., C] in memory), as a contiguous tensor of
/// that memory shape.
Tensor to_channels_last(const Tensor& t) {
  const Shape& shape = t.shape();
  Shape memory{shape[0]};
  for (size_t d = 2; d < shape.size(); ++d) memory.push_back(shape[d]);
  memory.push_back(shape[1]);
  Tensor out = Tensor::empty(memory, t.dtype());
  const std::vector<int64_t> strides = channels_last_strides(shape);
  const Tensor in = t.contiguous();
  const size_t element = t.element_size();
  std::vector<int64_t> index(shape.size(), 0);
  for (int64_t flat = 0; flat < in.numel(); ++flat) {
    int64_t rest = flat, target = 0;
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      index[d] = rest % shape[d];
      rest /= shape[d];
    }
    for (size_t d = 0; d < shape.size(); ++d) target += index[d] * strides[d];
    std::memcpy(static_cast<char*>(out.raw_data()) + target * element,
                static_cast<const char*>(in.raw_data()) + flat * element, element);
  }
  return out;
}

/// Inverse of to_channels_last: the [N, C, S..] tensor of a channels-last memory tensor.
Tensor from_channels_last(const Tensor& memory, const Shape& shape) {
  Tensor out = Tensor::empty(shape, memory.dtype());
  const std::vector<int64_t> strides = channels_last_strides(shape);
  const size_t element = memory.element_size();
  std::vector<int64_t> index(shape.size(), 0);
  for (int64_t flat = 0; flat < out.numel(); ++flat) {
    int64_t rest = flat, source = 0;
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      index[d] = rest % shape[d];
      rest /= shape[d];
    }
    for (size_t d = 0; d < shape.size(); ++d) source += index[d] * strides[d];
    std::memcpy(static_cast<char*>(out.raw_data()) + flat * element,
                static_cast<const char*>(memory.raw_data()) + source * element, element);
  }
  return out;
}

/// A cpu tensor in `dtype` on the GPU.
Tensor upload(const Tensor& host, DType dtype) {
  return host.to_dtype(dtype).to(kGpu);
}

/// A GPU tensor back on the host in f64, after the compute stream's work is done.
Tensor download(const Tensor& device) {
  synchronize(compute_stream_for(device.device()));
  return device.to(Device::cpu()).to_dtype(DType::f64);
}

double max_abs(const Tensor& t) {
  double scale = 0;
  for (int64_t i = 0; i < t.numel(); ++i) scale = std::max(scale, std::fabs(t.data<double>()[i]));
  return scale;
}

using testing::unit_roundoff;

/// Elementwise error bound of a conv computed from inputs rounded to `dtype` (f16/bf16), with
/// products and sums in f32 and the result rounded to `dtype`, against the exact result:
/// each product a*b of rounded inputs is a(1+e1)b(1+e2), |e| <= u, off by at most (2u+u^2)|ab|;
/// an f32 sum of n terms adds at most n*2^-24 * sum|terms|; rounding the result adds u|y|
/// <= u * sum|terms|. So |got - exact| <= (3u + u^2 + n*2^-24) * S, S = sum of |terms| of that
/// output element, which the cpu reference gives exactly as the same conv of |inputs|.
/// Returns the number of elements outside the bound.
int64_t outside_bound(const Tensor& got, const Tensor& exact, const Tensor& magnitude, DType dtype,
                      int64_t reduction_length) {
  const double u = unit_roundoff(dtype);
  const double factor =
      3 * u + u * u + static_cast<double>(reduction_length) * std::ldexp(1.0, -24);
  int64_t outside = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double bound = factor * magnitude.data<double>()[i] * 1.01 + 1e-30;
    outside += std::fabs(got.data<double>()[i] - exact.data<double>()[i]) > bound;
  }
  return outside;
}

// ---- one fixture through cuDNN ----

struct FixtureCase {
  std::string name;
  Tensor x_padded, w, b, gy;  // f64 cpu
  bool has_bias = false;
  ConvGeometry geometry;
  Tensor y_torch;  // PyTorch's forward
};

std::vector<FixtureCase> load_fixtures() {
  std::vector<FixtureCase> cases;
  const Json manifest = testing::read_manifest(kFixtureDir);
  for (const Json& fixture : manifest["cases"]) {
    FixtureCase c;
    c.name = fixture["name"];
    const Json& files = fixture["files"];
    const Shape x_shape = fixture["x_shape"].get<Shape>();
    const Shape w_shape = fixture["w_shape"].get<Shape>();
    const Shape y_shape = fixture["y_shape"].get<Shape>();
    std::vector<int64_t> lo, hi;
    for (const Json& pair : fixture["padding"]) {
      lo.push_back(pair[0]);
      hi.push_back(pair[1]);
    }
    c.x_padded = pad(testing::read_fixture(kFixtureDir, files["x"], x_shape), lo, hi,
                     fixture["padding_mode"] == "circular");
    c.w = testing::read_fixture(kFixtureDir, files["w"], w_shape);
    c.gy = testing::read_fixture(kFixtureDir, files["gy"], y_shape);
    c.y_torch = testing::read_fixture(kFixtureDir, files["y"], y_shape);
    c.has_bias = fixture["has_bias"];
    c.b = c.has_bias ? testing::read_fixture(kFixtureDir, files["b"], {w_shape[0]})
                     : Tensor::zeros({w_shape[0]}, DType::f64);
    c.geometry = ConvGeometry{fixture["stride"].get<std::vector<int64_t>>(),
                              fixture["dilation"].get<std::vector<int64_t>>(),
                              fixture["groups"].get<int64_t>()};
    cases.push_back(std::move(c));
  }
  return cases;
}

/// y, dx, dw, db of one case (f64 host tensors), from the cpu reference or from cuDNN in
/// `dtype`, channels-first (through Tensors) or channels-last (through ConvOperands).
struct Results {
  Tensor y, dx, dw, db;
};

Results reference(const FixtureCase& c) {
  const ConvBackend cpu = ConvBackend::reference;
  return {conv_forward(c.x_padded, c.w, c.has_bias ? &c.b : nullptr, c.geometry, cpu),
          conv_backward_data(c.gy, c.w, c.x_padded.shape(), c.geometry, cpu),
          conv_backward_weight(c.x_padded, c.gy, c.w.shape(), c.geometry, cpu),
          conv_backward_bias(c.gy)};
}

/// Sums of |terms| per output element of every result (for the half-precision bound).
Results magnitudes(const FixtureCase& c) {
  const ConvBackend cpu = ConvBackend::reference;
  const Tensor ax = absolute(c.x_padded), aw = absolute(c.w), ab = absolute(c.b);
  const Tensor agy = absolute(c.gy);
  return {conv_forward(ax, aw, c.has_bias ? &ab : nullptr, c.geometry, cpu),
          conv_backward_data(agy, aw, ax.shape(), c.geometry, cpu),
          conv_backward_weight(ax, agy, aw.shape(), c.geometry, cpu), conv_backward_bias(agy)};
}

Results on_gpu(const FixtureCase& c, DType dtype) {
  const Tensor x = upload(c.x_padded, dtype), w = upload(c.w, dtype), b = upload(c.b, dtype);
  const Tensor gy = upload(c.gy, dtype);
  return {download(conv_forward(x, w, c.has_bias ? &b : nullptr, c.geometry)),
          download(conv_backward_data(gy, w, x.shape(), c.geometry)),
          download(conv_backward_weight(x, gy, w.shape(), c.geometry)),
          download(conv_backward_bias(gy))};
}

/// A device buffer holding `host` channels-last, and its operand ([N, C, S..] with
/// channels-last strides).
struct ChannelsLast {
  Tensor memory;
  ConvOperand operand;
  ChannelsLast(const Tensor& host, DType dtype) : memory(upload(to_channels_last(host), dtype)) {
    operand = ConvOperand{memory.raw_data(), host.shape(), channels_last_strides(host.shape()),
                          dtype, kGpu};
  }
  explicit ChannelsLast(const Shape& shape, DType dtype)
      : ChannelsLast(Tensor::zeros(shape, DType::f64), dtype) {}
  Tensor download_nchw() const { return from_channels_last(download(memory), operand.shape); }
};

Results on_gpu_channels_last(const FixtureCase& c, DType dtype) {
  const ChannelsLast x(c.x_padded, dtype), w(c.w, dtype), gy(c.gy, dtype);
  const Tensor b = upload(c.b, dtype);
  const ConvOperand b_operand = conv_operand(b);
  ChannelsLast y(c.y_torch.shape(), dtype), dx(c.x_padded.shape(), dtype), dw(c.w.shape(), dtype);
  conv_forward_cudnn(x.operand, w.operand, c.has_bias ? &b_operand : nullptr, c.geometry,
                     y.operand);
  conv_backward_data_cudnn(gy.operand, w.operand, c.geometry, dx.operand);
  conv_backward_filter_cudnn(x.operand, gy.operand, c.geometry, dw.operand);
  Tensor db = Tensor::empty({c.w.shape(0)}, dtype, kGpu);
  conv_backward_bias_cudnn(gy.operand, conv_operand(db));
  return {y.download_nchw(), dx.download_nchw(), dw.download_nchw(), download(db)};
}

/// Reduction lengths: products summed per y/dx element (at most Cin/g * |k|, resp. Cout/g *
/// |k|), per dw element (N * |O|) and per db element (N * |O|).
std::vector<int64_t> reduction_lengths(const FixtureCase& c) {
  const int64_t kernel = c.w.numel() / (c.w.shape(0) * c.w.shape(1));
  const int64_t outputs = c.gy.numel() / c.gy.shape(1);
  return {c.w.shape(1) * kernel, c.w.shape(0) / c.geometry.groups * kernel, outputs, outputs};
}

void expect_close(const Results& got, const Results& exact, const std::string& where,
                  double tolerance) {
  const Tensor Results::*fields[] = {&Results::y, &Results::dx, &Results::dw, &Results::db};
  const char* names[] = {"y", "dx", "dw", "db"};
  for (int i = 0; i < 4; ++i) {
    const double scale = std::max(max_abs(exact.*fields[i]), 1e-12);
    EXPECT_LE(max_abs_diff(got.*fields[i], exact.*fields[i]) / scale, tolerance)
        << names[i] << " of " << where;
  }
}

void expect_within_half_bound(const Results& got, const Results& exact, const Results& magnitude,
                              const FixtureCase& c, DType dtype, const std::string& where) {
  const Tensor Results::*fields[] = {&Results::y, &Results::dx, &Results::dw, &Results::db};
  const char* names[] = {"y", "dx", "dw", "db"};
  const std::vector<int64_t> lengths = reduction_lengths(c);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(
        outside_bound(got.*fields[i], exact.*fields[i], magnitude.*fields[i], dtype, lengths[i]), 0)
        << names[i] << " of " << where << " (elements outside the " << dtype_name(dtype)
        << " rounding bound)";
}

TEST(ConvCudnnGpu, F32MatchesTheCpuReferenceOnEveryFixtureWithTf32Off) {
  SKIP_WITHOUT_GPU();
  set_conv_allow_tf32(false);
  for (const FixtureCase& c : load_fixtures()) {
    const Results exact = reference(c);
    EXPECT_LE(max_abs_diff(exact.y, c.y_torch), 1e-10) << c.name << ": padded reference vs torch";
    expect_close(on_gpu(c, DType::f32), exact, c.name + " f32 nchw", 1e-4);
    expect_close(on_gpu_channels_last(c, DType::f32), exact, c.name + " f32 channels-last", 1e-4);
  }
}

TEST(ConvCudnnGpu, F64MatchesTheCpuReferenceOnEveryFixture) {
  SKIP_WITHOUT_GPU();
  for (const FixtureCase& c : load_fixtures())
    expect_close(on_gpu(c, DType::f64), reference(c), c.name + " f64 nchw", 1e-12);
}

TEST(ConvCudnnGpu, HalfAndBfloat16StayWithinTheirRoundingBoundOnEveryFixture) {
  SKIP_WITHOUT_GPU();
  for (const FixtureCase& c : load_fixtures()) {
    const Results exact = reference(c), magnitude = magnitudes(c);
    for (DType dtype : {DType::f16, DType::bf16}) {
      const std::string where = fmt::format("{} {}", c.name, dtype_name(dtype));
      expect_within_half_bound(on_gpu(c, dtype), exact, magnitude, c, dtype, where + " nchw");
      expect_within_half_bound(on_gpu_channels_last(c, dtype), exact, magnitude, c, dtype,
                               where + " channels-last");
    }
  }
}

TEST(ConvCudnnGpu, BiasGradientIsBitIdenticalRunToRunAndWhateverTheAlignment) {
  SKIP_WITHOUT_GPU();
  // One pass and two-pass (chunked) plans, rows of whole 16-byte groups and not. The same values
  // one element into a buffer are read element by element instead of in 16-byte loads: the sum
  // order is the plan's either way, so db must not change by a bit.
  for (const Shape& shape :
       {Shape{2, 2, 12, 10}, Shape{2, 4, 11}, Shape{8, 3, 40, 64}, Shape{4, 2, 1 << 16}})
    for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
      const std::string where = fmt::format("dy ({}) {}", fmt::join(shape, ","), dtype_name(dtype));
      const int64_t numel = shape_numel(shape);
      // values[0] is a pad cell; dy's values are values[1..] in both copies.
      Tensor values = Tensor::empty({numel + 1}, DType::f64);
      for (int64_t i = 0; i <= numel; ++i)
        values.data<double>()[i] = i == 0 ? 0.0 : std::sin(0.37 * static_cast<double>(i)) * 4;
      const Tensor aligned =
          upload(values.slice(0, 1, numel + 1).contiguous(), dtype).reshape(shape);
      const Tensor padded = upload(values, dtype);
      const Tensor unaligned = padded.slice(0, 1, numel + 1).reshape(shape);
      ASSERT_EQ(unaligned.storage_offset(), 1) << where;
      const Tensor first = download(conv_backward_bias(aligned));
      const Tensor again = download(conv_backward_bias(aligned));
      const Tensor shifted = download(conv_backward_bias(unaligned));
      const Tensor exact = conv_backward_bias(download(aligned));
      const Tensor magnitude = conv_backward_bias(absolute(download(aligned)));
      const double output_rounding = dtype == DType::bf16  ? 0x1p-8
                                     : dtype == DType::f16 ? 0x1p-11
                                                           : 0;
      const double accumulation = dtype == DType::f64 ? 1e-13 : 1e-5;
      for (int64_t c = 0; c < shape[1]; ++c) {
        EXPECT_EQ(again.data<double>()[c], first.data<double>()[c]) << where << " channel " << c;
        EXPECT_EQ(shifted.data<double>()[c], first.data<double>()[c]) << where << " channel " << c;
        const double e = exact.data<double>()[c];
        EXPECT_LE(std::fabs(first.data<double>()[c] - e),
                  output_rounding * std::fabs(e) + accumulation * magnitude.data<double>()[c])
            << where << " channel " << c;
      }
    }
}

TEST(ConvCudnnGpu, EachShapeIsMeasuredOnceAndCached) {
  SKIP_WITHOUT_GPU();
  const Tensor x = upload(Tensor::zeros({1, 3, 17, 19}, DType::f64), DType::f32);
  const Tensor w = upload(Tensor::zeros({5, 3, 3, 3}, DType::f64), DType::f32);
  const ConvGeometry geometry{{1, 1}, {1, 1}, 1};
  conv_forward(x, w, nullptr, geometry);
  const size_t after_first = conv_cudnn_cached_algorithms();
  for (int i = 0; i < 3; ++i) conv_forward(x, w, nullptr, geometry);
  EXPECT_EQ(conv_cudnn_cached_algorithms(), after_first);
  conv_forward(upload(Tensor::zeros({1, 3, 18, 19}, DType::f64), DType::f32), w, nullptr, geometry);
  EXPECT_EQ(conv_cudnn_cached_algorithms(), after_first + 1) << "a new shape is a new key";
}

TEST(ConvCudnnGpu, ShapeErrorsOnCudaTensorsAreTaggedWithTheOp) {
  SKIP_WITHOUT_GPU();
  const Tensor x = upload(Tensor::zeros({1, 3, 17}, DType::f64), DType::f32);
  const Tensor w = upload(Tensor::zeros({5, 4, 3}, DType::f64), DType::f32);
  try {
    conv_forward(x, w, nullptr, ConvGeometry{{1}, {1}, 1});
    FAIL() << "expected an error";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("[conv]"), std::string::npos) << error.what();
  }
}

// ---- the sharded conv on the GPU ----

/// y, dx, dw (and db) of a case on `mesh`, computed on the GPU, back on the host in f64.
std::vector<Tensor> run_sharded_on_gpu(const testing::ConvCase& c, const DeviceMesh& mesh,
                                       const Tensor& x, const Tensor& w, const Tensor& b,
                                       const Tensor& gy, bool sharded) {
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  auto on_gpu = [](const ShardTensor& t) {
    return ShardTensor(t.to_local().to_dtype(DType::f32).to(kGpu), t.mesh(), t.spec());
  };
  Tape tape;
  ShardTensor xs = on_gpu(sharded ? ShardTensor::distribute(x, mesh, c.placements, c.extents)
                                  : ShardTensor::distribute(x, mesh, replicated));
  xs.set_requires_grad();
  ShardTensor ws = on_gpu(ShardTensor::distribute(w, mesh, replicated));
  ws.set_requires_grad();
  std::optional<ShardTensor> bs;
  if (c.bias) bs = on_gpu(ShardTensor::distribute(b, mesh, replicated)).set_requires_grad();
  const ShardTensor y = conv(xs, ws, bs, c.options);
  const ShardTensor gys =
      on_gpu(ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents));
  tape.backward(y, gys);
  std::vector<Tensor> results{y.full_tensor(), tape.grad(xs)->full_tensor(),
                              tape.grad(ws)->full_tensor()};
  if (c.bias) results.push_back(tape.grad(*bs)->full_tensor());
  for (Tensor& result : results) result = download(result);
  return results;
}

TEST(ConvCudnnGpu, ShardedConvOnOneTwoAndFourLocalRanksMatchesOneRank) {
  SKIP_WITHOUT_GPU();
  int compared = 0;
  for (bool overlap : {false, true}) {
    set_halo_overlap(overlap);
    for (int world : {1, 2, 4}) {
      run_local_ranks(world, [&](std::shared_ptr<Comm> comm) {
        const auto meshes = testing::mesh_factorizations(comm->size());
        auto self = comm->split(comm->rank(), 0);
        DeviceMesh single(self, {1});
        for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
          DeviceMesh mesh(comm, meshes[mesh_index]);
          for (int index = 0; index < testing::sweep_cases(12); ++index) {
            testing::CaseRng rng(
                testing::case_seed(43, comm->size(), static_cast<int>(mesh_index), index));
            const testing::ConvCase c = testing::random_conv_case(mesh.shape(), rng);
            // Small integers: every product and partial sum is exact in f32 for the
            // GEMM-based algorithms, so the tolerance only absorbs FFT/Winograd rounding.
            const Tensor x = testing::integer_tensor(c.x_shape, DType::f64, rng, -3, 3);
            const Tensor w = testing::integer_tensor(c.w_shape, DType::f64, rng, -3, 3);
            const Tensor b = testing::integer_tensor({c.w_shape[0]}, DType::f64, rng, -3, 3);
            const ShardTensor probe =
                conv(ShardTensor::distribute(x, single, {Placement::replicate()}),
                     ShardTensor::distribute(w, single, {Placement::replicate()}), std::nullopt,
                     c.options);
            const Tensor gy = testing::integer_tensor(probe.global_shape(), DType::f64, rng, -3, 3);
            const auto expected = run_sharded_on_gpu(c, single, x, w, b, gy, false);
            const auto actual = run_sharded_on_gpu(c, mesh, x, w, b, gy, true);
            const char* names[] = {"y", "dx", "dw", "db"};
            for (size_t i = 0; i < expected.size(); ++i)
              EXPECT_LE(testing::relative_error(actual[i], expected[i]), 1e-5)
                  << names[i] << " world " << world << " mesh " << testing::shape_str(mesh.shape())
                  << " case " << index << " overlap " << overlap;
            if (comm->rank() == 0) ++compared;
          }
        }
      });
    }
  }
  set_halo_overlap(false);
  EXPECT_GE(compared, 2 * 3 * testing::sweep_cases(12));  // overlap off/on, 3 worlds
}

}  // namespace
}  // namespace tessera::ops
