// Helpers shared by the built-in ops.
#include "ops/op_helpers.hpp"

namespace tessera::ops {

ShardSpec without_partial(const ShardSpec& spec) {
  ShardSpec result = spec;
  for (Placement& placement : result.placements)
    if (placement.is_partial()) placement = Placement::replicate();
  return result;
}

ShardSpec partial_over_sharding(const ShardSpec& activation, const Shape& param_shape) {
  std::vector<Placement> placements;
  for (const Placement& placement : activation.placements)
    placements.push_back(placement.is_shard() ? Placement::partial(ReduceOp::sum)
                                              : Placement::replicate());
  return ShardSpec::make(param_shape, activation.mesh_shape, placements);
}

void require_floating_cpu(const Tensor& tensor, const std::string& op) {
  check_arg(is_floating(tensor.dtype()), op, "needs a floating tensor, got {}", tensor.str());
  check_arg(tensor.device().is_cpu(), op, "cpu kernel got a {} tensor", tensor.device().str());
}

}  // namespace tessera::ops
