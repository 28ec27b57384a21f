// The op-rule API. A sharded op is a rule (input layouts + attributes -> the layouts the inputs
// must have, the halo each input needs, the output layouts), local kernels per device that run
// on the (haloed) local pieces, and a backward. Ops are registered by name; built-in ops are
// registered exactly the way a user registers one from outside the library (docs/op-rules.md).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/halo/halo_plan.hpp"
#include "core/op_attrs.hpp"
#include "core/shard_tensor.hpp"

namespace tessera {

/// The halo one input needs: the global box every mesh rank needs (may reach past the global
/// edges) and what lies beyond each edge.
struct HaloNeed {
  std::vector<Box> needed;             ///< one per mesh rank, global unwrapped indices
  std::vector<BoundaryMode> boundary;  ///< one per tensor dim
};

/// A rule's answer for given input layouts and attributes.
struct OpRule {
  std::vector<ShardSpec> inputs;               ///< layouts the inputs are redistributed to first
  std::vector<std::optional<HaloNeed>> halos;  ///< per input; nullopt = the owned piece as is
  std::vector<ShardSpec> outputs;              ///< output layouts (Partial placements allowed)
};

/// What a local kernel is told about its pieces.
struct KernelContext {
  const DeviceMesh& mesh;
  const OpAttrs& attrs;
  std::vector<ShardSpec> input_specs;   ///< layouts of the inputs
  std::vector<Box> input_boxes;         ///< global box of each local input (haloed: unwrapped)
  std::vector<ShardSpec> output_specs;  ///< layouts of the outputs
  std::vector<Box> output_boxes;        ///< global box of each local output
};

struct OpDef;

/// The forward call as backward sees it.
struct OpRecord {
  std::shared_ptr<const OpDef> op;  ///< kept alive even if the name is registered again
  OpAttrs attrs;
  OpRule rule;
  std::vector<ShardTensor> inputs;                     ///< in the rule's input layouts
  std::vector<Tensor> kernel_inputs;                   ///< local tensors the kernel got (haloed)
  std::vector<std::shared_ptr<const HaloPlan>> plans;  ///< per input; null without a halo
  std::vector<ShardTensor> outputs;
};

using RuleFn = std::function<OpRule(const std::vector<ShardSpec>& inputs, const OpAttrs& attrs)>;
using KernelFn = std::function<std::vector<Tensor>(const KernelContext& context,
                                                   const std::vector<Tensor>& inputs)>;
/// Gradients of the inputs (any layout; nullopt = none) from the gradients of the outputs
/// (nullopt where no gradient reached an output).
using BackwardFn = std::function<std::vector<std::optional<ShardTensor>>(
    const OpRecord& record, const std::vector<std::optional<ShardTensor>>& output_grads)>;

/// A registered op.
struct OpDef {
  std::string name;
  RuleFn rule;          ///< empty: fallback (replicate the inputs, run, re-shard), logged once
  KernelFn cpu;         ///< kernel for cpu tensors
  KernelFn cuda;        ///< kernel for cuda tensors (empty: not available on cuda)
  BackwardFn backward;  ///< empty: not differentiable
};

/// Registers `op` (replacing one of the same name, built-in ones included). Thread-safe.
void register_op(OpDef op);
/// The op called `name`; throws InvalidArgument listing the registered ops when unknown.
std::shared_ptr<const OpDef> find_op(const std::string& name);
/// Names of all registered ops (built-in ones included).
std::vector<std::string> registered_ops();

/// Collective: runs op `name`. Inputs are redistributed to the rule's layouts, halos are
/// exchanged, the device's kernel runs on every rank, and the outputs are wrapped in the
/// rule's layouts. Recorded on the active autograd tape when an input requires a gradient.
std::vector<ShardTensor> apply_op(const std::string& name, const std::vector<ShardTensor>& inputs,
                                  const OpAttrs& attrs = {});

/// The halo plan of `rank` for arbitrary needed boxes, from a process-wide cache.
std::shared_ptr<const HaloPlan> cached_halo_plan(const ShardSpec& spec, const HaloNeed& need,
                                                 int rank);

}  // namespace tessera
