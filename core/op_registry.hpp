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
#include "core/op_schema.hpp"
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
  /// Per output, the dtype the kernel makes when it is not the first input's (max_pool's i64
  /// indices); empty or nullopt: the first input's (or the attribute "dtype"'s). Read where no
  /// kernel runs (estimate mode's shape-only outputs).
  std::vector<std::optional<DType>> output_dtypes{};
};

/// Haloed inputs whose interior (where the rank's owned piece goes) the halo exchange left
/// unfilled, for an op that reads the owned piece where it lies (OpDef::owned_in_place). Each
/// fill is traced as a `halo_fill` event with the bytes it copies.
class UnfilledInteriors {
 public:
  /// Input i's owned piece when the interior of its haloed tensor is unfilled, else nullptr
  /// (no halo, or filled). Valid until the next fill.
  const Tensor* owned(size_t i) const;
  /// The box of input i's haloed tensor that its owned piece fills (local coordinates), for an
  /// input whose owned(i) is not null. Valid until the next fill.
  const Box& box(size_t i) const;
  /// Copies input i's owned piece into the interior of `haloed` (input i's haloed tensor), once:
  /// for kernels that need the whole haloed tensor. Does nothing when it is already whole.
  void fill(size_t i, const Tensor& haloed) const;
  /// Fills every unfilled interior of `haloed` (the kernel's inputs).
  void fill_all(const std::vector<Tensor>& haloed) const;
  /// The registry's: input i's interior `box` is unfilled and `owned` holds it.
  void add(size_t i, Tensor owned, Box box);

 private:
  struct Entry {
    size_t input;
    Tensor owned;
    Box box;
  };
  // Mutable: filling an interior (from a kernel, which sees a const context) retires its entry.
  mutable std::vector<Entry> entries_;
};

/// What a local kernel is told about its pieces.
struct KernelContext {
  const DeviceMesh& mesh;
  const OpAttrs& attrs;
  std::vector<ShardSpec> input_specs;   ///< layouts of the inputs
  std::vector<Box> input_boxes;         ///< global box of each local input (haloed: unwrapped)
  std::vector<ShardSpec> output_specs;  ///< layouts of the outputs
  std::vector<Box> output_boxes;        ///< global box of each local output
  std::vector<Box> owned_boxes;         ///< global box each input's rank owns (no halo)
  Device device = Device::cpu();        ///< where the inputs live and the outputs must be made
  Stream stream{};  ///< where a cuda kernel queues its work (never synchronizing the device)
  UnfilledInteriors interiors{};  ///< inputs whose owned piece the kernel reads in place
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

/// A kernel in two parts, so that compute overlaps the halo exchange. `interior` runs while the
/// halos are in flight: its haloed inputs hold valid values only inside context.owned_boxes (and
/// where the plan pads with zeros), and it returns the outputs with every element it can compute
/// from those (the rest may hold anything). `boundary` runs once every halo has landed, on the
/// complete inputs, and finishes the outputs in place. Together they must give exactly what the
/// plain kernel gives.
struct OverlapKernel {
  std::function<std::vector<Tensor>(const KernelContext& context,
                                    const std::vector<Tensor>& inputs)>
      interior;
  std::function<void(const KernelContext& context, const std::vector<Tensor>& inputs,
                     std::vector<Tensor>& outputs)>
      boundary;
};

/// What one call of an op's local kernel costs: floating-point operations and bytes read plus
/// written (what a roofline model needs; recorded on the op's trace event).
struct OpCost {
  double flops = 0;
  double bytes = 0;
};

/// The cost of the local kernel from its context and its local (haloed) inputs and outputs
/// (read for their shapes and dtypes only: they may hold no data).
using CostFn = std::function<OpCost(const KernelContext& context, const std::vector<Tensor>& inputs,
                                    const std::vector<Tensor>& outputs)>;

/// A registered op. Built with designated initializers, e.g.
///   OpDef{.name = "laplacian7", .summary = "...", .inputs = {{.name = "u"}},
///         .outputs = {"y"}, .attrs = {...}, .rule = rule, .cpu = kernel, .backward = backward}
/// The signature (summary, inputs, outputs, attrs) is what `tessera ops` lists and `tessera
/// run-op` reads and writes by; an op that declares its inputs has declared its signature, and
/// apply_op then refuses attributes it does not declare, of the wrong type, or missing when
/// required (an op without declared inputs takes any attributes).
struct OpDef {
  std::string name{};
  std::string summary{};          ///< one line
  std::vector<OpInput> inputs{};  ///< positional; optional ones last
  std::vector<std::string> outputs{};
  std::vector<OpAttr> attrs{};
  RuleFn rule{};          ///< empty: fallback (replicate the inputs, run, re-shard), logged once
  KernelFn cpu{};         ///< kernel for cpu tensors
  KernelFn cuda{};        ///< kernel for cuda tensors (empty: not available on cuda)
  BackwardFn backward{};  ///< empty: not differentiable
  /// Optional split of the cpu kernel, used instead of `cpu` when an input has a halo and
  /// overlap is on (halo_overlap(Device::Kind::cpu)).
  std::optional<OverlapKernel> cpu_overlap = std::nullopt;
  /// The same for the cuda kernel: `interior` is queued on the compute stream while the halos
  /// travel, `boundary` after halo_end has ordered the compute stream after them.
  std::optional<OverlapKernel> cuda_overlap = std::nullopt;
  /// Whether this call's cpu kernels (`cpu` and `cpu_overlap`) read haloed input i's owned
  /// piece where it lies (empty: never). For a haloed input on the cpu, apply_op starts the
  /// exchange without copying the owned piece into the haloed tensor's interior
  /// (halo_begin_around), then asks: `inputs` are the kernel's inputs (haloed ones with that
  /// interior unfilled), context.interiors holds the owned pieces. Where the answer is no, apply_op
  /// fills the interior (a `halo_fill` copy) before the kernel runs; where it is yes, the kernel
  /// reads the owned piece from context.interiors (a kernel that finds it cannot after all calls
  /// context.interiors.fill first). apply_op fills what is left before the tape records the call,
  /// so the backward sees whole haloed tensors. Asked in estimate mode too (on shape-only
  /// tensors), so that an estimate records the copies the real run makes.
  std::function<bool(const KernelContext& context, const std::vector<Tensor>& inputs, size_t i)>
      owned_in_place{};
  /// The local kernel's cost (empty: the bytes of the inputs and outputs, one flop per output
  /// element). Its backward is costed as twice the forward (the gradients of the inputs and of
  /// the weights each take about one forward).
  CostFn cost{};

  /// Whether the op declares its signature (inputs).
  bool has_signature() const { return !inputs.empty(); }
  /// "cpu", "cuda": the devices it has kernels for.
  std::vector<std::string> devices() const;
};

/// The cost of one call of `op`'s local kernel (its `cost`, or the default above).
OpCost op_cost(const OpDef& op, const KernelContext& context, const std::vector<Tensor>& inputs,
               const std::vector<Tensor>& outputs);

/// The cost of the backward of a recorded call: twice the forward's.
OpCost backward_cost(const OpRecord& record);

/// Whether apply_op overlaps halo exchanges with ops' interior compute on tensors of `kind`
/// (ops with an OverlapKernel, when halo cells come from other ranks). By default on for cuda
/// (the split runs on strided views into the haloed buffer) and off for cpu: the cpu conv
/// kernels take contiguous tensors, so the split copies its input and output regions, which on
/// one node costs more than the exchange it hides (docs/benchmarks.md).
/// TESSERA_HALO_OVERLAP=1 (or 0) turns both on (off) at start-up.
bool halo_overlap(Device::Kind kind = Device::Kind::cpu);
/// Turns the overlap on or off for every device kind (e.g. to measure what it saves).
void set_halo_overlap(bool on);
/// Turns the overlap on or off for tensors of one device kind.
void set_halo_overlap(Device::Kind kind, bool on);

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
