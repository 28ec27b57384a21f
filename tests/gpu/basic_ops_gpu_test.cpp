// The basic ops on a GPU (skipped, with the reason printed, when none is visible): relu, gelu,
// silu, tanh, exp, scale, sigmoid, softplus, leaky_relu, erf, sqrt, neg, abs, log, clamp,
// add/sub/mul/div/pow/maximum/minimum (same shape, numpy broadcast either way, the align
// attribute), bias_add, where, linear, matmul, concat, split, softmax, log_softmax, dropout,
// sum/mean over dims (keepdim), mse_loss, each forward and backward through apply_op and the tape,
// with shapes that take the 128-bit vector path with a scalar tail and the two-pass reductions:
//  - on cuda against the cpu op on the same data, in f32, f64, f16 and bf16 (bounds below);
//  - sharded over 1, 2 and 4 local ranks sharing the GPU against one rank on the GPU;
//  - two runs give bit-identical results (no atomics, a reduction order fixed by the shapes);
//  - forward and backward on device tensors move no byte through the host.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/autograd.hpp"
#include "core/backend/transfer.hpp"
#include "core/gpu_runtime.hpp"
#include "core/op_registry.hpp"
#include "core/runtime/rank_context.hpp"
#include "ops/op_helpers.hpp"
#include "ops/ops.hpp"
#include "tests/common/roundoff.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera::ops {
namespace {

using testing::CaseRng;
const Device kGpu = Device::cuda(0);

#define SKIP_WITHOUT_GPU()                                                                     \
  if (gpu::device_count() == 0)                                                                \
  GTEST_SKIP() << "no CUDA device is visible (gpu::device_count() == 0): the cuda kernels of " \
                  "the basic ops need a GPU"

/// One op under test: its forward from the inputs, the input shapes (inputs after the first are
/// replicated when `broadcast`, else laid out like the first), and the longest sum behind one
/// element of its outputs or gradients (1 for a pointwise result).
struct OpCase {
  std::string name;
  std::vector<Shape> shapes;
  std::function<ShardTensor(const std::vector<ShardTensor>&)> forward;
  int64_t sum_length = 1;
  bool broadcast = false;
  bool positive = false;  ///< inputs in [0.5, 1.5] (sqrt, log, pow's base)
  /// An input that only selects (where's condition): the bound's run on |inputs| keeps its
  /// signed values, so that it selects the same elements as the runs it bounds.
  int condition_input = -1;
};

ShardTensor apply_one(const std::string& op, const std::vector<ShardTensor>& in,
                      const OpAttrs& attrs = {}) {
  return apply_op(op, in, attrs)[0];
}

std::vector<OpCase> op_cases() {
  const Shape small{5, 4, 3};
  std::vector<OpCase> cases;
  for (const char* unary : {"relu", "gelu", "silu", "tanh", "exp"}) {
    cases.push_back({unary, {small}, [unary](const auto& in) { return apply_one(unary, in); }});
    // 1000 * 37 elements: vector accesses with a scalar tail in every dtype.
    cases.push_back({std::string(unary) + " long", {{1000, 37}}, [unary](const auto& in) {
                       return apply_one(unary, in);
                     }});
  }
  cases.push_back({"scale", {small}, [](const auto& in) { return scale(in[0], -2.5); }});
  for (const char* unary : {"sigmoid", "erf", "neg", "abs"}) {
    cases.push_back({unary, {small}, [unary](const auto& in) { return apply_one(unary, in); }});
    cases.push_back({std::string(unary) + " long", {{1000, 37}}, [unary](const auto& in) {
                       return apply_one(unary, in);
                     }});
  }
  for (const char* unary : {"sqrt", "log"})
    cases.push_back({unary,
                     {{1000, 37}},
                     [unary](const auto& in) { return apply_one(unary, in); },
                     1,
                     false,
                     true});
  cases.push_back({"softplus", {{1000, 37}}, [](const auto& in) { return softplus(in[0]); }});
  cases.push_back({"softplus beta 3 threshold 0.9", {small}, [](const auto& in) {
                     return softplus(in[0], 3, 0.9);
                   }});
  cases.push_back(
      {"leaky_relu", {{1000, 37}}, [](const auto& in) { return leaky_relu(in[0], 0.2); }});
  cases.push_back(
      {"clamp", {{1000, 37}}, [](const auto& in) { return clamp(in[0], -0.45, 0.55); }});
  cases.push_back(
      {"clamp min", {small}, [](const auto& in) { return clamp(in[0], 0.15, std::nullopt); }});
  for (const char* binary : {"maximum", "minimum"})
    cases.push_back({std::string(binary) + " same shape",
                     {{7, 33}, {7, 33}},
                     [binary](const auto& in) { return apply_one(binary, in); }});
  cases.push_back({"pow same shape",
                   {{7, 33}, {7, 33}},
                   [](const auto& in) { return pow(in[0], in[1]); },
                   1,
                   false,
                   true});
  cases.push_back({"pow broadcast base",
                   {small, {4, 1}},
                   [](const auto& in) { return pow(in[1], in[0]); },
                   15,
                   true,
                   true});
  cases.push_back({"sub broadcast first operand",
                   {small, {4, 1}},
                   [](const auto& in) { return sub(in[1], in[0]); },
                   15,
                   true});
  // where: the condition relu(in[1]) is 0 on about half the elements; in[1] gets gradient 0
  // through the scale by 0, so every input has a gradient to compare.
  cases.push_back(
      {"where b broadcast",
       {small, small, {3}},
       [](const auto& in) { return add(where(relu(in[1]), in[0], in[2]), scale(in[1], 0.0)); },
       20,
       true,
       false,
       1});
  for (const char* binary : {"add", "sub", "mul", "div"}) {
    const std::string name = binary;
    cases.push_back({name + " same shape", {{7, 33}, {7, 33}}, [binary](const auto& in) {
                       return apply_one(binary, in);
                     }});
    cases.push_back({name + " broadcast",
                     {small, {4, 1}},
                     [binary](const auto& in) { return apply_one(binary, in); },
                     15,
                     true});
    cases.push_back({name + " align 1",
                     {small, {4}},
                     [binary](const auto& in) {
                       return apply_one(binary, in, OpAttrs().set("align", int64_t{1}));
                     },
                     15,
                     true});
  }
  cases.push_back({"bias_add",
                   {{2, 3, 4, 5}, {3}},
                   [](const auto& in) { return bias_add(in[0], in[1]); },
                   40,
                   true});
  // linear and matmul through cuBLAS; concat and split through the backend's strided copies.
  cases.push_back({"linear",
                   {{7, 33}, {5, 33}, {5}},
                   [](const auto& in) { return linear(in[0], in[1], in[2]); },
                   34,
                   true});
  cases.push_back({"matmul batched by a matrix",
                   {{3, 7, 33}, {33, 6}},
                   [](const auto& in) { return matmul(in[0], in[1]); },
                   33 * 7,
                   true});
  cases.push_back({"concat dim 1",
                   {small, {5, 2, 3}},
                   [](const auto& in) {
                     return concat({in[0], in[1]}, 1);
                   },
                   1,
                   true});
  cases.push_back({"split dim 2", {small}, [](const auto& in) {
                     return split(in[0], {1, 2}, 2)[1];
                   }});
  cases.push_back({"softmax dim 1", {small}, [](const auto& in) { return softmax(in[0], 1); }, 8});
  cases.push_back({"log_softmax dim -1",
                   {{40, 37}},
                   [](const auto& in) { return log_softmax(in[0], -1); },
                   80});
  // Rows of 1000: each lane of the row's warp takes 31 or 32 elements.
  cases.push_back({"softmax dim -1 of long rows",
                   {{7, 1000}},
                   [](const auto& in) { return softmax(in[0], -1); },
                   2000});
  // dropout: the device draws the cpu's mask (a function of seed and global index).
  cases.push_back({"dropout", {{1000, 37}}, [](const auto& in) { return dropout(in[0], 0.3, 7); }});
  cases.push_back({"sum dims 0,2", {small}, [](const auto& in) { return sum(in[0], {0, 2}); }, 15});
  cases.push_back({"sum all", {small}, [](const auto& in) { return sum(in[0]); }, 60});
  cases.push_back(
      {"mean dim 1 keepdim", {small}, [](const auto& in) { return mean(in[0], {1}, true); }, 4});
  // Long reductions: one block per (output, chunk) and a second pass over the chunk sums.
  cases.push_back(
      {"sum long rows", {{3, 40000}}, [](const auto& in) { return sum(in[0], {1}); }, 40000});
  cases.push_back({"mean long", {{200000}}, [](const auto& in) { return mean(in[0]); }, 200000});
  cases.push_back(
      {"mse_loss", {small, small}, [](const auto& in) { return mse_loss(in[0], in[1]); }, 60});
  cases.push_back({"mse_loss long",
                   {{70001}, {70001}},
                   [](const auto& in) { return mse_loss(in[0], in[1]); },
                   70001});
  return cases;
}

using testing::unit_roundoff;

/// Unit roundoff of the type the kernels compute and accumulate in.
double accumulation_roundoff(DType dtype) {
  return dtype == DType::f64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
}

/// Values of `shape` in [-1, 1] (the second operand of div: |b| in [0.5, 1.5]), rounded to
/// `dtype` and held in f64, so the cpu and the GPU start from the same numbers.
Tensor random_values(const Shape& shape, DType dtype, CaseRng& rng, bool divisor) {
  Tensor values = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < values.numel(); ++i) {
    const double unit = static_cast<double>(rng.uniform(-1000, 1000)) / 1000.0;
    values.data<double>()[i] = divisor ? (unit < 0 ? unit - 0.5 : unit + 0.5) : unit;
  }
  return values.to_dtype(dtype).to_dtype(DType::f64);
}

Tensor absolute(const Tensor& t) {
  Tensor out = t.contiguous().clone();
  for (int64_t i = 0; i < out.numel(); ++i)
    out.data<double>()[i] = std::fabs(out.data<double>()[i]);
  return out;
}

/// Input i of `c` in the run that gives the bounds: |values|, or the values themselves for the
/// condition input (|in| would select other elements: relu(|x|) > 0 almost everywhere).
Tensor magnitude_of(const OpCase& c, size_t i, const Tensor& values) {
  return static_cast<int>(i) == c.condition_input ? values : absolute(values);
}

/// The output and the input gradients of `c` on `mesh` in `dtype` on `device`, from inputs laid
/// out as `layouts` and the output gradient `gy` (full tensors, f64); back on the host in f64.
std::vector<Tensor> run_case(const OpCase& c, const DeviceMesh& mesh,
                             const std::vector<Tensor>& values,
                             const std::vector<ShardSpec>& layouts, const Tensor& gy, DType dtype,
                             Device device) {
  auto placed = [&](const ShardTensor& t) {
    return ShardTensor(t.to_local().to_dtype(dtype).to(device), t.mesh(), t.spec());
  };
  Tape tape;
  std::vector<ShardTensor> inputs;
  for (size_t i = 0; i < values.size(); ++i) {
    inputs.push_back(placed(
        ShardTensor::distribute(values[i], mesh, layouts[i].placements, layouts[i].extents)));
    inputs.back().set_requires_grad();
  }
  ShardTensor y = c.forward(inputs);
  // Partial sums are reduced first, so the output gradient can be laid out like the output.
  if (const ShardSpec target = without_partial(y.spec()); y.spec() != target)
    y = y.redistribute(target.placements, target.extents);
  const ShardTensor gys =
      placed(ShardTensor::distribute(gy, mesh, y.placements(), y.spec().extents));
  tape.backward(y, gys);
  std::vector<Tensor> results{y.full_tensor()};
  for (const ShardTensor& input : inputs) results.push_back(tape.grad(input)->full_tensor());
  for (Tensor& result : results) {
    synchronize(compute_stream_for(result.device()));
    result = result.to(Device::cpu()).to_dtype(DType::f64);
  }
  return results;
}

/// One rank's mesh over a world of one.
struct SingleRank {
  std::shared_ptr<Comm> self;
  DeviceMesh mesh;
};

/// Elements of `got` outside the bound against `reference`: |got - ref| <= (4u + (L + 4) ua) *
/// max(|ref|, m) + 4u * 1e-3 * max|ref|, where u is the storage dtype's unit roundoff (each side
/// rounds its result to the dtype once or twice: the cpu backward rounds f' and f' * g
/// separately), ua the roundoff of the accumulation type (float for f16/bf16/f32; the cpu sums
/// in double), L the longest sum behind an element (recursive summation bound L * ua * sum|terms|)
/// and m the same op on |inputs| and |g| computed exactly (sum|terms| for sums, an upper bound of
/// |result| for the pointwise functions). The last term absorbs the few-ulp differences between
/// the device's and the host's transcendental functions near zero.
int64_t outside_bound(const Tensor& got, const Tensor& reference, const Tensor& magnitude,
                      DType dtype, int64_t sum_length, double slack = 1.0) {
  const double u = unit_roundoff(dtype), ua = accumulation_roundoff(dtype);
  double largest = 0;
  for (int64_t i = 0; i < reference.numel(); ++i)
    largest = std::max(largest, std::fabs(reference.data<double>()[i]));
  const double factor = slack * (4 * u + static_cast<double>(sum_length + 4) * ua);
  int64_t outside = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double ref = reference.data<double>()[i];
    const double scale = std::max(std::fabs(ref), magnitude.data<double>()[i]);
    const double bound = factor * scale + slack * 4 * u * 1e-3 * largest + 1e-300;
    outside += !(std::fabs(got.data<double>()[i] - ref) <= bound);
  }
  return outside;
}

const char* result_name(size_t index) {
  static const char* names[] = {"y", "grad of input 0", "grad of input 1", "grad of input 2"};
  return names[index];
}

/// Random values of input i of case c (see random_values): positive for the cases that ask.
Tensor case_values(const OpCase& c, size_t i, DType dtype, CaseRng& rng) {
  const Tensor values =
      random_values(c.shapes[i], dtype, rng, c.positive || (c.name.rfind("div", 0) == 0 && i == 1));
  return c.positive ? absolute(values) : values;
}

TEST(BasicOpsGpu, EveryOpForwardAndBackwardOnCudaMatchesCpuInEveryDtype) {
  SKIP_WITHOUT_GPU();
  run_local_ranks(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    const auto cases = op_cases();
    for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
      for (size_t index = 0; index < cases.size(); ++index) {
        const OpCase& c = cases[index];
        CaseRng rng(testing::case_seed(61, 1, static_cast<int>(dtype), static_cast<int>(index)));
        std::vector<Tensor> values, magnitudes;
        std::vector<ShardSpec> layouts;
        for (size_t i = 0; i < c.shapes.size(); ++i) {
          values.push_back(case_values(c, i, dtype, rng));
          magnitudes.push_back(magnitude_of(c, i, values.back()));
          layouts.push_back(ShardSpec::make(c.shapes[i], {1}, {Placement::replicate()}));
        }
        std::vector<ShardTensor> probe_inputs;
        for (size_t i = 0; i < values.size(); ++i)
          probe_inputs.push_back(
              ShardTensor::distribute(values[i], mesh, {Placement::replicate()}));
        const Shape y_shape = c.forward(probe_inputs).global_shape();
        const Tensor gy = random_values(y_shape, dtype, rng, false);
        const auto expected = run_case(c, mesh, values, layouts, gy, dtype, Device::cpu());
        const auto bounds =
            run_case(c, mesh, magnitudes, layouts, absolute(gy), DType::f64, Device::cpu());
        const auto got = run_case(c, mesh, values, layouts, gy, dtype, kGpu);
        ASSERT_EQ(got.size(), expected.size());
        for (size_t r = 0; r < got.size(); ++r)
          EXPECT_EQ(outside_bound(got[r], expected[r], absolute(bounds[r]), dtype, c.sum_length), 0)
              << c.name << " " << dtype_name(dtype) << " " << result_name(r)
              << ": max |cuda - cpu| = " << max_abs_diff(got[r], expected[r]);
      }
    }
  });
}

/// Random layout of `shape` on `mesh`: mesh dims shard distinct tensor dims (uneven extents,
/// zeros included) or replicate.
ShardSpec random_layout(const Shape& shape, const DeviceMesh& mesh, CaseRng& rng) {
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
  std::vector<bool> used(shape.size(), false);
  for (int m = 0; m < mesh.ndim(); ++m) {
    const int dim = static_cast<int>(rng.uniform(0, static_cast<int64_t>(shape.size()) - 1));
    if (used[dim] || rng.chance(0.2)) {
      placements.push_back(Placement::replicate());
      extents.emplace_back();
      continue;
    }
    used[dim] = true;
    placements.push_back(Placement::shard(dim));
    extents.push_back(testing::random_extents(shape[dim], mesh.size(m), rng));
  }
  return ShardSpec::make(shape, mesh.shape(), placements, extents);
}

/// Layouts of a case's inputs on `mesh`: the first random, the others like it (same shape) or
/// replicated (broadcast operands).
std::vector<ShardSpec> case_layouts(const OpCase& c, const DeviceMesh& mesh, CaseRng& rng) {
  std::vector<ShardSpec> layouts{random_layout(c.shapes[0], mesh, rng)};
  for (size_t i = 1; i < c.shapes.size(); ++i)
    layouts.push_back(
        c.broadcast ? ShardSpec::make(c.shapes[i], mesh.shape(),
                                      std::vector<Placement>(mesh.ndim(), Placement::replicate()))
                    : ShardSpec::make(c.shapes[i], mesh.shape(), layouts[0].placements,
                                      layouts[0].extents));
  return layouts;
}

TEST(BasicOpsGpu, ShardedOnOneTwoAndFourLocalRanksMatchesOneRank) {
  SKIP_WITHOUT_GPU();
  int compared = 0;
  for (int world : {1, 2, 4}) {
    run_local_ranks(world, [&](std::shared_ptr<Comm> comm) {
      auto self = comm->split(comm->rank(), 0);
      DeviceMesh single(self, {1});
      const auto meshes = testing::mesh_factorizations(comm->size(), 2);
      const auto cases = op_cases();
      // sweep_takes picks a share of the (dtype, mesh, op) combinations, the same on every rank,
      // shifted by one per (dtype, mesh) so that each op is taken on some of them.
      int layout_index = 0;
      for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
        for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index, ++layout_index) {
          DeviceMesh mesh(comm, meshes[mesh_index]);
          for (size_t index = 0; index < cases.size(); ++index) {
            if (!testing::sweep_takes(static_cast<int>(index) + layout_index)) continue;
            const OpCase& c = cases[index];
            CaseRng rng(testing::case_seed(67, comm->size(), static_cast<int>(mesh_index),
                                           static_cast<int>(index) * 4 + static_cast<int>(dtype)));
            std::vector<Tensor> values, magnitudes;
            for (size_t i = 0; i < c.shapes.size(); ++i) {
              values.push_back(case_values(c, i, dtype, rng));
              magnitudes.push_back(magnitude_of(c, i, values.back()));
            }
            const std::vector<ShardSpec> layouts = case_layouts(c, mesh, rng);
            std::vector<ShardSpec> single_layouts;
            for (const Shape& shape : c.shapes)
              single_layouts.push_back(ShardSpec::make(shape, {1}, {Placement::replicate()}));
            std::vector<ShardTensor> probe_inputs;
            for (const Tensor& v : values)
              probe_inputs.push_back(ShardTensor::distribute(v, single, {Placement::replicate()}));
            const Tensor gy =
                random_values(c.forward(probe_inputs).global_shape(), dtype, rng, false);
            const auto bounds = run_case(c, single, magnitudes, single_layouts, absolute(gy),
                                         DType::f64, Device::cpu());
            const auto expected = run_case(c, single, values, single_layouts, gy, dtype, kGpu);
            const auto got = run_case(c, mesh, values, layouts, gy, dtype, kGpu);
            // Both sides carry the rounding of the bound (the sharded side sums in another
            // order: partial sums per rank, then the all-reduce).
            for (size_t r = 0; r < got.size(); ++r)
              EXPECT_EQ(
                  outside_bound(got[r], expected[r], absolute(bounds[r]), dtype, c.sum_length, 2.0),
                  0)
                  << c.name << " " << dtype_name(dtype) << " " << result_name(r) << " world "
                  << world << " mesh " << testing::shape_str(mesh.shape()) << " layout "
                  << layouts[0].str();
            if (comm->rank() == 0) ++compared;
          }
        }
      }
    });
  }
  EXPECT_GT(compared, testing::sweep_cases(100));
}

TEST(BasicOpsGpu, TwoRunsAreBitIdentical) {
  SKIP_WITHOUT_GPU();
  for (int world : {1, 4}) {
    run_local_ranks(world, [&](std::shared_ptr<Comm> comm) {
      DeviceMesh mesh(comm, {comm->size()});
      const auto cases = op_cases();
      for (DType dtype : {DType::f32, DType::f16}) {
        for (size_t index = 0; index < cases.size(); ++index) {
          const OpCase& c = cases[index];
          CaseRng rng(testing::case_seed(71, comm->size(), static_cast<int>(dtype),
                                         static_cast<int>(index)));
          std::vector<Tensor> values;
          for (size_t i = 0; i < c.shapes.size(); ++i)
            values.push_back(case_values(c, i, dtype, rng));
          const std::vector<ShardSpec> layouts = case_layouts(c, mesh, rng);
          std::vector<ShardTensor> probe_inputs;
          for (size_t i = 0; i < values.size(); ++i)
            probe_inputs.push_back(ShardTensor::distribute(values[i], mesh, layouts[i].placements,
                                                           layouts[i].extents));
          const Tensor gy =
              random_values(c.forward(probe_inputs).global_shape(), dtype, rng, false);
          const auto first = run_case(c, mesh, values, layouts, gy, dtype, kGpu);
          const auto second = run_case(c, mesh, values, layouts, gy, dtype, kGpu);
          for (size_t r = 0; r < first.size(); ++r)
            EXPECT_TRUE(bitwise_equal(first[r], second[r]))
                << c.name << " " << dtype_name(dtype) << " " << result_name(r) << " world "
                << world;
        }
      }
    });
  }
}

TEST(BasicOpsGpu, ForwardAndBackwardMoveNothingThroughTheHost) {
  SKIP_WITHOUT_GPU();
  run_local_ranks(1, [&](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    const auto cases = op_cases();
    for (size_t index = 0; index < cases.size(); ++index) {
      const OpCase& c = cases[index];
      CaseRng rng(testing::case_seed(73, 1, 0, static_cast<int>(index)));
      std::vector<ShardTensor> inputs;
      for (size_t i = 0; i < c.shapes.size(); ++i) {
        const Tensor values = case_values(c, i, DType::f32, rng);
        inputs.push_back(ShardTensor::distribute(values.to_dtype(DType::f32).to(kGpu), mesh,
                                                 {Placement::replicate()}));
        inputs.back().set_requires_grad();
      }
      std::vector<ShardTensor> probe_inputs;
      for (const ShardTensor& input : inputs)
        probe_inputs.push_back(ShardTensor(input.to_local(), input.mesh(), input.spec()));
      const Shape y_shape = c.forward(probe_inputs).global_shape();
      const ShardTensor gy = ShardTensor::distribute(
          random_values(y_shape, DType::f32, rng, false).to_dtype(DType::f32).to(kGpu), mesh,
          {Placement::replicate()});
      synchronize(compute_stream_for(kGpu));
      const TransferStats before = transfer_stats();
      Tape tape;
      const ShardTensor y = c.forward(inputs);
      tape.backward(y, gy);
      for (const ShardTensor& input : inputs) EXPECT_TRUE(tape.grad(input).has_value());
      const TransferStats after = transfer_stats();
      EXPECT_EQ(after.device_to_host_bytes, before.device_to_host_bytes) << c.name;
      EXPECT_EQ(after.host_to_device_bytes, before.host_to_device_bytes) << c.name;
    }
  });
}

}  // namespace
}  // namespace tessera::ops
