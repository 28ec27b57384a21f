// permute: rule, kernel, backward and registration (permute_op.hpp).
#include "ops/permute/permute_op.hpp"

#include <fmt/ranges.h>

#include <algorithm>

#include "core/autograd.hpp"
#include "core/backend/backend.hpp"
#include "core/op_registry.hpp"
#include "core/runtime/rank_context.hpp"

namespace tessera::ops {

namespace {

/// `dims` checked to be a permutation of 0..ndim-1, negative entries from the end.
std::vector<int64_t> normalized_dims(const std::vector<int64_t>& dims, int64_t ndim) {
  check_arg(static_cast<int64_t>(dims.size()) == ndim, "permute",
            "attribute 'dims' = [{}] names {} dims for a {}-d input", fmt::join(dims, ", "),
            dims.size(), ndim);
  std::vector<int64_t> result;
  std::vector<bool> seen(static_cast<size_t>(ndim), false);
  for (int64_t dim : dims) {
    check_arg(dim >= -ndim && dim < ndim, "permute",
              "attribute 'dims' = [{}]: dim {} is out of range for a {}-d input",
              fmt::join(dims, ", "), dim, ndim);
    const int64_t d = dim < 0 ? dim + ndim : dim;
    check_arg(!seen[d], "permute", "attribute 'dims' = [{}] names dim {} twice",
              fmt::join(dims, ", "), d);
    seen[d] = true;
    result.push_back(d);
  }
  return result;
}

std::vector<int64_t> inverse_of(const std::vector<int64_t>& dims) {
  std::vector<int64_t> inverse(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inverse[dims[i]] = static_cast<int64_t>(i);
  return inverse;
}

/// This rank's piece permuted, on its device: a strided copy reading the input through permuted
/// strides into a contiguous tensor.
Tensor permute_local(const Tensor& x, const std::vector<int64_t>& dims) {
  std::vector<int64_t> shape, strides;
  for (int64_t d : dims) {
    shape.push_back(x.shape(static_cast<int>(d)));
    strides.push_back(x.strides()[d]);
  }
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  // Estimate mode: a shape-only piece has nothing to copy.
  if (out.numel() == 0 || x.is_shape_only()) return out;
  const StridedRef source = strided_ref(x);
  const StridedRef permuted{source.data, shape.data(), strides.data(), source.ndim};
  backend_for(x.device())
      .copy(strided_ref(out), permuted, x.element_size(), compute_stream_for(x.device()));
  return out;
}

/// permute of a ShardTensor in any layout, with no communication.
ShardTensor permute_sharded(const ShardTensor& x, const std::vector<int64_t>& dims) {
  return ShardTensor(permute_local(x.to_local(), dims), x.mesh(), permuted_spec(x.spec(), dims));
}

}  // namespace

ShardSpec permuted_spec(const ShardSpec& spec, const std::vector<int64_t>& dims_in) {
  const std::vector<int64_t> dims =
      normalized_dims(dims_in, static_cast<int64_t>(spec.global_shape.size()));
  const std::vector<int64_t> inverse = inverse_of(dims);
  Shape shape;
  for (int64_t d : dims) shape.push_back(spec.global_shape[d]);
  std::vector<Placement> placements = spec.placements;
  for (Placement& placement : placements)
    if (placement.is_shard()) placement.dim = static_cast<int>(inverse[placement.dim]);
  return ShardSpec::make(shape, spec.mesh_shape, placements, spec.extents, "permute");
}

void register_permute_ops() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
    check_arg(inputs.size() == 1, "permute", "expects 1 input (x), got {}", inputs.size());
    return OpRule{{inputs[0]}, {std::nullopt}, {permuted_spec(inputs[0], attrs.get_ints("dims"))}};
  };
  KernelFn kernel = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    return std::vector<Tensor>{permute_local(
        inputs[0], normalized_dims(context.attrs.get_ints("dims"), inputs[0].ndim()))};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const std::vector<int64_t> dims =
        normalized_dims(record.attrs.get_ints("dims"),
                        static_cast<int64_t>(record.inputs[0].global_shape().size()));
    // The gradient in whatever layout it came, relabelled back: still no communication.
    return {permute_sharded(*grads[0], inverse_of(dims))};
  };
  register_op(OpDef{.name = "permute",
                    .summary = "torch.permute: output dim i is input dim dims[i]; sharded dims "
                               "move with the data, no communication",
                    .inputs = {{.name = "x"}},
                    .outputs = {"y"},
                    .attrs = {{.name = "dims",
                               .type = AttrType::int_list,
                               .required = true,
                               .doc = "a permutation of the input's dims (negative from the end)"}},
                    .rule = std::move(rule),
                    .cpu = kernel,
                    .cuda = kernel,
                    .backward = std::move(backward)});
}

ShardTensor permute(const ShardTensor& x, const std::vector<int64_t>& dims) {
  return apply_op("permute", {x}, OpAttrs().set("dims", dims))[0];
}

}  // namespace tessera::ops
