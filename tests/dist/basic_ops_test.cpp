// The pointwise and reduction ops (relu, gelu, silu, tanh, exp, scale, sigmoid, softplus,
// leaky_relu, erf, sqrt, neg, abs, log, clamp; add/sub/mul/div/pow/maximum/minimum with
// same-shape operands and either operand broadcast; bias_add; where; sum/mean over any dims;
// mse_loss; softmax and log_softmax over every dim; linear and matmul; dropout; concat and
// split along every dim): sharded
// forward and gradients equal the unsharded ones on uneven and empty shards, and the
// gradients equal central finite differences (so the derivative formulas themselves are
// checked); an op registered without a rule runs through the replicated fallback.
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/autograd.hpp"
#include "core/compute_threads.hpp"
#include "core/streaming_stores.hpp"
#include "core/trace.hpp"
#include "ops/ops.hpp"
#include "tests/dist/harness.hpp"
#include "tests/dist/shard_cases.hpp"

namespace tessera {
namespace {

using testing::CaseRng;

/// A function of the test's inputs that ends in a scalar.
using Program = std::function<ShardTensor(const std::vector<ShardTensor>&)>;

struct NamedProgram {
  std::string name;
  std::vector<Shape> shapes;  // input shapes; inputs after the first are replicated operands
  Program program;
  bool first_only_sharded = true;
  std::vector<size_t> constants = {};  // inputs without a gradient (where's condition)
};

Tensor smooth_values(const Shape& shape, CaseRng& rng) {
  // Values away from relu's kink and positive enough for div.
  Tensor values = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < values.numel(); ++i) {
    const double magnitude = 0.3 + 0.1 * static_cast<double>(rng.uniform(0, 10));
    values.data<double>()[i] = rng.chance(0.5) ? magnitude : -magnitude;
  }
  return values;
}

std::vector<NamedProgram> programs() {
  const Shape a{5, 4, 3};
  auto reduce_sum = [](const ShardTensor& t) { return ops::sum(t); };
  std::vector<NamedProgram> list;
  for (const char* unary : {"relu", "gelu", "silu", "tanh", "exp"})
    list.push_back({unary, {a}, [unary, reduce_sum](const std::vector<ShardTensor>& in) {
                      return reduce_sum(ops::mul(apply_op(unary, {in[0]})[0], in[0]));
                    }});
  list.push_back({"scale", {a}, [](const std::vector<ShardTensor>& in) {
                    return ops::sum(ops::mul(ops::scale(in[0], -2.5), in[0]));
                  }});
  // Unary ops with attributes, and those defined on part of the line (sqrt and log of exp(x)).
  // Kinks (clamp's bounds, softplus's threshold) sit between the test's values.
  using Unary = std::function<ShardTensor(const ShardTensor&)>;
  const std::vector<std::pair<std::string, Unary>> unary_calls = {
      {"sigmoid", [](const ShardTensor& x) { return ops::sigmoid(x); }},
      {"softplus", [](const ShardTensor& x) { return ops::softplus(x); }},
      {"softplus beta 2 threshold 1.1",
       [](const ShardTensor& x) { return ops::softplus(x, 2, 1.1); }},
      {"leaky_relu 0.2", [](const ShardTensor& x) { return ops::leaky_relu(x, 0.2); }},
      {"erf", [](const ShardTensor& x) { return ops::erf(x); }},
      {"sqrt of exp", [](const ShardTensor& x) { return ops::sqrt(ops::exp(x)); }},
      {"neg", [](const ShardTensor& x) { return ops::neg(x); }},
      {"abs", [](const ShardTensor& x) { return ops::abs(x); }},
      {"log of sigmoid", [](const ShardTensor& x) { return ops::log(ops::sigmoid(x)); }},
      {"clamp -0.55..0.75", [](const ShardTensor& x) { return ops::clamp(x, -0.55, 0.75); }},
      {"clamp min 0.45", [](const ShardTensor& x) { return ops::clamp(x, 0.45, std::nullopt); }},
      {"clamp max -0.35", [](const ShardTensor& x) { return ops::clamp(x, std::nullopt, -0.35); }},
  };
  for (const auto& [name, call] : unary_calls)
    list.push_back({name, {a}, [call](const std::vector<ShardTensor>& in) {
                      return ops::sum(ops::mul(call(in[0]), in[0]));
                    }});
  // pow of a positive base; the broadcast operand first (sub, div, pow: the result is led by b).
  list.push_back({"pow same shape",
                  {a, a},
                  [](const std::vector<ShardTensor>& in) {
                    return ops::sum(ops::mul(ops::pow(ops::exp(in[0]), in[1]), in[0]));
                  },
                  false});
  list.push_back({"pow broadcast exponent", {a, {3}}, [](const std::vector<ShardTensor>& in) {
                    return ops::sum(ops::mul(ops::pow(ops::exp(in[0]), in[1]), in[0]));
                  }});
  list.push_back({"pow broadcast base", {a, {4, 1}}, [](const std::vector<ShardTensor>& in) {
                    return ops::sum(ops::mul(ops::pow(ops::exp(in[1]), in[0]), in[0]));
                  }});
  for (const char* binary : {"sub", "div"})
    list.push_back({std::string(binary) + " broadcast first operand",
                    {a, {5, 1, 3}},
                    [binary](const std::vector<ShardTensor>& in) {
                      return ops::sum(ops::mul(apply_op(binary, {in[1], in[0]})[0], in[0]));
                    }});
  for (const char* binary : {"maximum", "minimum"}) {
    list.push_back({std::string(binary) + " same shape (ties split the gradient)",
                    {a, a},
                    [binary](const std::vector<ShardTensor>& in) {
                      return ops::sum(ops::mul(apply_op(binary, {in[0], in[1]})[0], in[0]));
                    },
                    false});
    list.push_back({std::string(binary) + " broadcast",
                    {a, {1, 3}},
                    [binary](const std::vector<ShardTensor>& in) {
                      return ops::sum(ops::mul(apply_op(binary, {in[1], in[0]})[0], in[0]));
                    }});
  }
  // where(cond, a, b): cond broadcast, b broadcast; then cond leading a broadcast a and b.
  list.push_back({"where cond and b broadcast",
                  {a, {4, 1}, {3}},
                  [](const std::vector<ShardTensor>& in) {
                    return ops::sum(ops::mul(ops::where(ops::relu(in[1]), in[0], in[2]), in[0]));
                  },
                  true,
                  {1}});
  list.push_back(
      {"where led by cond", {a, {4, 3}, {5, 1, 1}}, [](const std::vector<ShardTensor>& in) {
         return ops::sum(ops::mul(ops::where(ops::relu(in[0]), in[1], in[2]), in[0]));
       }});
  // linear and matmul: x sharded on any dim (a sharded contracted dim is gathered first).
  list.push_back({"linear with bias", {a, {2, 3}, {2}}, [](const std::vector<ShardTensor>& in) {
                    const ShardTensor y = ops::linear(in[0], in[1], in[2]);
                    return ops::sum(ops::mul(y, y));
                  }});
  list.push_back(
      {"linear without bias", {{5, 4, 2, 3}, {4, 3}}, [](const std::vector<ShardTensor>& in) {
         const ShardTensor y = ops::linear(in[0], in[1]);
         return ops::sum(ops::mul(y, y));
       }});
  list.push_back({"matmul by a matrix", {a, {3, 2}}, [](const std::vector<ShardTensor>& in) {
                    const ShardTensor y = ops::matmul(in[0], in[1]);
                    return ops::sum(ops::mul(y, y));
                  }});
  list.push_back({"matmul batched", {a, {5, 3, 2}}, [](const std::vector<ShardTensor>& in) {
                    const ShardTensor y = ops::matmul(in[0], in[1]);
                    return ops::sum(ops::mul(y, y));
                  }});
  // dropout: the mask is a function of the seed and the global index, the same on every layout.
  list.push_back({"dropout p 0.3", {a}, [](const std::vector<ShardTensor>& in) {
                    return ops::sum(ops::mul(ops::dropout(in[0], 0.3, 7), in[0]));
                  }});
  // concat along every dim (the second input replicated, moved to the first's layout) and split
  // (explicit sizes, torch.split's chunks), the cut dim sharded or not.
  for (int dim : {0, 1, 2}) {
    Shape other = a;
    other[dim] = 2;
    list.push_back({fmt::format("concat dim {}", dim),
                    {a, other, a},
                    [dim](const std::vector<ShardTensor>& in) {
                      const ShardTensor y = ops::concat({in[0], in[1], in[2]}, dim);
                      return ops::sum(ops::mul(y, y));
                    }});
  }
  list.push_back({"split dim 0 sizes 2,0,3", {a}, [](const std::vector<ShardTensor>& in) {
                    const auto parts = ops::split(in[0], {2, 0, 3}, 0);
                    return ops::add(ops::sum(ops::mul(parts[0], parts[0])),
                                    ops::sum(ops::scale(ops::mul(parts[2], parts[2]), 3)));
                  }});
  list.push_back({"split dim 2 chunks of 2", {a}, [](const std::vector<ShardTensor>& in) {
                    const auto parts = ops::split(in[0], {2}, -1);
                    return ops::sum(ops::mul(parts[1], ops::sum(parts[0], {2}, true)));
                  }});
  // softmax and log_softmax over every dim (the random layouts shard it, or not).
  for (int64_t dim : {0, 1, 2, -1})
    for (bool log : {false, true})
      list.push_back({fmt::format("{} dim {}", log ? "log_softmax" : "softmax", dim),
                      {a},
                      [dim, log](const std::vector<ShardTensor>& in) {
                        const ShardTensor y =
                            log ? ops::log_softmax(in[0], dim) : ops::softmax(in[0], dim);
                        return ops::sum(ops::mul(ops::mul(y, in[0]), in[0]));
                      }});
  for (const char* binary : {"add", "sub", "mul", "div"}) {
    list.push_back({std::string(binary) + " same shape",
                    {a, a},
                    [binary](const std::vector<ShardTensor>& in) {
                      return ops::sum(ops::mul(apply_op(binary, {in[0], in[1]})[0], in[0]));
                    },
                    false});
    list.push_back({std::string(binary) + " broadcast",
                    {a, {4, 1}},
                    [binary](const std::vector<ShardTensor>& in) {
                      return ops::sum(ops::mul(apply_op(binary, {in[0], in[1]})[0], in[0]));
                    }});
  }
  list.push_back({"bias_add", {{2, 3, 4, 5}, {3}}, [](const std::vector<ShardTensor>& in) {
                    return ops::sum(ops::mul(ops::bias_add(in[0], in[1]), in[0]));
                  }});
  list.push_back({"sum dims 0,2 then mean", {a}, [](const std::vector<ShardTensor>& in) {
                    const ShardTensor s = ops::sum(in[0], {0, 2});
                    return ops::mean(ops::mul(s, s));
                  }});
  list.push_back({"mean dim 1 keepdim", {a}, [](const std::vector<ShardTensor>& in) {
                    const ShardTensor m = ops::mean(in[0], {1}, true);
                    return ops::sum(ops::mul(m, m));
                  }});
  list.push_back({"mse_loss",
                  {a, a},
                  [](const std::vector<ShardTensor>& in) { return ops::mse_loss(in[0], in[1]); },
                  false});
  return list;
}

/// Runs `program` on `mesh` with the inputs laid out as given; returns the loss and the
/// gradients (full tensors).
std::pair<double, std::vector<std::optional<Tensor>>> run(const NamedProgram& p,
                                                          const DeviceMesh& mesh,
                                                          const std::vector<Tensor>& values,
                                                          const std::vector<ShardSpec>& layouts) {
  Tape tape;
  std::vector<ShardTensor> inputs;
  for (size_t i = 0; i < values.size(); ++i) {
    inputs.push_back(
        ShardTensor::distribute(values[i], mesh, layouts[i].placements, layouts[i].extents));
    inputs.back().set_requires_grad();
  }
  const ShardTensor loss = p.program(inputs);
  const double value = loss.full_tensor().item_as_double({});
  tape.backward(loss);
  std::vector<std::optional<Tensor>> grads;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const ShardTensor& input = inputs[i];
    if (std::find(p.constants.begin(), p.constants.end(), i) != p.constants.end()) {
      EXPECT_FALSE(tape.grad(input)) << p.name << ": input " << i << " has no gradient";
      grads.emplace_back();
      continue;
    }
    EXPECT_EQ(tape.grad(input)->spec(), input.spec())
        << p.name << ": gradient in the input's layout";
    grads.push_back(tape.grad(input)->full_tensor());
  }
  return {value, grads};
}

/// Random layout of `shape` on `mesh`: mesh dims shard distinct tensor dims or replicate.
ShardSpec random_layout(const Shape& shape, const DeviceMesh& mesh, CaseRng& rng, bool shard) {
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
  std::vector<bool> used(shape.size(), false);
  for (int m = 0; m < mesh.ndim(); ++m) {
    const int dim = static_cast<int>(rng.uniform(0, static_cast<int64_t>(shape.size()) - 1));
    if (!shard || used[dim] || rng.chance(0.2)) {
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

TEST(BasicOps, ShardedForwardAndGradientsMatchUnshardedAndFiniteDifferences) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    if (comm->size() > 4) return;  // a few worlds are enough for these small programs
    auto self = comm->split(comm->rank(), 0);
    DeviceMesh single(self, {1});
    const auto meshes = testing::mesh_factorizations(comm->size(), 2);
    const auto list = programs();
    for (size_t p = 0; p < list.size(); ++p) {
      const NamedProgram& program = list[p];
      for (size_t mesh_index = 0; mesh_index < meshes.size(); ++mesh_index) {
        DeviceMesh mesh(comm, meshes[mesh_index]);
        CaseRng rng(testing::case_seed(51, comm->size(), static_cast<int>(mesh_index),
                                       static_cast<int>(p)));
        std::vector<Tensor> values;
        for (const Shape& shape : program.shapes) values.push_back(smooth_values(shape, rng));
        std::vector<ShardSpec> layouts, single_layouts;
        const ShardSpec first = random_layout(program.shapes[0], mesh, rng, true);
        for (size_t i = 0; i < values.size(); ++i) {
          layouts.push_back(i == 0 || !program.first_only_sharded
                                ? (i == 0 ? first
                                          : ShardSpec::make(program.shapes[i], mesh.shape(),
                                                            first.placements, first.extents))
                                : random_layout(program.shapes[i], mesh, rng, false));
          single_layouts.push_back(
              ShardSpec::make(program.shapes[i], {1}, {Placement::replicate()}));
        }
        const auto [loss, grads] = run(program, mesh, values, layouts);
        const auto [ref_loss, ref_grads] = run(program, single, values, single_layouts);
        EXPECT_NEAR(loss, ref_loss, 1e-12 * (1 + std::fabs(ref_loss))) << program.name;
        for (size_t i = 0; i < grads.size(); ++i) {
          if (grads[i]) {
            EXPECT_LT(max_abs_diff(*grads[i], *ref_grads[i]), 1e-12)
                << program.name << " input " << i;
          }
        }
        if (mesh_index != 0) continue;
        // Central finite differences of the unsharded loss, a few entries per input.
        for (size_t i = 0; i < values.size(); ++i) {
          if (!ref_grads[i]) continue;
          for (int probe = 0; probe < 3; ++probe) {
            const int64_t index = rng.uniform(0, values[i].numel() - 1);
            std::vector<Tensor> plus = values, minus = values;
            plus[i] = values[i].clone();
            minus[i] = values[i].clone();
            const double h = 1e-6;
            plus[i].data<double>()[index] += h;
            minus[i].data<double>()[index] -= h;
            const double numeric = (run(program, single, plus, single_layouts).first -
                                    run(program, single, minus, single_layouts).first) /
                                   (2 * h);
            const double analytic =
                ref_grads[i]->to_dtype(DType::f64).contiguous().data<double>()[index];
            EXPECT_NEAR(analytic, numeric, 1e-5 * (1 + std::fabs(numeric)))
                << program.name << " input " << i;
          }
        }
      }
    }
  });
}

// f32 takes another kernel (oneDNN's sgemm when built with it): forward and gradients within
// f32 rounding of the f64 results, on 1 rank of 3 threads (a by a matrix: one product of all of
// a's rows; a batched b: the products shared by the threads) and sharded on 2 ranks of 1.
TEST(BasicOps, LinearAndMatmulInF32MatchF64) {
  for (int ranks : {1, 2})
    testing::run_world(ranks, [ranks](std::shared_ptr<Comm> comm) {
      const int threads_before = compute_threads();
      set_compute_threads(ranks == 1 ? 3 : 1);
      DeviceMesh mesh(comm, {ranks});
      CaseRng rng(testing::case_seed(57, 2, 0, 0));
      const std::vector<Shape> shapes = {{6, 33, 17}, {19, 17}, {19}, {6, 17, 9}, {17, 5}};
      std::vector<Tensor> values;
      for (const Shape& shape : shapes) values.push_back(smooth_values(shape, rng));
      auto run_in = [&](DType dtype) {
        Tape tape;
        std::vector<ShardTensor> in;
        for (size_t i = 0; i < values.size(); ++i) {
          const bool sharded = i == 0 && ranks == 2;
          in.push_back(ShardTensor::distribute(
              values[i].to_dtype(dtype), mesh,
              {sharded ? Placement::shard(1) : Placement::replicate()},
              {sharded ? std::vector<int64_t>{20, 13} : std::vector<int64_t>{}}));
          in.back().set_requires_grad();
        }
        const ShardTensor y = ops::linear(in[0], in[1], in[2]);
        const ShardTensor z = ops::matmul(in[0], in[3]);
        const ShardTensor u = ops::matmul(in[0], in[4]);
        tape.backward(ops::add(ops::add(ops::sum(ops::mul(y, y)), ops::sum(ops::mul(z, z))),
                               ops::sum(ops::mul(u, u))));
        std::vector<Tensor> results{y.full_tensor().to_dtype(DType::f64),
                                    z.full_tensor().to_dtype(DType::f64),
                                    u.full_tensor().to_dtype(DType::f64)};
        for (const ShardTensor& input : in)
          results.push_back(tape.grad(input)->full_tensor().to_dtype(DType::f64));
        return results;
      };
      const auto f64 = run_in(DType::f64);
      const auto f32 = run_in(DType::f32);
      set_compute_threads(threads_before);
      for (size_t r = 0; r < f64.size(); ++r) {
        double largest = 0;
        for (int64_t i = 0; i < f64[r].numel(); ++i)
          largest = std::max(largest, std::fabs(f64[r].data<double>()[i]));
        EXPECT_LT(max_abs_diff(f32[r], f64[r]), 1e-5 * (1 + largest))
            << "result " << r << " on " << ranks << " rank(s)";
      }
    });
}

// dropout's mask: the same bits on every layout, the kept fraction near 1 - p, another seed
// another mask, the identity when p = 0 or not training, zeros when p = 1.
TEST(BasicOps, DropoutMaskIsAFunctionOfSeedAndGlobalIndex) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2, 2});
    DeviceMesh single(comm->split(comm->rank(), 0), {1, 1});
    const Shape shape{4, 250, 200};
    Tensor ones = Tensor::empty(shape, DType::f64);
    for (int64_t i = 0; i < ones.numel(); ++i) ones.data<double>()[i] = 1.0;
    const std::vector<Placement> replicated{Placement::replicate(), Placement::replicate()};
    const ShardTensor whole = ShardTensor::distribute(ones, single, replicated);
    const ShardTensor sharded = ShardTensor::distribute(
        ones, mesh, {Placement::shard(1), Placement::shard(2)}, {{170, 80}, {3, 197}});
    const double p = 0.3;
    const Tensor reference = ops::dropout(whole, p, 11).full_tensor();
    EXPECT_EQ(max_abs_diff(ops::dropout(sharded, p, 11).full_tensor(), reference), 0.0);
    int64_t kept = 0;
    for (int64_t i = 0; i < reference.numel(); ++i) {
      const double v = reference.data<double>()[i];
      EXPECT_TRUE(v == 0.0 || v == 1 / (1 - p)) << v;
      kept += v != 0.0;
    }
    const double n = static_cast<double>(reference.numel());
    EXPECT_NEAR(static_cast<double>(kept), (1 - p) * n, 5 * std::sqrt(n * p * (1 - p)));
    EXPECT_GT(max_abs_diff(ops::dropout(whole, p, 12).full_tensor(), reference), 0.0)
        << "another seed, another mask";
    EXPECT_EQ(max_abs_diff(ops::dropout(sharded, 0.0, 11).full_tensor(), ones), 0.0);
    EXPECT_EQ(max_abs_diff(ops::dropout(sharded, 0.9, 11, false).full_tensor(), ones), 0.0);
    EXPECT_EQ(max_abs_diff(ops::dropout(sharded, 1.0, 11).full_tensor(),
                           Tensor::zeros(shape, DType::f64)),
              0.0);
    EXPECT_THROW(ops::dropout(sharded, 1.5, 11), InvalidArgument);
  });
}

TEST(BasicOps, MeanIsExactOnUnevenAndEmptyShards) {
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {4});
    Tensor values = Tensor::empty({7}, DType::f64);
    for (int i = 0; i < 7; ++i) values.data<double>()[i] = i + 1;  // mean 4
    const ShardTensor x =
        ShardTensor::distribute(values, mesh, {Placement::shard(0)}, {{5, 0, 2, 0}});
    const ShardTensor m = ops::mean(x);
    EXPECT_TRUE(m.placements()[0].is_partial()) << "a reduced sharded dim gives Partial";
    EXPECT_EQ(m.full_tensor().item_as_double({}), 4.0);
  });
}

// An f32 sum over a dim followed by others (blocks of 32 rows in float lanes, the blocks' sums in
// f64) is within float roundoff of the exact sum of the same f32 values: |error| at most
// 33 * 2^-24 * (sum of |x|) per output, for 16 rows (one block), 20 and 70 rows (one and three
// blocks) and column counts that take tiles of 128 and of 32 columns and a partial tile (165;
// 1300: a unit of 1024 columns and a second one); mean likewise. So is a sum over the last dim
// (each lane of the contiguous sum adds blocks of 32 values in float, the blocks' sums in f64):
// 1000 values per row (one block of 512 and a rest), and 70001 (two pieces, many blocks, a rest).
TEST(BasicOps, F32SumOverALeadingDimIsWithinFloatRoundoffOfTheExactSum) {
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    for (const Shape& shape : {Shape{2, 16, 5, 33}, Shape{3, 70, 165}, Shape{2, 20, 1300},
                               Shape{4, 1000}, Shape{2, 70001}}) {
      CaseRng rng(testing::case_seed(93, shape[1], 0, 0));
      const Tensor values = smooth_values(shape, rng).to_dtype(DType::f32).to_dtype(DType::f64);
      const ShardTensor x =
          ShardTensor::distribute(values.to_dtype(DType::f32), mesh, {Placement::replicate()});
      const Tensor sum = ops::sum(x, {1}).full_tensor().to_dtype(DType::f64);
      const Tensor mean = ops::mean(x, {1}).full_tensor().to_dtype(DType::f64);
      const int64_t outer = shape[0], rows = shape[1], inner = values.numel() / (outer * rows);
      int64_t beyond = 0;
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t i = 0; i < inner; ++i) {
          double exact = 0, magnitude = 0;
          for (int64_t r = 0; r < rows; ++r) {
            const double value = values.data<double>()[(o * rows + r) * inner + i];
            exact += value;
            magnitude += std::fabs(value);
          }
          const double bound = 33 * std::ldexp(magnitude, -24);
          beyond += std::fabs(sum.data<double>()[o * inner + i] - exact) > bound;
          beyond += std::fabs(mean.data<double>()[o * inner + i] - exact / rows) > bound / rows;
        }
      EXPECT_EQ(beyond, 0) << "x " << fmt::format("{}", shape);
    }
  });
}

// softmax and log_softmax in f32 and f64 along a contiguous last dim (rows: 16 lanes, pieces of
// 1024) and along a leading one (columns), the dim sharded unevenly over 3 ranks, another dim
// sharded, or none: forward and gradient within the dtype's rounding of the formulas evaluated
// in f64 on the same values; a NaN in a row makes that row NaN and leaves the others as they are.
TEST(BasicOps, SoftmaxRowsAndColumnsMatchTheFormulasInF32AndF64OnAnyLayout) {
  for (int ranks : {1, 3})
    testing::run_world(ranks, [ranks](std::shared_ptr<Comm> comm) {
      DeviceMesh mesh(comm, {ranks});
      int case_index = 0;
      for (const Shape& shape : {Shape{4, 37}, Shape{3, 1100}, Shape{2, 5, 40}, Shape{40, 3, 70}})
        for (int dim : {0, static_cast<int>(shape.size()) - 1})
          for (int layout = 0; layout < 3; ++layout)
            for (DType dtype : {DType::f32, DType::f64})
              for (bool log : {false, true}) {
                const std::string name = fmt::format("{} {} dim {} of {} layout {} on {} ranks",
                                                     log ? "log_softmax" : "softmax",
                                                     dtype_name(dtype), dim, shape, layout, ranks);
                CaseRng rng(testing::case_seed(97, ranks, case_index++, 0));
                // Values and gradients rounded to the dtype, the reference computed from them.
                Tensor x = smooth_values(shape, rng);
                Tensor g = smooth_values(shape, rng);
                for (int64_t i = 0; i < x.numel(); ++i)
                  x.data<double>()[i] *=
                      15 * (1 + (i % 7));  // exp(x - y) overflows for y < max - 88
                x = x.to_dtype(dtype).to_dtype(DType::f64);
                g = g.to_dtype(dtype).to_dtype(DType::f64);
                const bool with_nan = layout == 0 && shape[dim] > 2;
                const int64_t nan_at =
                    with_nan ? shape[dim] / 2 * x.numel() / shape[0] / (dim == 0 ? 1 : shape[dim])
                             : -1;
                if (with_nan) x.data<double>()[nan_at] = std::nan("");
                std::vector<Placement> placements{Placement::replicate()};
                std::vector<std::vector<int64_t>> extents{{}};
                if (layout < 2) {
                  const int sharded = layout == 0 ? dim : (dim == 0 ? 1 : 0);
                  placements[0] = Placement::shard(sharded);
                  extents[0] = testing::random_extents(shape[sharded], ranks, rng);
                }
                Tape tape;
                ShardTensor input =
                    ShardTensor::distribute(x.to_dtype(dtype), mesh, placements, extents);
                input.set_requires_grad();
                const ShardTensor gy =
                    ShardTensor::distribute(g.to_dtype(dtype), mesh, placements, extents);
                const ShardTensor y = log ? ops::log_softmax(input, dim) : ops::softmax(input, dim);
                tape.backward(ops::sum(ops::mul(y, gy)));
                const Tensor got = y.full_tensor().to_dtype(DType::f64);
                const Tensor got_dx = tape.grad(input)->full_tensor().to_dtype(DType::f64);
                // The reference per slot: [outer, length, inner] around dim.
                const int64_t length = shape[dim];
                int64_t outer = 1, inner = 1;
                for (int d = 0; d < dim; ++d) outer *= shape[d];
                for (size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
                const double unit =
                    dtype == DType::f32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -53);
                const double tiny = dtype == DType::f32
                                        ? std::ldexp(1.0, -148)
                                        : std::ldexp(1.0, -1073);  // subnormals' spacing
                int64_t wrong = 0, nan_rows = 0;
                for (int64_t o = 0; o < outer; ++o)
                  for (int64_t i = 0; i < inner; ++i) {
                    auto at = [&](int64_t l) { return (o * length + l) * inner + i; };
                    double peak = -INFINITY, total = 0, gsum = 0, gysum = 0, gmag = 0;
                    bool has_nan = false;
                    for (int64_t l = 0; l < length; ++l) {
                      has_nan |= std::isnan(x.data<double>()[at(l)]);
                      peak = std::max(peak, x.data<double>()[at(l)]);
                    }
                    if (has_nan) {
                      ++nan_rows;
                      for (int64_t l = 0; l < length; ++l)
                        wrong += !std::isnan(got.data<double>()[at(l)]);
                      continue;
                    }
                    for (int64_t l = 0; l < length; ++l)
                      total += std::exp(x.data<double>()[at(l)] - peak);
                    for (int64_t l = 0; l < length; ++l) {
                      const double shifted = x.data<double>()[at(l)] - peak;
                      const double yl = log ? shifted - std::log(total) : std::exp(shifted) / total;
                      gsum += g.data<double>()[at(l)];
                      gysum += g.data<double>()[at(l)] * (log ? std::exp(yl) : yl);
                      gmag += std::fabs(g.data<double>()[at(l)]);
                    }
                    for (int64_t l = 0; l < length; ++l) {
                      const double shifted = x.data<double>()[at(l)] - peak;
                      const double gl = g.data<double>()[at(l)];
                      const double yl = log ? shifted - std::log(total) : std::exp(shifted) / total;
                      const double dx = log ? gl - std::exp(yl) * gsum : yl * (gl - gysum);
                      // A few roundings of each term in the dtype (x - max is rounded, so
                      // exp(x - max) carries a relative error of |x - max| roundings), and the
                      // f64 sums' of `length` terms.
                      const double sums = 4 * static_cast<double>(length) * std::ldexp(1.0, -53);
                      const double reach = 1 + std::fabs(shifted) + std::log(total);
                      const double y_bound =
                          log ? 16 * unit * reach + sums
                              : std::fabs(yl) * (16 * unit * (1 + std::fabs(shifted)) + sums) +
                                    tiny;
                      const double dx_bound =
                          (std::fabs(gl) + gmag + 1) * (16 * unit * reach + sums);
                      wrong += !(std::fabs(got.data<double>()[at(l)] - yl) <= y_bound);
                      wrong += !(std::fabs(got_dx.data<double>()[at(l)] - dx) <= dx_bound);
                    }
                  }
                EXPECT_EQ(wrong, 0) << name;
                EXPECT_EQ(nan_rows, with_nan ? 1 : 0) << name;
              }
    });
}

// Streaming stores (ops/cpu_stream.hpp) change where an output's bytes go, not what they are:
// with every op's output streamed (threshold 0) the pointwise ops' forwards and gradients are the
// same bits as with none streamed, in f32 and f64, on 1 and 3 threads, for element counts that
// leave partial blocks, rows with a broadcast (stride 0) or strided operand, where, and the
// contiguous runs of a strided copy (concat). And stream_bytes copies any length between any
// alignments exactly.
TEST(BasicOps, StreamedOutputsAreTheSameBitsAsStoredOnes) {
  for (size_t dst_offset = 0; dst_offset < 64; dst_offset += 7)
    for (size_t src_offset = 0; src_offset < 64; src_offset += 13)
      for (size_t bytes :
           {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{200}, size_t{4099}}) {
        std::vector<unsigned char> from(bytes + 128), to(bytes + 128, 0), expected(bytes + 128, 0);
        for (size_t i = 0; i < from.size(); ++i) from[i] = static_cast<unsigned char>(i * 37 + 11);
        stream_bytes(to.data() + dst_offset, from.data() + src_offset, bytes);
        stream_fence();
        std::memcpy(expected.data() + dst_offset, from.data() + src_offset, bytes);
        EXPECT_EQ(to, expected) << bytes << " bytes from +" << src_offset << " to +" << dst_offset;
      }
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    const int threads_before = compute_threads();
    using Program = std::function<std::vector<ShardTensor>(const std::vector<ShardTensor>&)>;
    const std::vector<std::pair<std::string, Program>> programs = {
        {"relu", [](const auto& in) { return std::vector{ops::relu(in[0])}; }},
        {"exp", [](const auto& in) { return std::vector{ops::exp(in[0])}; }},
        {"add", [](const auto& in) { return std::vector{ops::add(in[0], in[1])}; }},
        {"mul", [](const auto& in) { return std::vector{ops::mul(in[0], in[1])}; }},
        {"div", [](const auto& in) { return std::vector{ops::div(in[0], in[1])}; }},
        {"maximum", [](const auto& in) { return std::vector{ops::maximum(in[0], in[1])}; }},
        {"add of a row broadcast",
         [](const auto& in) { return std::vector{ops::add(in[0], in[2])}; }},
        {"mul by a column broadcast",
         [](const auto& in) { return std::vector{ops::mul(in[3], in[0])}; }},
        {"bias_add", [](const auto& in) { return std::vector{ops::bias_add(in[0], in[4])}; }},
        {"where", [](const auto& in) { return std::vector{ops::where(in[1], in[0], in[1])}; }},
        // copy_strided_host's rows of contiguous runs (concat's forward).
        {"concat along the last dim",
         [](const auto& in) {
           return std::vector{ops::concat({in[0], in[1]}, 2)};
         }},
    };
    for (const Shape& shape : {Shape{1, 3, 7}, Shape{2, 3, 1031}, Shape{3, 5, 4099}})
      for (DType dtype : {DType::f32, DType::f64})
        for (int threads : {1, 3})
          for (const auto& [name, program] : programs) {
            set_compute_threads(threads);
            CaseRng rng(testing::case_seed(99, static_cast<int>(shape[2]), threads, 0));
            const std::vector<Shape> shapes = {
                shape, shape, {shape[2]}, {shape[0], shape[1], 1}, {shape[1]}};
            std::vector<Tensor> values;
            for (const Shape& s : shapes) values.push_back(smooth_values(s, rng).to_dtype(dtype));
            auto run_with = [&](int64_t threshold) {
              set_streaming_store_threshold(threshold);
              Tape tape;
              std::vector<ShardTensor> in;
              for (size_t i = 0; i < values.size(); ++i) {
                in.push_back(ShardTensor::distribute(values[i], mesh, {Placement::replicate()}));
                in.back().set_requires_grad();
              }
              const ShardTensor y = program(in)[0];
              tape.backward(ops::sum(ops::mul(y, y)));
              std::vector<Tensor> results{y.full_tensor()};
              for (const ShardTensor& t : in)
                if (tape.grad(t)) results.push_back(tape.grad(t)->full_tensor());
              set_streaming_store_threshold(std::nullopt);
              return results;
            };
            const auto streamed = run_with(0);
            const auto stored = run_with(std::numeric_limits<int64_t>::max());
            ASSERT_EQ(streamed.size(), stored.size()) << name;
            for (size_t r = 0; r < stored.size(); ++r) {
              const Tensor a = streamed[r].contiguous(), b = stored[r].contiguous();
              ASSERT_EQ(a.numel(), b.numel());
              EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()), 0)
                  << name << " result " << r << " " << dtype_name(dtype) << " "
                  << fmt::format("{}", shape) << " on " << threads << " threads";
            }
          }
    set_compute_threads(threads_before);
  });
}

// split's parts are views of x's storage (no copy), strided ones included, as torch.split's are;
// every consumer of a strided part (an op with a halo, a pointwise op, redistribute, gather, a
// user op without a rule, backward) gives exactly what it gives for a contiguous copy of it.
TEST(BasicOps, SplitPartsAreViewsOfXThatEveryConsumerReadsThroughTheirStrides) {
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    CaseRng rng(testing::case_seed(91, 1, 0, 0));
    const Tensor values = smooth_values({1, 5, 3, 4}, rng);
    const ShardTensor x = ShardTensor::distribute(values, mesh, {Placement::replicate()});
    const double* first = x.to_local().data<double>();
    const std::vector<ShardTensor> outer = ops::split(x, {2, 0, 3}, 1);
    ASSERT_EQ(outer.size(), 3u);
    EXPECT_EQ(outer[0].to_local().data<double>(), first);
    EXPECT_EQ(outer[2].to_local().data<double>(), first + 2 * 3 * 4);
    EXPECT_EQ(outer[1].to_local().numel(), 0);
    const std::vector<ShardTensor> inner = ops::split(x, {1, 3}, 3);
    ASSERT_EQ(inner.size(), 2u);
    EXPECT_FALSE(inner[1].to_local().is_contiguous());
    EXPECT_EQ(inner[1].to_local().data<double>(), first + 1);
    EXPECT_EQ(max_abs_diff(inner[1].full_tensor(), values.slice(3, 1, 4).contiguous()), 0.0);
    EXPECT_THROW(inner[1].to_local().comm_data(), Error) << "a strided payload is refused";
    // A user's kernel (here one without a rule, which runs replicated) is given contiguous
    // pieces: it may read them as flat arrays.
    register_op(OpDef{.name = "test_flat_copy",
                      .cpu = [](const KernelContext&, const std::vector<Tensor>& inputs) {
                        EXPECT_TRUE(inputs[0].is_contiguous());
                        Tensor out = Tensor::empty(inputs[0].shape(), inputs[0].dtype());
                        std::memcpy(out.raw_data(), inputs[0].raw_data(), inputs[0].nbytes());
                        return std::vector<Tensor>{out};
                      }});
    const ShardTensor flat = apply_op("test_flat_copy", {inner[1]})[0];
    EXPECT_EQ(max_abs_diff(flat.full_tensor(), values.slice(3, 1, 4).contiguous()), 0.0);
  });
  // 4 ranks sharding dims 2 and 3 unevenly: the parts cut along dim 3 (sharded) and dim 1.
  testing::run_world(4, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2, 2});
    CaseRng rng(testing::case_seed(91, 4, 0, 0));
    const Tensor values = smooth_values({2, 4, 7, 9}, rng);
    for (int dim : {1, 3}) {
      SCOPED_TRACE(fmt::format("split along dim {}", dim));
      const std::vector<int64_t> sizes =
          dim == 1 ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{4, 5};
      // One program on split's views of x, and on leaves holding contiguous copies of the parts
      // in the views' layouts (no split at all): the same values, bit for bit.
      auto program = [&](const std::vector<ShardTensor>& parts) {
        ops::PoolOptions pool;
        pool.kernel_size = {3};
        pool.stride = {1};
        pool.padding = {1};
        const ShardTensor pooled = ops::avg_pool(parts[1], pool);  // halos of a strided piece
        const ShardTensor moved =
            parts[0].redistribute({Placement::replicate(), Placement::shard(2)});
        const ShardTensor loss =
            ops::add(ops::sum(ops::mul(pooled, parts[1])), ops::sum(ops::mul(moved, moved)));
        return std::pair{loss, pooled};
      };
      Tape tape;
      ShardTensor x = ShardTensor::distribute(
          values, mesh, {Placement::shard(2), Placement::shard(3)}, {{3, 4}, {6, 3}});
      x.set_requires_grad();
      const std::vector<ShardTensor> views = ops::split(x, sizes, dim);
      if (dim == 1) {
        EXPECT_FALSE(views[1].to_local().is_contiguous()) << "the part is a strided view";
        EXPECT_EQ(views[1].to_local().data<double>(),
                  x.to_local().data<double>() + x.to_local().strides()[1]);
      }
      const auto [loss, pooled] = program(views);
      const Tensor gathered = views[1].gather(0);
      tape.backward(loss);
      const Tensor grad = tape.grad(x)->full_tensor();

      Tape reference_tape;
      std::vector<ShardTensor> leaves;
      int64_t offset = 0;
      for (size_t k = 0; k < 2; ++k) {
        const Tensor part = values.slice(dim, offset, offset + sizes[k]).contiguous();
        offset += sizes[k];
        leaves.push_back(
            ShardTensor::distribute(part, mesh, views[k].placements(), views[k].spec().extents));
        leaves.back().set_requires_grad();
      }
      const auto [reference_loss, reference_pooled] = program(leaves);
      reference_tape.backward(reference_loss);
      EXPECT_EQ(max_abs_diff(loss.full_tensor(), reference_loss.full_tensor()), 0.0);
      EXPECT_EQ(max_abs_diff(pooled.full_tensor(), reference_pooled.full_tensor()), 0.0);
      Tensor reference_grad = Tensor::zeros(values.shape(), values.dtype());
      reference_grad.slice(dim, 0, sizes[0])
          .copy_from(reference_tape.grad(leaves[0])->full_tensor());
      reference_grad.slice(dim, sizes[0], sizes[0] + sizes[1])
          .copy_from(reference_tape.grad(leaves[1])->full_tensor());
      EXPECT_EQ(max_abs_diff(grad, reference_grad), 0.0);
      if (comm->rank() == 0) {
        EXPECT_EQ(
            max_abs_diff(gathered, values.slice(dim, sizes[0], sizes[0] + sizes[1]).contiguous()),
            0.0);
      }
    }
  });
}

// Copies of 1 MiB and more run on the compute threads, cut by elements anywhere in a row: views
// cut on every dim (strided on either side, rows contiguous or not) copy exactly, with 1, 2 and 3
// threads.
TEST(TensorCopy, LargeStridedCopiesOnSeveralThreadsEqualTheElementwiseCopy) {
  const Shape shape{3, 7, 99, 129};  // 2.1 MiB of doubles
  Tensor source = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < source.numel(); ++i) source.data<double>()[i] = double(i) * 0.5 - 7;
  const int before = compute_threads();
  for (int threads : {1, 2, 3}) {
    set_compute_threads(threads);
    for (int dim = 0; dim < 4; ++dim) {
      // A strided part of the source into a fresh tensor, and into a strided part of another.
      const int64_t cut = shape[dim] / 3;
      const Tensor part = source.slice(dim, cut, shape[dim]);
      ASSERT_GE(part.nbytes(), size_t{1} << 20) << "large enough to run on the threads";
      Tensor dense = Tensor::empty(part.shape(), DType::f64);
      dense.copy_from(part);
      Shape wide = part.shape();
      wide[(dim + 1) % 4] += 2;
      Tensor holder = Tensor::zeros(wide, DType::f64);
      Tensor window = holder.slice((dim + 1) % 4, 1, 1 + part.shape((dim + 1) % 4));
      window.copy_from(part);
      int64_t wrong = 0;
      std::vector<int64_t> at(4);
      for (at[0] = 0; at[0] < part.shape(0); ++at[0])
        for (at[1] = 0; at[1] < part.shape(1); ++at[1])
          for (at[2] = 0; at[2] < part.shape(2); ++at[2])
            for (at[3] = 0; at[3] < part.shape(3); ++at[3]) {
              const double want = part.item_as_double(at);
              wrong += dense.item_as_double(at) != want || window.item_as_double(at) != want;
            }
      EXPECT_EQ(wrong, 0) << "threads " << threads << " dim " << dim;
      // The cells of the holder outside the window stay zero.
      double outside = 0;
      for (int64_t i = 0; i < holder.numel(); ++i) outside += std::fabs(holder.data<double>()[i]);
      double inside = 0;
      const Tensor packed = window.contiguous();
      for (int64_t i = 0; i < packed.numel(); ++i) inside += std::fabs(packed.data<double>()[i]);
      EXPECT_EQ(outside, inside) << "threads " << threads << " dim " << dim;
    }
  }
  set_compute_threads(before);
}

// concat of large pieces, each copied into its slice of the output on the compute threads
// (uneven pieces, one empty): every element lands where an element-by-element join puts it, on
// 1, 2 and 3 threads and along every dim, in f64 and in f32 (another element size).
TEST(BasicOps, ConcatOfLargePiecesOnSeveralThreadsEqualsTheElementwiseJoin) {
  testing::run_world(1, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {1});
    const int before = compute_threads();
    for (DType dtype : {DType::f64, DType::f32})
      for (int dim = 0; dim < 3; ++dim) {
        std::vector<Shape> shapes(4, Shape{24, 101, 139});
        const int64_t lengths[4] = {shapes[0][dim] / 3, 0, shapes[0][dim] / 2 + 1, 5};
        std::vector<Tensor> values;
        std::vector<ShardTensor> pieces;
        double next = 0;
        for (int p = 0; p < 4; ++p) {
          shapes[p][dim] = lengths[p];
          Tensor v = Tensor::empty(shapes[p], DType::f64);
          for (int64_t i = 0; i < v.numel(); ++i) v.data<double>()[i] = next++;
          values.push_back(v);
          pieces.push_back(
              ShardTensor::distribute(v.to_dtype(dtype), mesh, {Placement::replicate()}));
        }
        for (int threads : {1, 2, 3}) {
          set_compute_threads(threads);
          const Tensor y = ops::concat(pieces, dim).full_tensor().to_dtype(DType::f64);
          ASSERT_GE(y.numel() * int64_t(dtype_size(dtype)), int64_t{1} << 20) << "on the threads";
          int64_t wrong = 0;
          int64_t offset = 0;
          for (int p = 0; p < 4; ++p) {
            std::vector<int64_t> at(3);
            for (at[0] = 0; at[0] < shapes[p][0]; ++at[0])
              for (at[1] = 0; at[1] < shapes[p][1]; ++at[1])
                for (at[2] = 0; at[2] < shapes[p][2]; ++at[2]) {
                  std::vector<int64_t> to = at;
                  to[dim] += offset;
                  wrong += y.item_as_double(to) != values[p].item_as_double(at);
                }
            offset += lengths[p];
          }
          EXPECT_EQ(wrong, 0) << dtype_name(dtype) << " dim " << dim << " threads " << threads;
        }
      }
    set_compute_threads(before);
  });
}

/// Reverses the rows (dim 0) of a tensor: its own adjoint.
Tensor reverse_rows(const Tensor& input) {
  const Tensor in = input.contiguous();
  Tensor out = Tensor::empty(in.shape(), in.dtype());
  const int64_t rows = in.shape(0), row = in.numel() / std::max<int64_t>(rows, 1);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data<double>() + r * row, in.data<double>() + (rows - 1 - r) * row,
                row * sizeof(double));
  return out;
}

// An op whose owned_in_place says yes gets the haloed tensor with the halo cells filled and the
// interior left to it: context.interiors holds the owned piece and its box. fill() completes the
// haloed tensor once; where owned_in_place says no, apply_op fills it before the kernel; what is
// left unfilled apply_op fills before the tape records the call, so the backward reads it whole.
// Each fill is a traced halo_fill copy of the owned piece.
TEST(OpRegistry, AnOpReadingItsOwnedPieceInPlaceGetsTheHaloAroundTheInterior) {
  // y[i] = x[i - 1] + x[i] + x[i + 1] (zero past the ends). Attribute fill: 0, the kernel reads
  // x's own cells from the owned piece; 1, from the haloed tensor once it has filled it; 2,
  // owned_in_place says no and the kernel gets the haloed tensor whole.
  const auto rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs&) {
    const ShardSpec& x = inputs.at(0);
    return OpRule{{x}, {HaloNeed{grown_boxes(x, {1}, {1}), {BoundaryMode::zero}}}, {x}};
  };
  const auto kernel = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const Tensor& haloed = inputs[0];
    const int64_t fill = context.attrs.get_int("fill", 0);
    std::vector<double> x(static_cast<size_t>(haloed.shape(0)));
    if (context.interiors.owned(0)) {
      const Tensor owned = *context.interiors.owned(0);
      const Box box = context.interiors.box(0);
      EXPECT_EQ(box.shape(), owned.shape());
      EXPECT_EQ(box.extent(0) + 2, haloed.shape(0)) << "one halo cell on each side";
      if (fill == 1) {
        context.interiors.fill(0, haloed);
        EXPECT_EQ(context.interiors.owned(0), nullptr) << "filled once";
        context.interiors.fill(0, haloed);  // a second call does nothing
      }
      for (int64_t i = 0; i < haloed.shape(0); ++i)
        x[i] = fill != 1 && i >= box.lo[0] && i < box.hi[0] ? owned.data<double>()[i - box.lo[0]]
                                                            : haloed.data<double>()[i];
    } else {
      EXPECT_EQ(fill, 2) << "every rank's piece here needs a halo: its interior is left unfilled";
      for (int64_t i = 0; i < haloed.shape(0); ++i) x[i] = haloed.data<double>()[i];
    }
    Tensor y = Tensor::empty({haloed.shape(0) - 2}, DType::f64);
    for (int64_t i = 0; i < y.shape(0); ++i) y.data<double>()[i] = x[i] + x[i + 1] + x[i + 2];
    return std::vector<Tensor>{y};
  };
  // The backward checks that it sees the haloed tensor whole: its cells are x's, global index
  // by index (x[i] = i + 1, zero past the ends).
  const auto backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const Tensor& haloed = record.kernel_inputs[0];
    const int64_t first = record.plans[0]->needed_box().lo[0];
    for (int64_t i = 0; i < haloed.shape(0); ++i) {
      const int64_t global = first + i;
      const double expected = global >= 0 && global < 12 ? static_cast<double>(global + 1) : 0.0;
      EXPECT_EQ(haloed.data<double>()[i], expected) << "haloed cell " << i;
    }
    return {grads[0]};
  };
  register_op(OpDef{
      .name = "test_sum3_owned",
      .rule = rule,
      .cpu = kernel,
      .backward = backward,
      .owned_in_place = [](const KernelContext& context, const std::vector<Tensor>&, size_t i) {
        return i == 0 && context.attrs.get_int("fill", 0) != 2;
      }});
  testing::run_world(3, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {3});
    Tensor values = Tensor::empty({12}, DType::f64);
    for (int64_t i = 0; i < 12; ++i) values.data<double>()[i] = static_cast<double>(i + 1);
    Tensor expected = Tensor::empty({12}, DType::f64);
    for (int64_t i = 0; i < 12; ++i)
      expected.data<double>()[i] = (i > 0 ? i : 0) + (i + 1) + (i < 11 ? i + 2 : 0);
    const std::vector<int64_t> extents{5, 3, 4};
    for (int64_t fill : {0, 1, 2}) {
      SCOPED_TRACE(fmt::format("fill {}", fill));
      OpAttrs attrs;
      attrs.set("fill", fill);
      // Without a tape the interior is copied only when the kernel or apply_op fills it: a
      // halo_fill event of the owned piece's bytes.
      int64_t filled = 0;
      for (const std::string& text :
           trace::capture(comm->rank(), comm, [&](std::shared_ptr<Comm> traced) {
             DeviceMesh traced_mesh(traced, {3});
             const ShardTensor x =
                 ShardTensor::distribute(values, traced_mesh, {Placement::shard(0)}, {extents});
             EXPECT_EQ(
                 max_abs_diff(apply_op("test_sum3_owned", {x}, attrs)[0].full_tensor(), expected),
                 0.0);
           })) {
        const nlohmann::json event = nlohmann::json::parse(text);
        if (event.value("name", "") == "halo_fill")
          filled += event["args"].value("copied_bytes", int64_t{0});
      }
      EXPECT_EQ(filled, fill == 0 ? 0 : extents[comm->rank()] * int64_t{sizeof(double)});
      ShardTensor x = ShardTensor::distribute(values, mesh, {Placement::shard(0)}, {extents});
      Tape tape;
      x.set_requires_grad();
      const ShardTensor y = apply_op("test_sum3_owned", {x}, attrs)[0];
      EXPECT_EQ(max_abs_diff(y.full_tensor(), expected), 0.0);
      tape.backward(y, y);
    }
  });
}

// A rule may name an output's dtype (what estimate mode's shape-only outputs get); a kernel
// that makes another one is an error naming the op, and the integer output takes no gradient.
TEST(OpRegistry, AnOutputDtypeTheRuleNamesIsTheKernels) {
  const auto rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs&) {
    OpRule result{{inputs[0]}, {std::nullopt}, {inputs[0], inputs[0]}};
    result.output_dtypes = {std::nullopt, DType::i64};
    return result;
  };
  const auto kernel = [](DType second) {
    return [second](const KernelContext&, const std::vector<Tensor>& inputs) {
      return std::vector<Tensor>{inputs[0].clone(), Tensor::zeros(inputs[0].shape(), second)};
    };
  };
  const auto backward = [](const OpRecord&, const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> { return {grads[0]}; };
  register_op(OpDef{.name = "test_value_and_count",
                    .rule = rule,
                    .cpu = kernel(DType::i64),
                    .backward = backward});
  register_op(OpDef{.name = "test_value_and_wrong_count",
                    .rule = rule,
                    .cpu = kernel(DType::f64),
                    .backward = backward});
  testing::run_world(2, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {2});
    Tape tape;
    ShardTensor x = ShardTensor::distribute(Tensor::zeros({4, 3}, DType::f64), mesh,
                                            {Placement::shard(0)}, {{3, 1}});
    x.set_requires_grad();
    const std::vector<ShardTensor> outputs = apply_op("test_value_and_count", {x});
    EXPECT_TRUE(outputs[0].requires_grad());
    EXPECT_EQ(outputs[1].dtype(), DType::i64);
    EXPECT_FALSE(outputs[1].requires_grad()) << "an integer output takes no gradient";
    try {
      apply_op("test_value_and_wrong_count", {x});
      ADD_FAILURE() << "a kernel output of another dtype than the rule's was accepted";
    } catch (const InvalidArgument& error) {
      EXPECT_THAT(error.what(), ::testing::StartsWith("[test_value_and_wrong_count] the kernel's "
                                                      "output 1 is f64 on rank"));
      EXPECT_THAT(error.what(), ::testing::HasSubstr("the rule says i64"));
    }
  });
}

TEST(OpRegistry, AnOpWithoutARuleRunsReplicatedReshardsAndDifferentiates) {
  register_op(OpDef{
      .name = "test_reverse_rows",
      .cpu =
          [](const KernelContext&, const std::vector<Tensor>& inputs) {
            return std::vector<Tensor>{reverse_rows(inputs[0])};
          },
      .backward = [](const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads)
          -> std::vector<std::optional<ShardTensor>> {
        const ShardTensor g = grads[0]->redistribute(record.outputs[0].placements());
        return {ShardTensor(reverse_rows(g.to_local()), g.mesh(), g.spec())};
      }});
  testing::run_world(3, [](std::shared_ptr<Comm> comm) {
    DeviceMesh mesh(comm, {3});
    Tensor values = Tensor::empty({6, 2}, DType::f64);
    for (int i = 0; i < 12; ++i) values.data<double>()[i] = i;
    Tape tape;
    ShardTensor x = ShardTensor::distribute(values, mesh, {Placement::shard(0)}, {{1, 4, 1}});
    x.set_requires_grad();
    const ShardTensor y = apply_op("test_reverse_rows", {x})[0];
    EXPECT_EQ(y.spec(), x.spec()) << "re-sharded like the input";
    const Tensor full = y.full_tensor();
    for (int r = 0; r < 6; ++r) EXPECT_EQ(full.item_as_double({r, 0}), (5 - r) * 2);
    // loss = sum(y * w) with w = row index: d loss / dx[r] = w[5 - r] = 5 - r.
    Tensor weights = Tensor::empty({6, 2}, DType::f64);
    for (int i = 0; i < 12; ++i) weights.data<double>()[i] = i / 2;
    const ShardTensor w = ShardTensor::distribute(weights, mesh, y.placements(), y.spec().extents);
    tape.backward(ops::sum(ops::mul(y, w)));
    const Tensor grad = tape.grad(x)->full_tensor();
    for (int r = 0; r < 6; ++r) EXPECT_EQ(grad.item_as_double({r, 1}), 5 - r);
  });
}

}  // namespace
}  // namespace tessera
