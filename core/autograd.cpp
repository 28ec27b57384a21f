// The autograd tape (see autograd.hpp).
#include "core/autograd.hpp"

#include <fmt/format.h>

#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "core/tensor_arith.hpp"
#include "core/trace.hpp"

namespace tessera {

namespace {

thread_local Tape* active_tape = nullptr;
thread_local int no_grad_depth = 0;

/// Hooks by leaf id, process-wide (ranks of the local backend are threads).
struct HookRegistry {
  std::mutex mutex;
  uint64_t next_token = 1;
  std::map<uint64_t, std::vector<std::pair<uint64_t, GradHook>>> hooks;
  std::map<uint64_t, std::pair<uint64_t, GradHook>> sinks;  // at most one per leaf
};

HookRegistry& hook_registry() {
  static HookRegistry* registry = new HookRegistry;  // never destroyed: handles may outlive exit
  return *registry;
}

/// The hooks registered for `leaf` now (copied: a hook may register or drop hooks).
std::vector<GradHook> hooks_of(uint64_t leaf) {
  HookRegistry& registry = hook_registry();
  std::lock_guard lock(registry.mutex);
  std::vector<GradHook> found;
  auto it = registry.hooks.find(leaf);
  if (it != registry.hooks.end())
    for (const auto& [token, hook] : it->second) found.push_back(hook);
  return found;
}

/// The sink that takes over `leaf`'s gradient, or null.
GradHook sink_of(uint64_t leaf) {
  HookRegistry& registry = hook_registry();
  std::lock_guard lock(registry.mutex);
  auto it = registry.sinks.find(leaf);
  return it == registry.sinks.end() ? GradHook() : it->second.second;
}

/// The layout of a gradient whose value is replicated where `spec` holds partial values: the
/// gradient of every partial term of a sum is the gradient of the sum.
ShardSpec gradient_layout(const ShardSpec& spec, const std::string& op) {
  ShardSpec layout = spec;
  for (Placement& placement : layout.placements) {
    if (!placement.is_partial()) continue;
    check_arg(placement.reduce == ReduceOp::sum || placement.reduce == ReduceOp::avg, op,
              "no gradient through a Partial({}) layout (only sum and avg are differentiable)",
              reduce_op_name(placement.reduce));
    placement = Placement::replicate();
  }
  return layout;
}

/// Scales a local tensor by `factor` (gradient of Partial(avg)), on its device.
Tensor scaled(const Tensor& tensor, double factor) {
  Tensor result = tensor.clone();
  backend_for(result.device())
      .scale(strided_ref(result), result.dtype(), factor, compute_stream_for(result.device()));
  return result;
}

const std::shared_ptr<const OpDef>& redistribute_op() {
  static const auto op = std::make_shared<const OpDef>(OpDef{
      .name = "redistribute",
      .summary = "A layout change recorded for autograd (not registered)",
      .backward = [](const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads)
          -> std::vector<std::optional<ShardTensor>> {
        if (!grads[0]) return {std::nullopt};
        const ShardSpec& source = record.inputs[0].spec();
        const ShardSpec layout = gradient_layout(source, "redistribute");
        ShardTensor grad = grads[0]->redistribute_to(layout);
        double factor = 1;
        for (size_t m = 0; m < source.placements.size(); ++m)
          if (source.placements[m].is_partial() && source.placements[m].reduce == ReduceOp::avg)
            factor /= source.mesh_shape[m];
        if (factor != 1)
          grad = ShardTensor(scaled(grad.to_local(), factor), grad.mesh(), grad.spec());
        return {grad};
      }});
  return op;
}

}  // namespace

Tape::Tape() : previous_(active_tape) {
  active_tape = this;
}
Tape::Tape(Idle) : restores_(false) {}
Tape::~Tape() {
  if (restores_) active_tape = previous_;
}

TapeScope::TapeScope(Tape& tape) : previous_(active_tape) {
  active_tape = &tape;
}
TapeScope::~TapeScope() {
  active_tape = previous_;
}
Tape* Tape::active() {
  return no_grad_depth > 0 ? nullptr : active_tape;
}

void Tape::record(OpRecord record) {
  check_arg(!released_, record.op ? record.op->name : "backward",
            "recording on a tape whose saved tensors a backward pass released (use a new Tape "
            "per step, or backward with retain_graph)");
  for (const ShardTensor& input : record.inputs)
    if (input.requires_grad() && !produced_.count(input.id())) {
      leaves_.emplace(input.id(), input);
      first_use_.emplace(input.id(), records_.size());
    }
  for (const ShardTensor& output : record.outputs) produced_.insert(output.id());
  records_.push_back(std::move(record));
}

ShardTensor add_same_shape(const ShardTensor& a, const ShardTensor& b) {
  check_arg(a.global_shape() == b.global_shape(), "add", "shapes {} and {}", a.global_shape(),
            b.global_shape());
  const ShardTensor moved = b.spec() == a.spec() ? b : b.redistribute_to(a.spec());
  Tensor sum = a.to_local().clone();
  add_into(sum, moved.to_local().to(a.device()));
  return ShardTensor(sum, a.mesh(), a.spec());
}

void Tape::backward(const ShardTensor& loss, bool retain_graph) {
  check_arg(shape_numel(loss.global_shape()) == 1, "backward",
            "backward() needs a scalar loss, got global shape {}", loss.global_shape());
  const ShardSpec layout = gradient_layout(loss.spec(), "backward");
  Tensor ones = Tensor::empty(layout.local_shape(loss.mesh().coord()), loss.dtype(), loss.device());
  ones.fill(1);
  backward(loss, ShardTensor(ones, loss.mesh(), layout), retain_graph);
}

namespace {

/// The bytes from a tensor's first element to its last (strides are never negative here); empty
/// for a tensor without elements or data.
std::pair<const char*, const char*> byte_span(const Tensor& t) {
  if (t.numel() == 0 || t.is_shape_only()) return {nullptr, nullptr};
  int64_t last = 0;
  for (int d = 0; d < t.ndim(); ++d) last += (t.shape()[d] - 1) * t.strides()[d];
  const auto* first = static_cast<const char*>(t.raw_data());
  return {first, first + (last + 1) * static_cast<int64_t>(t.element_size())};
}

/// Whether two tensors' spans of memory overlap (views of one buffer that may share elements).
bool bytes_overlap(const Tensor& a, const Tensor& b) {
  const auto [a_lo, a_hi] = byte_span(a);
  const auto [b_lo, b_hi] = byte_span(b);
  return a_lo != nullptr && b_lo != nullptr && a_lo < b_hi && b_lo < a_hi;
}

}  // namespace

void Tape::backward(const ShardTensor& output, const ShardTensor& output_grad, bool retain_graph) {
  CommOpScope scope("backward");
  check_arg(!released_, "backward",
            "a second backward pass through a tape whose saved tensors the first one released "
            "(pass retain_graph = true to the first)");
  check_arg(output_grad.global_shape() == output.global_shape(), "backward",
            "gradient of global shape {} for an output of shape {}", output_grad.global_shape(),
            output.global_shape());
  Tape* previous = active_tape;
  active_tape = nullptr;  // the backward pass itself is not recorded
  std::map<uint64_t, ShardTensor> pending;
  pending.emplace(output.id(), output_grad);
  // Gradients move from the backward that made them to the map and on to the next backward:
  // a ShardTensor copy costs several allocations, which a small op's backward notices.
  auto accumulate = [&](const ShardTensor& target, ShardTensor grad) {
    auto it = pending.find(target.id());
    if (it == pending.end())
      pending.emplace(target.id(), std::move(grad));
    else
      it->second = add_same_shape(it->second, grad);
  };
  // Leaves whose gradient is final once the record at each index has run backward.
  std::map<size_t, std::vector<uint64_t>> final_after;
  for (const auto& [id, index] : first_use_) final_after[index].push_back(id);
  // Backwards that pass the gradient through (add's, concat's, permute's) hand it out, or views
  // of it, without a copy; a leaf's gradient is copied only where it would still share memory
  // with the gradient the caller passed in, which the caller may reuse. Leaves handed the same
  // view (both operands of an add) share one copy: gradients are never written in place.
  const Tensor& caller_grad = output_grad.to_local();
  std::vector<std::pair<Tensor, Tensor>> copies;  // a view of the caller's gradient, its copy
  auto own = [&](ShardTensor grad) {
    const Tensor& local = grad.to_local();
    if (!bytes_overlap(local, caller_grad)) return grad;
    for (const auto& [view, copy] : copies)
      if (view.raw_data() == local.raw_data() && view.dtype() == local.dtype() &&
          view.shape() == local.shape() && view.strides() == local.strides())
        return ShardTensor(copy, grad.mesh(), grad.spec());
    copies.emplace_back(local, local.clone());
    return ShardTensor(copies.back().second, grad.mesh(), grad.spec());
  };
  // Gives a leaf its gradient in its own layout (pending partial sums reduce here, once) and
  // runs its hooks.
  auto finalize = [&](uint64_t id) {
    auto it = pending.find(id);
    if (it == pending.end()) return;
    if (GradHook sink = sink_of(id)) {  // a reducer takes the unreduced gradient
      const ShardTensor grad = own(std::move(it->second));
      pending.erase(it);
      sink(grad);
      return;
    }
    const ShardTensor& leaf = leaves_.at(id);
    const ShardSpec layout = gradient_layout(leaf.spec(), "backward");
    ShardTensor grad = own(it->second.spec() == layout ? std::move(it->second)
                                                       : it->second.redistribute_to(layout));
    pending.erase(it);
    const std::vector<GradHook> hooks = hooks_of(id);
    auto existing = grads_.find(id);
    if (existing != grads_.end())
      existing->second = add_same_shape(existing->second, grad);
    else if (hooks.empty())
      grads_.emplace(id, std::move(grad));
    else
      grads_.emplace(id, grad);
    for (const GradHook& hook : hooks) hook(grad);
  };
  try {
    for (size_t index = records_.size(); index-- > 0;) {
      OpRecord* record = &records_[index];
      std::vector<std::optional<ShardTensor>> output_grads;
      bool any = false;
      for (const ShardTensor& output : record->outputs) {
        auto it = pending.find(output.id());
        if (it == pending.end()) {
          output_grads.emplace_back(std::nullopt);
          continue;
        }
        output_grads.emplace_back(std::move(it->second));
        pending.erase(it);
        any = true;
      }
      if (any) {
        CommOpScope op_scope(record->op->name + " backward");
        trace::Span span("op", record->op->name + " backward");
        if (span.recording()) {
          const OpCost cost = backward_cost(*record);
          span.real_arg("flops", cost.flops);
          span.real_arg("bytes", cost.bytes);
        }
        auto input_grads = record->op->backward(*record, output_grads);
        check_arg(input_grads.size() == record->inputs.size(), record->op->name,
                  "backward returned {} gradients for {} inputs", input_grads.size(),
                  record->inputs.size());
        for (size_t i = 0; i < input_grads.size(); ++i)
          if (input_grads[i] && record->inputs[i].requires_grad())
            accumulate(record->inputs[i], std::move(*input_grads[i]));
      }
      // This record will not be read again: its saved tensors go now.
      if (!retain_graph) {
        record->inputs.clear();
        record->kernel_inputs.clear();
        record->plans.clear();
        record->outputs.clear();
      }
      if (auto final = final_after.find(index); final != final_after.end())
        for (uint64_t id : final->second) finalize(id);
    }
  } catch (...) {
    active_tape = previous;
    throw;
  }
  active_tape = previous;
  if (!retain_graph) released_ = true;
}

std::optional<ShardTensor> Tape::grad(const ShardTensor& leaf) const {
  auto it = grads_.find(leaf.id());
  if (it == grads_.end()) return std::nullopt;
  return it->second;
}

void record_redistribute(const ShardTensor& x, ShardTensor& y) {
  Tape* tape = Tape::active();
  if (!tape || !x.requires_grad()) return;
  y.set_requires_grad(true);
  tape->record(OpRecord{redistribute_op(), {}, {}, {x}, {}, {}, {y}});
}

NoGrad::NoGrad() {
  ++no_grad_depth;
}

NoGrad::~NoGrad() {
  --no_grad_depth;
}

GradHookHandle register_grad_hook(uint64_t leaf, GradHook hook) {
  HookRegistry& registry = hook_registry();
  std::lock_guard lock(registry.mutex);
  const uint64_t token = registry.next_token++;
  registry.hooks[leaf].emplace_back(token, std::move(hook));
  return GradHookHandle(leaf, token);
}

GradHookHandle set_grad_sink(uint64_t leaf, GradHook sink) {
  HookRegistry& registry = hook_registry();
  std::lock_guard lock(registry.mutex);
  check_arg(!registry.sinks.contains(leaf), "autograd",
            "leaf {} already has a gradient sink (one reducer per parameter)", leaf);
  const uint64_t token = registry.next_token++;
  registry.sinks.emplace(leaf, std::make_pair(token, std::move(sink)));
  return GradHookHandle(leaf, token);
}

GradHookHandle::~GradHookHandle() {
  if (token_ == 0) return;
  HookRegistry& registry = hook_registry();
  std::lock_guard lock(registry.mutex);
  if (auto sink = registry.sinks.find(leaf_);
      sink != registry.sinks.end() && sink->second.first == token_) {
    registry.sinks.erase(sink);
    return;
  }
  auto it = registry.hooks.find(leaf_);
  if (it == registry.hooks.end()) return;
  std::erase_if(it->second, [&](const auto& entry) { return entry.first == token_; });
  if (it->second.empty()) registry.hooks.erase(it);
}

GradHookHandle::GradHookHandle(GradHookHandle&& other) noexcept
    : leaf_(other.leaf_), token_(std::exchange(other.token_, 0)) {}

GradHookHandle& GradHookHandle::operator=(GradHookHandle&& other) noexcept {
  if (this != &other) {
    GradHookHandle dropped(std::move(*this));
    leaf_ = other.leaf_;
    token_ = std::exchange(other.token_, 0);
  }
  return *this;
}

}  // namespace tessera
