// Helpers shared by the built-in ops.
#include "ops/op_helpers.hpp"

#include <algorithm>

#include "core/halo/halo_exchange.hpp"

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

ShardSpec param_grad_layout(const ShardSpec& x, const ShardSpec& param) {
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
  for (size_t m = 0; m < param.placements.size(); ++m) {
    if (param.placements[m].is_shard()) {
      placements.push_back(param.placements[m]);
      extents.push_back(param.extents[m]);
    } else {
      placements.push_back(x.placements[m].is_shard() ? Placement::partial(ReduceOp::sum)
                                                      : Placement::replicate());
      extents.emplace_back();
    }
  }
  return ShardSpec::make(param.global_shape, param.mesh_shape, placements, extents);
}

std::vector<int64_t> strided_output_extents(const std::vector<int64_t>& input_extents,
                                            int64_t length, int64_t outputs, int64_t stride) {
  const std::vector<int64_t> offsets = offsets_of(input_extents);
  std::vector<int64_t> counts(input_extents.size(), 0);
  if (length <= 0) {
    for (int64_t o = 0; o < outputs; ++o)
      ++counts[owner_of(std::clamp<int64_t>(o * stride, 0, length - 1), input_extents)];
    return counts;
  }
  // In closed form (outputs can be huge with a huge padding): a non-empty part owning inputs
  // [a, b) gets the outputs o with a <= o*stride < b; those past the input (o*stride >= length)
  // go to the owner of the last input.
  auto first_output_at = [&](int64_t index) {  // the first o with o*stride >= index
    return std::min(outputs, index / stride + (index % stride != 0 ? 1 : 0));
  };
  for (size_t p = 0; p < input_extents.size(); ++p)
    if (input_extents[p] > 0)
      counts[p] = first_output_at(offsets[p + 1]) - first_output_at(offsets[p]);
  counts[owner_of(length - 1, input_extents)] += outputs - first_output_at(length);
  return counts;
}

std::vector<int64_t> source_output_extents(const std::vector<int64_t>& input_extents,
                                           int64_t length, int64_t outputs,
                                           const std::function<int64_t(int64_t)>& source) {
  std::vector<int64_t> counts(input_extents.size(), 0);
  for (int64_t o = 0; o < outputs; ++o)
    ++counts[owner_of(std::clamp<int64_t>(source(o), 0, length - 1), input_extents)];
  return counts;
}

std::vector<int64_t> upsampled_output_extents(const std::vector<int64_t>& input_extents,
                                              int64_t length, int64_t outputs, int64_t stride,
                                              int64_t offset) {
  const std::vector<int64_t> offsets = offsets_of(input_extents);
  std::vector<int64_t> counts(input_extents.size(), 0);
  if (length <= 0) {
    if (!counts.empty()) counts.back() += outputs;
    return counts;
  }
  // A non-empty part owning inputs [a, b) gets the outputs o with a*stride <= o + offset <
  // b*stride; the outputs before input 0's and past input length-1's go to their owners.
  auto first_output_at = [&](int64_t index) {  // the first o with o + offset >= index*stride
    if (index <= 0) return int64_t{0};
    if (index >= length) return outputs;
    return std::clamp<int64_t>(index * stride - offset, 0, outputs);
  };
  for (size_t p = 0; p < input_extents.size(); ++p)
    if (input_extents[p] > 0)
      counts[p] = first_output_at(offsets[p + 1]) - first_output_at(offsets[p]);
  return counts;
}

void require_floating_cpu(const Tensor& tensor, const std::string& op) {
  TESSERA_CHECK_ARG(is_floating(tensor.dtype()), op, "needs a floating tensor, got {}",
                    tensor.str());
  TESSERA_CHECK_ARG(tensor.device().is_cpu(), op, "cpu kernel got a {} tensor",
                    tensor.device().str());
}

std::vector<std::optional<ShardTensor>> single_input_halo_backward(
    const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads,
    const HaloedBackward& local) {
  const ShardTensor& x = record.inputs[0];
  if (!grads[0]) return {std::nullopt};  // no gradient reached y (only another output's)
  const ShardSpec& y = record.outputs[0].spec();
  const ShardTensor g =
      grads[0]->spec() == y ? *grads[0] : grads[0]->redistribute(y.placements, y.extents);
  const Tensor& x_haloed = record.kernel_inputs[0];
  const HaloPlan* plan = record.plans[0].get();  // null: the kernel read the owned piece
  const Tensor g_local = g.to_local();
  // Estimate mode: the haloed piece's gradient is shape-only, the local step skipped; its halo
  // cells still travel back below.
  const Tensor dx_haloed =
      g_local.is_shape_only() || x_haloed.is_shape_only()
          ? Tensor::empty(x_haloed.shape(), x_haloed.dtype(), x_haloed.device())
          : local(g_local, x_haloed, plan ? plan->needed_box() : x.local_box());
  const Tensor dx = plan ? halo_adjoint(*plan, dx_haloed, x.mesh().comm()) : dx_haloed;
  std::vector<std::optional<ShardTensor>> result;
  result.emplace_back(ShardTensor(dx, x.mesh(), x.spec()));
  return result;
}

}  // namespace tessera::ops
