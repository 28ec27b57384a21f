// cast: rule, kernels, backward and registration.
//
// The rule keeps x's layout as it is (Partial included): converting each rank's partial term is
// what the caller asked for, and widening (bf16 -> f32, the gradient direction of mixed
// precision) is exact, so the reduction that follows runs in the wider dtype.
#include "ops/cast/cast_op.hpp"

#include "core/errors.hpp"
#include "core/op_registry.hpp"

namespace tessera::ops {

namespace {

DType target_of(const OpAttrs& attrs) {
  const DType dtype = dtype_from_name(attrs.get_string("dtype"));
  check_arg(is_floating(dtype), "cast", "attribute 'dtype' = {} is not a floating dtype",
            dtype_name(dtype));
  return dtype;
}

}  // namespace

void register_cast_ops() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
    check_arg(inputs.size() == 1, "cast", "expects 1 input (x), got {}", inputs.size());
    target_of(attrs);
    return OpRule{{inputs[0]}, {std::nullopt}, {inputs[0]}};
  };
  KernelFn kernel = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    const DType dtype = target_of(context.attrs);
    check_arg(is_floating(inputs[0].dtype()), "cast", "input dtype {} is not floating",
              dtype_name(inputs[0].dtype()));
    // to_dtype returns the tensor itself for an equal dtype; the output must own its storage.
    return std::vector<Tensor>{inputs[0].dtype() == dtype ? inputs[0].clone()
                                                          : inputs[0].to_dtype(dtype)};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    return {cast(*grads[0], record.inputs[0].dtype())};
  };
  register_op(OpDef{.name = "cast",
                    .summary = "x converted to another floating dtype (round to nearest even); "
                               "the gradient cast back to x's dtype",
                    .inputs = {{.name = "x"}},
                    .outputs = {"y"},
                    .attrs = {{.name = "dtype",
                               .type = AttrType::string,
                               .default_value = std::string("f32"),
                               .doc = "f32, f64, f16 or bf16"}},
                    .rule = std::move(rule),
                    .cpu = kernel,
                    .cuda = kernel,
                    .backward = std::move(backward)});
}

ShardTensor cast(const ShardTensor& x, DType dtype) {
  check_arg(is_floating(dtype), "cast", "dtype {} is not floating (f32, f64, f16 or bf16)",
            dtype_name(dtype));
  if (x.dtype() == dtype) return x;
  return apply_op("cast", {x}, OpAttrs().set("dtype", std::string(dtype_name(dtype))))[0];
}

}  // namespace tessera::ops
