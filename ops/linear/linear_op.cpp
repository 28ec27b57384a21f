// linear and matmul: rules, cpu kernels, backward and registration.
//
// Layouts: a mesh dim that does not shard linear's w never shards the contracted dim (x's and
// a's last): it replicates instead, and the rule moves the data first. Every other dim of x (a)
// keeps its placement, so the output is sharded like the input, and no rank talks to another in
// the forward. Weights (w, b; a 2-d b) replicated on a mesh dim have gradients that are each
// rank's sums over its rows, Partial(sum) over the mesh dims that shard x (as conv's dw). A
// batched b takes a's placements on the batch dims; its gradient sums over a's rows:
// Partial(sum) over the mesh dims that shard a's row dim.
//
// Tensor parallelism is linear's w sharded over a mesh dim (Megatron's layers):
// - w Shard(0) (column-parallel, out features split): x is replicated there, b is split like w's
//   rows, y is Shard(last) with w's extents; dx is Partial(sum) there (each rank's share of the
//   out features), dw and db stay Shard(0).
// - w Shard(1) (row-parallel, in features split): x is Shard(last) with w's extents there, y is
//   Partial(sum) (each rank's share of the contracted sum), reduced once where the next op needs
//   it; the gradient of y arrives replicated, so dx keeps x's layout and dw stays Shard(1). A bias
//   would be counted once per rank of the sum, so it is refused: add it after the reduction.
//
// Kernels: C = A op(B) per matrix. cpu: f32 through oneDNN's sgemm when built with oneDNN, f64
// (and f32 without oneDNN) through a row-parallel loop accumulating in the dtype. cuda: cuBLAS
// (linear_cuda.hpp). f16/bf16 compute in f32. Bias rows come from a product with a vector of
// ones, so one code path serves both devices.
#include "ops/linear/linear_op.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/autograd.hpp"
#include "core/compute_threads.hpp"
#include "core/parallel_for.hpp"
#include "ops/dnnl/dnnl_support.hpp"
#include "ops/linear/linear_cuda.hpp"
#include "ops/op_costs.hpp"
#include "ops/op_helpers.hpp"

namespace tessera::ops {

namespace {

/// A row-major matrix operand: element (i, j) at data[i * rows + j * cols] (strides in
/// elements), so a transposed view is the same storage with the strides swapped.
template <typename T>
struct Matrix {
  const T* data;
  int64_t row_stride, col_stride;
  T at(int64_t i, int64_t j) const { return data[i * row_stride + j * col_stride]; }
};

/// c [m, n] = (accumulate ? c : 0) + a [m, k] @ b [k, n] (a loop parallel over rows of c, on
/// up to `threads` threads).
template <typename T>
void gemm_loop(int64_t m, int64_t n, int64_t k, Matrix<T> a, Matrix<T> b, T* c, bool accumulate,
               int threads) {
  parallel_for(m, threads, [&](int64_t begin, int64_t end, int) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = c + i * n;
      if (!accumulate)
        for (int64_t j = 0; j < n; ++j) row[j] = T(0);
      for (int64_t p = 0; p < k; ++p) {
        const T scale = a.at(i, p);
        if (b.col_stride == 1) {
          const T* brow = b.data + p * b.row_stride;
          for (int64_t j = 0; j < n; ++j) row[j] += scale * brow[j];
        } else {
          for (int64_t j = 0; j < n; ++j) row[j] += scale * b.at(p, j);
        }
      }
    }
  });
}

/// c = (accumulate ? c : 0) + op(a) @ op(b) for contiguous 2-d f32 or f64 tensors a, b, c
/// (op = transpose where asked), on up to `threads` threads; m, n, k are c's rows, c's columns
/// and the contracted extent.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const T* a, const T* b, T* c,
          bool accumulate, int threads) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) std::fill(c, c + m * n, T(0));
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (dnnl_sgemm_row_major(trans_a, trans_b, m, n, k, 1.0f, a, trans_a ? m : k, b,
                             trans_b ? k : n, accumulate ? 1.0f : 0.0f, c, n, threads))
      return;
  }
  const Matrix<T> ma{a, trans_a ? 1 : k, trans_a ? m : 1};
  const Matrix<T> mb{b, trans_b ? 1 : n, trans_b ? k : 1};
  gemm_loop(m, n, k, ma, mb, c, accumulate, threads);
}

/// The dtype the kernels compute in: f64 for f64, f32 otherwise.
DType compute_dtype(DType dtype) {
  return dtype == DType::f64 ? DType::f64 : DType::f32;
}

/// Whether `batches` products C_i = A_i op(B) with one B (b_step 0), A_i [m, k] untransposed and
/// stacked row after row (a_step m * k), into distinct C_i, are one product of batches * m rows.
bool fold_batches(int64_t batches, int64_t a_step, int64_t b_step, bool trans_a, int64_t m,
                  int64_t k, bool accumulate) {
  return batches > 1 && b_step == 0 && !trans_a && !accumulate && a_step == m * k;
}

/// `batches` products C_i = op(A_i) op(B_i) of contiguous tensors in the compute dtype, on their
/// device (cuda: cuBLAS on `stream`); A_i at a + i * a_step, B_i at b + i * b_step (b_step 0: one
/// B for all), C_i at c + i * m * n (at c for every i when accumulating into one C).
void batched_gemm(const Tensor& a, const Tensor& b, Tensor& c, int64_t batches, int64_t a_step,
                  int64_t b_step, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  bool accumulate, const Stream& stream) {
  // Estimate mode: a shape-only product computes nothing (the backward's results keep their
  // shapes, which is all a recording needs).
  if (c.is_shape_only()) return;
  // One B for A_i stacked row after row (a [..., M, K] @ w [K, N]): one product of batches * M
  // rows, as torch folds it, which oneDNN and cuBLAS thread and tile as a whole; as `batches`
  // small products each ran on one thread, one after another. (cuBLAS counts rows in int.)
  const bool rows_fit = !c.device().is_cuda() || batches * m <= std::numeric_limits<int>::max();
  if (rows_fit && fold_batches(batches, a_step, b_step, trans_a, m, k, accumulate)) {
    m *= batches;
    batches = 1;
  }
  if (c.device().is_cuda()) {
    gemm_cuda(trans_a, trans_b, m, n, k, a, a_step, b, b_step, c, batches, accumulate, stream);
    return;
  }
  const int threads = compute_threads();
  auto run = [&]<typename T>() {
    const T* pa = static_cast<const T*>(a.raw_data());
    const T* pb = static_cast<const T*>(b.raw_data());
    T* pc = static_cast<T*>(c.raw_data());
    const auto product = [&](int64_t i, int product_threads) {
      gemm<T>(trans_a, trans_b, m, n, k, pa + i * a_step, pb + i * b_step,
              pc + (accumulate ? 0 : i * m * n), accumulate, product_threads);
    };
    // Products into distinct C_i, at least one per thread: the threads share the products, each
    // product on one thread. Otherwise (a few large ones, or sums into one C) one after another,
    // each on every thread.
    if (!accumulate && batches >= threads && threads > 1) {
      parallel_for(batches, threads, [&](int64_t begin, int64_t end, int) {
        for (int64_t i = begin; i < end; ++i) product(i, 1);
      });
    } else {
      for (int64_t i = 0; i < batches; ++i) product(i, threads);
    }
  };
  if (c.dtype() == DType::f64)
    run.template operator()<double>();
  else
    run.template operator()<float>();
}

/// A [rows] vector of ones in `dtype` on `device` (the left factor of bias sums).
Tensor ones(int64_t rows, DType dtype, Device device) {
  Tensor t = Tensor::empty({rows}, dtype, device);
  t.fill(1.0);
  return t;
}

/// x's layout with the mesh dims sharding its last dim replicated (and no Partial).
ShardSpec contracted_replicated(const ShardSpec& spec) {
  ShardSpec result = without_partial(spec);
  const int last = static_cast<int>(spec.global_shape.size()) - 1;
  for (size_t m = 0; m < result.placements.size(); ++m)
    if (result.placements[m].is_shard() && result.placements[m].dim == last) {
      result.placements[m] = Placement::replicate();
      result.extents[m].clear();
    }
  return ShardSpec::make(result.global_shape, result.mesh_shape, result.placements, result.extents);
}

/// The layout of an output of `shape` whose dims sit where x's do (last dim replaced).
ShardSpec output_layout(const ShardSpec& x, const Shape& shape) {
  return ShardSpec::make(shape, x.mesh_shape, x.placements, x.extents);
}

ShardSpec replicated(const Shape& shape, const std::vector<int>& mesh_shape) {
  return ShardSpec::make(shape, mesh_shape,
                         std::vector<Placement>(mesh_shape.size(), Placement::replicate()));
}

/// Product of the dims of `shape` before `end`.
int64_t leading(const Shape& shape, size_t end) {
  int64_t n = 1;
  for (size_t d = 0; d < end; ++d) n *= shape[d];
  return n;
}

Tensor as_compute(const Tensor& t) {
  return t.to_dtype(compute_dtype(t.dtype())).contiguous();
}

// --- linear ---------------------------------------------------------------------------------

/// How linear's w is split over one mesh dim (tensor parallelism).
enum class TensorParallel { none, column, row };

/// Shard(0) of w over mesh dim m: column-parallel; Shard(1): row-parallel.
TensorParallel tensor_parallel_kind(const ShardSpec& w, size_t m) {
  const Placement& p = w.placements[m];
  if (!p.is_shard()) return TensorParallel::none;
  return p.dim == 0 ? TensorParallel::column : TensorParallel::row;
}

/// dx's layout: x's, with Partial(sum) over the column-parallel mesh dims (each rank contracts
/// its share of the out features).
ShardSpec linear_input_grad_layout(const ShardSpec& x, const ShardSpec& w) {
  std::vector<Placement> placements = x.placements;
  std::vector<std::vector<int64_t>> extents = x.extents;
  for (size_t m = 0; m < placements.size(); ++m)
    if (tensor_parallel_kind(w, m) == TensorParallel::column) {
      placements[m] = Placement::partial(ReduceOp::sum);
      extents[m].clear();
    }
  return ShardSpec::make(x.global_shape, x.mesh_shape, placements, extents);
}

void check_linear(const std::vector<ShardSpec>& inputs) {
  check_arg(inputs.size() == 2 || inputs.size() == 3, "linear", "expects inputs x, w[, b], got {}",
            inputs.size());
  const Shape& x = inputs[0].global_shape;
  const Shape& w = inputs[1].global_shape;
  check_arg(!x.empty(), "linear", "x has no dims (a scalar)");
  check_arg(w.size() == 2 && w[1] == x.back(), "linear",
            "w of shape {} for x of shape {}: expected [out, {}]", w, x, x.back());
  if (inputs.size() == 3)
    check_arg(inputs[2].global_shape == Shape{w[0]}, "linear", "b of shape {}, expected [{}]",
              inputs[2].global_shape, w[0]);
}

void register_linear() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs&) {
    check_linear(inputs);
    const ShardSpec& w_in = inputs[1];
    const int last = static_cast<int>(inputs[0].global_shape.size()) - 1;
    const size_t mesh_dims = w_in.placements.size();
    ShardSpec x = without_partial(inputs[0]);
    std::vector<Placement> w_placements(mesh_dims, Placement::replicate());
    std::vector<Placement> b_placements(mesh_dims, Placement::replicate());
    std::vector<Placement> y_placements = x.placements;
    std::vector<std::vector<int64_t>> w_extents(mesh_dims), b_extents(mesh_dims),
        y_extents = x.extents;
    for (size_t m = 0; m < mesh_dims; ++m) {
      const TensorParallel kind = tensor_parallel_kind(w_in, m);
      if (kind == TensorParallel::column) {
        x.placements[m] = Placement::replicate();
        x.extents[m].clear();
        w_placements[m] = b_placements[m] = Placement::shard(0);
        y_placements[m] = Placement::shard(last);
        w_extents[m] = b_extents[m] = y_extents[m] = w_in.extents[m];
      } else if (kind == TensorParallel::row) {
        check_arg(inputs.size() == 2, "linear",
                  "w is sharded on its in features (row-parallel) over mesh dim {}: a bias would "
                  "be added once per rank of the sum; add it after the reduction",
                  m);
        x.placements[m] = Placement::shard(last);
        x.extents[m] = w_in.extents[m];
        w_placements[m] = Placement::shard(1);
        w_extents[m] = w_in.extents[m];
        y_placements[m] = Placement::partial(ReduceOp::sum);
        y_extents[m].clear();
      } else if (x.placements[m].is_shard() && x.placements[m].dim == last) {
        x.placements[m] = y_placements[m] = Placement::replicate();
        x.extents[m].clear();
        y_extents[m].clear();
      }
    }
    x = ShardSpec::make(x.global_shape, x.mesh_shape, x.placements, x.extents);
    Shape y = x.global_shape;
    y.back() = w_in.global_shape[0];
    std::vector<ShardSpec> layouts{
        x, ShardSpec::make(w_in.global_shape, w_in.mesh_shape, w_placements, w_extents)};
    if (inputs.size() == 3)
      layouts.push_back(
          ShardSpec::make(inputs[2].global_shape, inputs[2].mesh_shape, b_placements, b_extents));
    std::vector<std::optional<HaloNeed>> halos(inputs.size(), std::nullopt);
    return OpRule{layouts, halos, {ShardSpec::make(y, x.mesh_shape, y_placements, y_extents)}};
  };
  KernelFn kernel = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    if (!inputs[0].device().is_cuda()) require_floating_cpu(inputs[0], "linear");
    const Tensor x = as_compute(inputs[0]);
    const Tensor w = inputs[1].to_dtype(x.dtype()).contiguous();
    const int64_t in = w.shape()[1], out = w.shape()[0];
    const int64_t rows = leading(x.shape(), x.shape().size() - 1);
    Shape y_shape = x.shape();
    y_shape.back() = out;
    Tensor y = Tensor::empty(y_shape, x.dtype(), x.device());
    const bool bias = inputs.size() == 3;
    if (bias) {  // y = ones [rows, 1] @ b [1, out] first: b on every row
      const Tensor b = inputs[2].to_dtype(x.dtype()).contiguous();
      batched_gemm(ones(rows, x.dtype(), x.device()), b, y, 1, 0, 0, false, false, rows, out, 1,
                   false, context.stream);
    }
    batched_gemm(x, w, y, 1, 0, 0, false, true, rows, out, in, bias, context.stream);
    return std::vector<Tensor>{y.to_dtype(inputs[0].dtype())};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const ShardTensor& x = record.inputs[0];
    const ShardTensor& w = record.inputs[1];
    // The gradient of a Partial(sum) y (row-parallel) is the same on every rank of the sum.
    const ShardSpec y_spec = without_partial(record.outputs[0].spec());
    const ShardTensor g = grads[0]->spec() == y_spec
                              ? *grads[0]
                              : grads[0]->redistribute(y_spec.placements, y_spec.extents);
    const Tensor gc = as_compute(g.to_local());
    const Tensor xc = as_compute(x.to_local());
    const Tensor wc = w.to_local().to_dtype(gc.dtype()).contiguous();
    const Device device = gc.device();
    const Stream stream = compute_stream_for(device);
    const int64_t in = wc.shape()[1], out = wc.shape()[0];
    const int64_t rows = leading(xc.shape(), xc.shape().size() - 1);
    Tensor dx = Tensor::empty(xc.shape(), gc.dtype(), device);
    batched_gemm(gc, wc, dx, 1, 0, 0, false, false, rows, in, out, false, stream);  // g @ w
    Tensor dw = Tensor::empty({out, in}, gc.dtype(), device);
    batched_gemm(gc, xc, dw, 1, 0, 0, true, false, out, in, rows, false, stream);  // g^T @ x
    std::vector<std::optional<ShardTensor>> result{
        ShardTensor(dx.to_dtype(x.dtype()), x.mesh(), linear_input_grad_layout(x.spec(), w.spec())),
        ShardTensor(dw.to_dtype(w.dtype()), w.mesh(), param_grad_layout(x.spec(), w.spec()))};
    if (record.inputs.size() == 3) {
      Tensor db = Tensor::empty({out}, gc.dtype(), device);  // ones [1, rows] @ g
      batched_gemm(ones(rows, gc.dtype(), device), gc, db, 1, 0, 0, false, false, 1, out, rows,
                   false, stream);
      const ShardTensor& b = record.inputs[2];
      result.push_back(
          ShardTensor(db.to_dtype(b.dtype()), x.mesh(), param_grad_layout(x.spec(), b.spec())));
    }
    return result;
  };
  register_op(OpDef{.name = "linear",
                    .summary = "x[..., in] @ w[out, in]^T + b[out] (x sharded on any dim but the "
                               "last)",
                    .inputs = {{.name = "x"}, {.name = "w"}, {.name = "b", .optional = true}},
                    .outputs = {"y"},
                    .rule = std::move(rule),
                    .cpu = kernel,
                    .cuda = kernel,
                    .backward = std::move(backward),
                    .cost = matmul_cost});
}

// --- matmul ---------------------------------------------------------------------------------

/// Whether b is batched (b [..., K, N] with a's batch dims) rather than one [K, N] matrix.
bool check_matmul(const Shape& a, const Shape& b) {
  check_arg(a.size() >= 2, "matmul", "a of shape {}: a needs at least 2 dims [..., M, K]", a);
  check_arg(b.size() == 2 || b.size() == a.size(), "matmul",
            "b of shape {} for a of shape {}: expected [K, N] or [..., K, N] with a's batch dims",
            b, a);
  check_arg(b[b.size() - 2] == a.back(), "matmul",
            "a of shape {} and b of shape {}: contracted extents {} and {} differ", a, b, a.back(),
            b[b.size() - 2]);
  if (b.size() == 2) return false;
  for (size_t d = 0; d + 2 < a.size(); ++d)
    check_arg(a[d] == b[d], "matmul",
              "a of shape {} and b of shape {}: batch dims differ (dim {}); broadcast batch dims "
              "are not supported",
              a, b, d);
  return true;
}

/// b's layout for a batched b: a's placements on the batch dims, K and N unsharded.
ShardSpec batched_b_layout(const ShardSpec& a, const Shape& b) {
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
  const int batch_dims = static_cast<int>(b.size()) - 2;
  for (size_t m = 0; m < a.placements.size(); ++m) {
    const Placement& p = a.placements[m];
    const bool batch = p.is_shard() && p.dim < batch_dims;
    placements.push_back(batch ? p : Placement::replicate());
    extents.push_back(batch ? a.extents[m] : std::vector<int64_t>{});
  }
  return ShardSpec::make(b, a.mesh_shape, placements, extents);
}

void register_matmul() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs&) {
    check_arg(inputs.size() == 2, "matmul", "expects inputs a, b, got {}", inputs.size());
    const bool batched = check_matmul(inputs[0].global_shape, inputs[1].global_shape);
    const ShardSpec a = contracted_replicated(inputs[0]);
    const Shape& b = inputs[1].global_shape;
    Shape y = a.global_shape;
    y.back() = b.back();
    return OpRule{{a, batched ? batched_b_layout(a, b) : replicated(b, a.mesh_shape)},
                  {std::nullopt, std::nullopt},
                  {output_layout(a, y)}};
  };
  KernelFn kernel = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    if (!inputs[0].device().is_cuda()) require_floating_cpu(inputs[0], "matmul");
    const Tensor a = as_compute(inputs[0]);
    const Tensor b = inputs[1].to_dtype(a.dtype()).contiguous();
    const Shape& as = a.shape();
    const int64_t m = as[as.size() - 2], k = as.back(), n = b.shape().back();
    const int64_t batches = leading(as, as.size() - 2);
    Shape y_shape = as;
    y_shape.back() = n;
    Tensor y = Tensor::empty(y_shape, a.dtype(), a.device());
    const bool batched = b.ndim() > 2;
    batched_gemm(a, b, y, batches, m * k, batched ? k * n : 0, false, false, m, n, k, false,
                 context.stream);
    return std::vector<Tensor>{y.to_dtype(inputs[0].dtype())};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const ShardTensor& a = record.inputs[0];
    const ShardTensor& b = record.inputs[1];
    const ShardSpec& y_spec = record.outputs[0].spec();
    const ShardTensor g = grads[0]->spec() == y_spec
                              ? *grads[0]
                              : grads[0]->redistribute(y_spec.placements, y_spec.extents);
    const Tensor gc = as_compute(g.to_local());
    const Tensor ac = as_compute(a.to_local());
    const Tensor bc = b.to_local().to_dtype(gc.dtype()).contiguous();
    const Device device = gc.device();
    const Stream stream = compute_stream_for(device);
    const Shape& as = ac.shape();
    const int64_t m = as[as.size() - 2], k = as.back(), n = bc.shape().back();
    const int64_t batches = leading(as, as.size() - 2);
    const bool batched = bc.ndim() > 2;
    Tensor da = Tensor::empty(as, gc.dtype(), device);  // g @ b^T per matrix
    batched_gemm(gc, bc, da, batches, m * n, batched ? k * n : 0, false, true, m, k, n, false,
                 stream);
    Tensor db;
    ShardSpec db_spec;
    if (batched) {  // a^T @ g per matrix; a's row dim sums
      db = Tensor::empty(bc.shape(), gc.dtype(), device);
      batched_gemm(ac, gc, db, batches, m * k, m * n, true, false, k, n, m, false, stream);
      const ShardSpec b_layout = b.spec();
      std::vector<Placement> placements = b_layout.placements;
      const int row_dim = static_cast<int>(as.size()) - 2;
      for (size_t mi = 0; mi < placements.size(); ++mi)
        if (a.spec().placements[mi].is_shard() && a.spec().placements[mi].dim == row_dim)
          placements[mi] = Placement::partial(ReduceOp::sum);
      db_spec =
          ShardSpec::make(b_layout.global_shape, b_layout.mesh_shape, placements, b_layout.extents);
    } else {  // a^T @ g over every row of every matrix
      db = Tensor::empty({k, n}, gc.dtype(), device);
      batched_gemm(ac, gc, db, 1, 0, 0, true, false, k, n, batches * m, false, stream);
      db_spec = partial_over_sharding(a.spec(), {k, n});
    }
    return {ShardTensor(da.to_dtype(a.dtype()), a.mesh(), a.spec()),
            ShardTensor(db.to_dtype(b.dtype()), b.mesh(), db_spec)};
  };
  register_op(OpDef{.name = "matmul",
                    .summary = "a[..., M, K] @ b[K, N] or b[..., K, N] (a sharded on any dim but "
                               "the last)",
                    .inputs = {{.name = "a"}, {.name = "b"}},
                    .outputs = {"y"},
                    .rule = std::move(rule),
                    .cpu = kernel,
                    .cuda = kernel,
                    .backward = std::move(backward),
                    .cost = matmul_cost});
}

}  // namespace

void register_linear_ops() {
  register_linear();
  register_matmul();
}

ShardTensor linear(const ShardTensor& x, const ShardTensor& w,
                   const std::optional<ShardTensor>& b) {
  std::vector<ShardTensor> inputs{x, w};
  if (b) inputs.push_back(*b);
  return apply_op("linear", inputs)[0];
}

ShardTensor matmul(const ShardTensor& a, const ShardTensor& b) {
  return apply_op("matmul", {a, b})[0];
}

}  // namespace tessera::ops
