// dropout: rule, cpu kernel, backward and registration.
//
// The mask bit of the element at global row-major index i is a counter-based draw
// (dropout_mask.hpp, shared with the cuda kernel): splitmix64 of (seed, i) gives 64 bits, whose
// top 53 make u in [0, 1); the element is kept when u >= p. No
// state is carried between calls or ranks, so the mask of a sharded tensor is the mask of the
// whole tensor cut to each rank's box, and the backward recomputes it instead of saving it.
// Output layout: x's (without Partial).
#include "ops/dropout/dropout_op.hpp"

#include <fmt/format.h>

#include <cmath>

#include "core/autograd.hpp"
#include "ops/cpu_loops.hpp"
#include "ops/dropout/dropout_cuda.hpp"
#include "ops/dropout/dropout_mask.hpp"
#include "ops/op_helpers.hpp"

namespace tessera::ops {

namespace {

struct DropoutAttrs {
  double p = 0.5;
  uint64_t seed = 0;
  bool training = true;
};

DropoutAttrs attrs_of(const OpAttrs& attrs) {
  DropoutAttrs a;
  if (attrs.has("p")) a.p = attrs.get_double("p");
  if (attrs.has("seed")) a.seed = static_cast<uint64_t>(attrs.get_int("seed"));
  if (attrs.has("training")) a.training = attrs.get_int("training") != 0;
  check_arg(a.p >= 0 && a.p <= 1, "dropout", "attribute 'p' = {} is not a probability in [0, 1]",
            a.p);
  return a;
}

/// The factor of every element of the local piece `box` of a tensor of `global` shape: 0 where
/// dropped, 1 / (1 - p) where kept (f64, the box's shape).
Tensor mask_of(const DropoutAttrs& a, const Shape& global, const Box& box) {
  const Shape shape = box.shape();
  Tensor factors = Tensor::empty(shape, DType::f64);
  const int64_t count = factors.numel();
  if (count == 0) return factors;
  const int ndim = static_cast<int>(shape.size());
  const std::vector<int64_t> strides = contiguous_strides(global);
  std::vector<int64_t> index(ndim, 0);
  const double keep = a.p < 1 ? 1 / (1 - a.p) : 0.0;
  double* out = factors.data<double>();
  for (int64_t flat = 0; flat < count; ++flat) {
    uint64_t global_index = 0;
    for (int d = 0; d < ndim; ++d)
      global_index += static_cast<uint64_t>((box.lo[d] + index[d]) * strides[d]);
    out[flat] = kernels::dropout_keeps(a.seed, global_index, a.p) ? keep : 0.0;
    for (int d = ndim - 1; d >= 0; --d) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  return factors;
}

/// apply_mask on the cpu for f32 and f64 in one vectorised pass: the mask bit computed per element
/// as dropout_keeps does, through the exact integer form of its test (u >= p with u = m 2^-53, m
/// the draw's top 53 bits, is m >= ceil(p 2^53)); t * (1 / (1 - p)) or t * 0 in t's dtype.
template <typename T>
Tensor apply_mask_typed(const DropoutAttrs& a, const Tensor& t, const Shape& global,
                        const Box& box) {
  const Tensor source = t.contiguous();
  Tensor result = Tensor::empty(source.shape(), source.dtype());
  const int64_t count = source.numel();
  if (count == 0) return result;
  const Shape shape = box.shape();
  const int ndim = static_cast<int>(shape.size());
  const std::vector<int64_t> strides = contiguous_strides(global);
  const int64_t inner = ndim == 0 ? 1 : shape[ndim - 1];
  const uint64_t mixed_seed = kernels::splitmix64(a.seed);
  const uint64_t threshold = static_cast<uint64_t>(std::ceil(a.p * 9007199254740992.0));
  const T keep = static_cast<T>(a.p < 1 ? 1 / (1 - a.p) : 0.0);
  const T* in = source.data<T>();
  T* out = result.data<T>();
  // Rows of the innermost dim: their global indices are consecutive.
  const int64_t rows = count / inner;
  parallel_ranges(
      rows,
      [&](int64_t lo, int64_t hi) TESSERA_LOOP_BODY {
        // Locals, so that the stores through out cannot change them (the loop vectorises).
        const T factor = keep;
        const uint64_t seed_bits = mixed_seed, bar = threshold;
        for (int64_t row = lo; row < hi; ++row) {
          uint64_t first = 0;
          int64_t rest = row;
          for (int d = ndim - 2; d >= 0; --d) {
            first += static_cast<uint64_t>((box.lo[d] + rest % shape[d]) * strides[d]);
            rest /= shape[d];
          }
          if (ndim > 0) first += static_cast<uint64_t>(box.lo[ndim - 1]);
          const T* x = in + row * inner;
          T* y = out + row * inner;
          for (int64_t j = 0; j < inner; ++j) {
            const uint64_t bits = kernels::splitmix64(seed_bits ^ (first + uint64_t(j)));
            y[j] = x[j] * ((bits >> 11) >= bar ? factor : T(0));
          }
        }
      },
      std::max<int64_t>(1, (int64_t{1} << 15) / inner));
  return result;
}

/// t times the mask of its piece (t's dtype, on t's device).
Tensor apply_mask(const DropoutAttrs& a, const Tensor& t, const Shape& global, const Box& box) {
  if (!a.training || a.p == 0) return t.clone();
  if (t.device().is_cuda())
    return dropout_cuda(t, global, box, a.seed, a.p, compute_stream_for(t.device()));
  if (t.dtype() == DType::f32) return apply_mask_typed<float>(a, t, global, box);
  if (t.dtype() == DType::f64) return apply_mask_typed<double>(a, t, global, box);
  const Tensor factors = mask_of(a, global, box).to_dtype(t.dtype());
  return zip_elements(t, factors, [](double v, double f) { return v * f; });
}

}  // namespace

bool dropout_keeps(uint64_t seed, uint64_t index, double p) {
  return kernels::dropout_keeps(seed, index, p);
}

void register_dropout_ops() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
    check_arg(inputs.size() == 1, "dropout", "expects 1 input (x), got {}", inputs.size());
    attrs_of(attrs);
    const ShardSpec layout = without_partial(inputs[0]);
    return OpRule{{layout}, {std::nullopt}, {layout}};
  };
  KernelFn kernel = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    if (!inputs[0].device().is_cuda()) require_floating_cpu(inputs[0], "dropout");
    return std::vector<Tensor>{apply_mask(attrs_of(context.attrs), inputs[0],
                                          context.input_specs[0].global_shape,
                                          context.input_boxes[0])};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const ShardTensor& x = record.inputs[0];
    const ShardTensor g = grads[0]->spec() == x.spec()
                              ? *grads[0]
                              : grads[0]->redistribute(x.placements(), x.spec().extents);
    return {ShardTensor(
        apply_mask(attrs_of(record.attrs), g.to_local(), x.global_shape(), x.local_box()), x.mesh(),
        x.spec())};
  };
  register_op(OpDef{.name = "dropout",
                    .summary = "x zeroed with probability p, kept elements scaled by 1/(1-p); the "
                               "mask a function of seed and global index",
                    .inputs = {{.name = "x"}},
                    .outputs = {"y"},
                    .attrs = {{.name = "p",
                               .type = AttrType::float_scalar,
                               .default_value = 0.5,
                               .doc = "the probability of zeroing an element"},
                              {.name = "seed",
                               .type = AttrType::int_scalar,
                               .default_value = int64_t{0},
                               .doc = "the mask's seed"},
                              {.name = "training",
                               .type = AttrType::boolean,
                               .default_value = int64_t{1},
                               .doc = "0: the identity"}},
                    .rule = std::move(rule),
                    .cpu = kernel,
                    .cuda = kernel,
                    .backward = std::move(backward)});
}

ShardTensor dropout(const ShardTensor& x, double p, uint64_t seed, bool training) {
  return apply_op("dropout", {x},
                  OpAttrs()
                      .set("p", p)
                      .set("seed", static_cast<int64_t>(seed))
                      .set("training", int64_t{training ? 1 : 0}))[0];
}

}  // namespace tessera::ops
