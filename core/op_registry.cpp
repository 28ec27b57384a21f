// Op registry and apply_op (see op_registry.hpp).
#include "core/op_registry.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>

#include "core/agree.hpp"
#include "core/autograd.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/estimate/real_data.hpp"
#include "core/halo/halo_exchange.hpp"
#include "core/trace.hpp"

namespace tessera {

void register_builtin_ops();  // generated ops/builtin_ops.cpp (ops/CMakeLists.txt)

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<const OpDef>> ops;
  std::set<std::string> fallback_logged;
};

thread_local bool registering_builtins = false;

/// The registry, with the built-in ops registered first (once), so that a user's op of the
/// same name registered later replaces the built-in one.
Registry& registry() {
  static Registry* instance = new Registry;
  static std::once_flag builtins;
  if (!registering_builtins) {
    std::call_once(builtins, [] {
      registering_builtins = true;
      register_builtin_ops();
      registering_builtins = false;
    });
  }
  return *instance;
}

/// The kernel for the inputs' device.
const KernelFn& kernel_for(const OpDef& op, const std::vector<ShardTensor>& inputs) {
  const bool cuda = !inputs.empty() && inputs[0].device().is_cuda();
  const KernelFn& kernel = cuda ? op.cuda : op.cpu;
  check_arg(static_cast<bool>(kernel), op.name, "no {} kernel is registered",
            cuda ? "cuda" : "cpu");
  return kernel;
}

std::vector<Placement> without_partial_placements(std::vector<Placement> placements) {
  for (Placement& placement : placements)
    if (placement.is_partial()) placement = Placement::replicate();
  return placements;
}

bool any_requires_grad(const std::vector<ShardTensor>& inputs) {
  for (const ShardTensor& input : inputs)
    if (input.requires_grad()) return true;
  return false;
}

/// An op without a rule: replicate every input, run the kernel on full tensors, and give the
/// outputs the first input's layout when the shapes match (replicated otherwise).
std::vector<ShardTensor> apply_fallback(const std::shared_ptr<const OpDef>& definition,
                                        const std::vector<ShardTensor>& inputs,
                                        const OpAttrs& attrs) {
  const OpDef& op = *definition;
  const DeviceMesh& mesh = inputs.at(0).mesh();
  {
    Registry& r = registry();
    std::lock_guard lock(r.mu);
    if (r.fallback_logged.insert(op.name).second && mesh.rank() == 0)
      std::fprintf(stderr,
                   "[tessera] op '%s' has no sharding rule: running it replicated (gather, "
                   "compute, re-shard)\n",
                   op.name.c_str());
  }
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  std::vector<ShardTensor> full;
  KernelContext context{mesh, attrs, {}, {}, {}, {}, {}};
  context.device = inputs.at(0).device();
  context.stream = compute_stream_for(context.device);
  std::vector<Tensor> locals;
  for (const ShardTensor& input : inputs) {
    full.push_back(input.redistribute(replicated));
    context.input_specs.push_back(full.back().spec());
    context.input_boxes.push_back(Box::of_shape(input.global_shape()));
    locals.push_back(full.back().to_local());
  }
  const std::vector<Tensor> results = kernel_for(op, inputs)(context, locals);
  std::vector<ShardTensor> replicated_outputs;
  for (const Tensor& result : results)
    replicated_outputs.emplace_back(result, mesh,
                                    ShardSpec::make(result.shape(), mesh.shape(), replicated));
  // Recorded like any op (on replicated tensors), so a rule-less op with a backward is
  // differentiable.
  Tape* tape = Tape::active();
  if (tape && op.backward && any_requires_grad(full)) {
    for (ShardTensor& output : replicated_outputs)
      output.set_requires_grad(is_floating(output.dtype()));
    OpRule rule{context.input_specs, std::vector<std::optional<HaloNeed>>(inputs.size()), {}};
    for (const ShardTensor& output : replicated_outputs) rule.outputs.push_back(output.spec());
    tape->record(OpRecord{definition, attrs, std::move(rule), full, locals,
                          std::vector<std::shared_ptr<const HaloPlan>>(inputs.size()),
                          replicated_outputs});
  }
  std::vector<ShardTensor> outputs;
  for (const ShardTensor& output : replicated_outputs) {
    if (output.global_shape() != inputs[0].global_shape()) {
      outputs.push_back(output);
      continue;
    }
    const ShardSpec target = ShardSpec::make(output.global_shape(), mesh.shape(),
                                             without_partial_placements(inputs[0].placements()),
                                             inputs[0].spec().extents);
    outputs.push_back(output.redistribute_to(target));
  }
  return outputs;
}

/// The outputs of a kernel skipped in estimate mode: shape-only tensors of the rule's output
/// boxes, of the dtype the rule names for the output, else the one an attribute "dtype" names
/// (cast), else the first input's.
std::vector<Tensor> shape_only_outputs(const KernelContext& context, const OpRule& rule,
                                       const std::vector<ShardTensor>& inputs,
                                       const OpAttrs& attrs) {
  const DType dtype =
      attrs.has("dtype") ? dtype_from_name(attrs.get_string("dtype")) : inputs.at(0).dtype();
  std::vector<Tensor> outputs;
  for (size_t o = 0; o < context.output_boxes.size(); ++o) {
    const bool named = o < rule.output_dtypes.size() && rule.output_dtypes[o].has_value();
    outputs.push_back(Tensor::empty(context.output_boxes[o].shape(),
                                    named ? *rule.output_dtypes[o] : dtype, context.device));
  }
  return outputs;
}

}  // namespace

std::vector<std::string> OpDef::devices() const {
  std::vector<std::string> kinds;
  if (cpu) kinds.emplace_back("cpu");
  if (cuda) kinds.emplace_back("cuda");
  return kinds;
}

void register_op(OpDef op) {
  check_arg(!op.name.empty(), "ops", "an op needs a name");
  for (size_t i = 1; i < op.inputs.size(); ++i)
    check_arg(!op.inputs[i - 1].optional || op.inputs[i].optional, op.name,
              "optional input '{}' comes before required input '{}' (optional inputs come last)",
              op.inputs[i - 1].name, op.inputs[i].name);
  for (const OpAttr& attr : op.attrs) {
    check_arg(!(attr.required && attr.default_value), op.name,
              "attribute '{}' is required and has a default", attr.name);
    TESSERA_CHECK_ARG(!attr.default_value || attr_value_fits(*attr.default_value, attr.type),
                      op.name, "the default {} of attribute '{}' is not a {}",
                      attr.default_value ? attr_value_text(*attr.default_value) : "", attr.name,
                      attr_type_name(attr.type));
  }
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  const std::string name = op.name;
  r.ops[name] = std::make_shared<const OpDef>(std::move(op));
}

namespace {

/// The overlap switch of one device kind: TESSERA_HALO_OVERLAP=1 or 0 sets both at start-up;
/// unset, both are off. On cpu the split copies its regions out and back; on cuda its regions
/// are strided views of the haloed buffer, on which cuDNN runs slower kernels than on the whole
/// contiguous buffer (an H100, bf16 conv1d [8,64,262144] k5: 5.7 ms for the interior view of a
/// quarter against 3.2 ms for the whole unsplit tensor), more than the exchange it hides.
std::atomic<bool>& overlap_flag(Device::Kind kind) {
  static std::atomic<bool> flags[2] = {false, false};
  static const bool from_env = [] {
    if (const char* value = std::getenv("TESSERA_HALO_OVERLAP")) {
      const bool on = std::string(value) == "1";
      flags[0].store(on);
      flags[1].store(on);
    }
    return true;
  }();
  (void)from_env;
  return flags[kind == Device::Kind::cuda ? 1 : 0];
}

}  // namespace

bool halo_overlap(Device::Kind kind) {
  return overlap_flag(kind).load();
}

void set_halo_overlap(bool on) {
  overlap_flag(Device::Kind::cpu).store(on);
  overlap_flag(Device::Kind::cuda).store(on);
}

void set_halo_overlap(Device::Kind kind, bool on) {
  overlap_flag(kind).store(on);
}

std::shared_ptr<const OpDef> find_op(const std::string& name) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  const auto it = r.ops.find(name);
  if (it == r.ops.end()) {
    std::vector<std::string> names;
    for (const auto& entry : r.ops) names.push_back(entry.first);
    throw InvalidArgument("ops", fmt::format("no op named '{}' (registered: {})", name, names));
  }
  return it->second;
}

std::vector<std::string> registered_ops() {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  std::vector<std::string> names;
  for (const auto& entry : r.ops) names.push_back(entry.first);
  return names;
}

const Tensor* UnfilledInteriors::owned(size_t i) const {
  for (const Entry& entry : entries_)
    if (entry.input == i) return &entry.owned;
  return nullptr;
}

const Box& UnfilledInteriors::box(size_t i) const {
  for (const Entry& entry : entries_)
    if (entry.input == i) return entry.box;
  throw InvalidArgument("op", fmt::format("input {} has no unfilled interior", i));
}

void UnfilledInteriors::fill(size_t i, const Tensor& haloed) const {
  for (auto entry = entries_.begin(); entry != entries_.end(); ++entry)
    if (entry->input == i) {
      trace::Span span("halo", "halo_fill");  // the interior copy halo_begin_around left out
      trace::CopyTally copies(span);
      Tensor interior = haloed.view_box(entry->box);
      copies.copy(interior, &entry->owned);
      interior.copy_from(entry->owned);
      copies.record(span);
      entries_.erase(entry);
      return;
    }
}

void UnfilledInteriors::fill_all(const std::vector<Tensor>& haloed) const {
  while (!entries_.empty()) fill(entries_.front().input, haloed.at(entries_.front().input));
}

void UnfilledInteriors::add(size_t i, Tensor owned, Box box) {
  entries_.push_back({i, std::move(owned), std::move(box)});
}

OpCost op_cost(const OpDef& op, const KernelContext& context, const std::vector<Tensor>& inputs,
               const std::vector<Tensor>& outputs) {
  if (op.cost) return op.cost(context, inputs, outputs);
  OpCost cost;
  for (const Tensor& input : inputs)
    cost.bytes += static_cast<double>(input.numel()) * static_cast<double>(input.element_size());
  for (const Tensor& output : outputs) {
    cost.bytes += static_cast<double>(output.numel()) * static_cast<double>(output.element_size());
    cost.flops += static_cast<double>(output.numel());
  }
  return cost;
}

OpCost backward_cost(const OpRecord& record) {
  if (record.inputs.empty()) return {};
  const DeviceMesh& mesh = record.inputs[0].mesh();
  KernelContext context{mesh, record.attrs, record.rule.inputs, {}, record.rule.outputs, {}, {}};
  context.device = record.inputs[0].device();
  for (size_t i = 0; i < record.inputs.size(); ++i) {
    const bool haloed = i < record.plans.size() && record.plans[i] != nullptr;
    context.input_boxes.push_back(haloed ? record.plans[i]->needed_box()
                                         : record.inputs[i].local_box());
    context.owned_boxes.push_back(record.inputs[i].local_box());
  }
  std::vector<Tensor> outputs;
  for (const ShardTensor& output : record.outputs) {
    context.output_boxes.push_back(output.local_box());
    outputs.push_back(output.to_local());
  }
  const OpCost forward = op_cost(*record.op, context, record.kernel_inputs, outputs);
  return {2 * forward.flops, 2 * forward.bytes};
}

std::shared_ptr<const HaloPlan> cached_halo_plan(const ShardSpec& spec, const HaloNeed& need,
                                                 int rank) {
  return cached_halo_plan(HaloPlanKey{spec, need.needed, need.boundary, rank});
}

namespace {

/// The share of an overlapped kernel's work its interior does while the halos travel: per dim,
/// the owned extent less the halo around it, over the owned extent (of the first haloed input).
double interior_share(const KernelContext& context,
                      const std::vector<std::shared_ptr<const HaloPlan>>& plans) {
  for (size_t i = 0; i < plans.size(); ++i) {
    if (!plans[i]) continue;
    const Shape owned = context.owned_boxes[i].shape();
    const Shape haloed = context.input_boxes[i].shape();
    double share = 1;
    for (size_t d = 0; d < owned.size() && d < haloed.size(); ++d) {
      if (owned[d] <= 0) return 0;
      const int64_t inner = std::max<int64_t>(0, owned[d] - (haloed[d] - owned[d]));
      share *= static_cast<double>(inner) / static_cast<double>(owned[d]);
    }
    return share;
  }
  return 0;
}

/// Adds the kernel's cost (and the overlapped share) to the op's trace event.
void note_cost(trace::Span& span, const OpDef& op, const KernelContext& context,
               const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs,
               double interior) {
  const OpCost cost = op_cost(op, context, inputs, outputs);
  span.real_arg("flops", cost.flops);
  span.real_arg("bytes", cost.bytes);
  if (interior > 0) span.real_arg("interior", interior);
}

}  // namespace

std::vector<ShardTensor> apply_op(const std::string& name,
                                  const std::vector<ShardTensor>& given_inputs,
                                  const OpAttrs& attrs) {
  // Kernels, halo exchanges and backward functions (built-in and user-written) read contiguous
  // pieces: a strided input (a view, e.g. one of split's parts) is made contiguous here, once,
  // keeping its identity for autograd (as torch's kernels call .contiguous() on a view).
  std::vector<ShardTensor> made_contiguous;
  const bool strided =
      std::any_of(given_inputs.begin(), given_inputs.end(),
                  [](const ShardTensor& t) { return !t.to_local().is_contiguous(); });
  if (strided)
    for (const ShardTensor& input : given_inputs) made_contiguous.push_back(input.contiguous());
  const std::vector<ShardTensor>& inputs = strided ? made_contiguous : given_inputs;
  const std::shared_ptr<const OpDef> definition = find_op(name);
  const OpDef& op = *definition;
  CommOpScope scope(name);
  trace::Span span("op", name);
  check_arg(!inputs.empty(), name, "an op needs at least one input");
  const DeviceMesh& mesh = inputs[0].mesh();
  // (Each message formatted only when it is thrown: str() costs more than the check.)
  for (const ShardTensor& input : inputs)
    if (input.mesh().comm_ptr() != mesh.comm_ptr() || input.mesh().shape() != mesh.shape())
      throw InvalidArgument(name, fmt::format("inputs live on different meshes ({} and {})",
                                              mesh.str(), input.mesh().str()));
  for (const ShardTensor& input : inputs)
    if (input.device() != inputs[0].device())
      throw InvalidArgument(
          name,
          fmt::format("inputs on different devices ({} and {}): move them to one device first",
                      inputs[0].device().str(), input.device().str()));
  if (op.has_signature()) {
    // Attributes and the input count are the same on every rank: an agreed error.
    size_t required = 0;
    for (const OpInput& input : op.inputs) required += !input.optional;
    if (inputs.size() < required || inputs.size() > op.inputs.size())
      throw AgreedError(
          name,
          fmt::format("{} inputs, expected {}{}", inputs.size(), required,
                      required == op.inputs.size() ? "" : fmt::format(" to {}", op.inputs.size())));
    try {
      check_attrs(name, op.attrs, attrs);
    } catch (const InvalidArgument& error) {
      const std::string text = error.what();
      throw AgreedError(name, text.substr(text.find("] ") + 2));
    }
  }
  if (!op.rule) return apply_fallback(definition, inputs, attrs);

  std::vector<ShardSpec> specs;
  for (const ShardTensor& input : inputs) specs.push_back(input.spec());
  // A rule is a pure function of layouts and attributes that every rank shares, so its
  // verdict on bad input is the same everywhere: raise it as an agreed error.
  OpRule rule;
  try {
    rule = op.rule(specs, attrs);
  } catch (const AgreedError&) {
    throw;
  } catch (const InvalidArgument& error) {
    const std::string text = error.what();
    throw AgreedError(error.op(), text.substr(text.find("] ") + 2));
  }
  check_arg(rule.inputs.size() == inputs.size() && rule.halos.size() == inputs.size(), name,
            "the rule returned {} input layouts and {} halos for {} inputs", rule.inputs.size(),
            rule.halos.size(), inputs.size());

  // 1. Inputs in the layouts the rule asks for (recorded, so gradients flow back). An input in
  // its layout already is used where it is: the dispatch copies no layout, mesh or tensor it
  // does not have to (each copy costs allocations, which are most of a small op's time).
  std::vector<std::optional<ShardTensor>> moved(inputs.size());
  std::vector<const ShardTensor*> ready(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].spec() != rule.inputs[i]) moved[i] = inputs[i].redistribute_to(rule.inputs[i]);
    ready[i] = moved[i] ? &*moved[i] : &inputs[i];
  }
  // 2. Halos: start every exchange, then finish them. The context holds the rule's layouts until
  // the tape takes them back.
  KernelContext context{mesh, attrs, std::move(rule.inputs), {}, std::move(rule.outputs), {}, {}};
  context.device = inputs[0].device();
  context.stream = compute_stream_for(context.device);
  std::vector<std::shared_ptr<const HaloPlan>> plans(inputs.size());
  std::vector<HaloExchange> exchanges;
  std::vector<size_t> exchanged;
  const auto all_on = [&inputs](Device::Kind kind) {
    return std::all_of(inputs.begin(), inputs.end(),
                       [kind](const ShardTensor& input) { return input.device().kind == kind; });
  };
  // Owned pieces stay where they are if the cpu kernel reads them in place (asked below).
  const bool around = op.owned_in_place && all_on(Device::Kind::cpu);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!rule.halos[i]) continue;
    plans[i] = cached_halo_plan(context.input_specs[i], *rule.halos[i], mesh.rank());
    const Tensor& owned = ready[i]->to_local();
    const int tag = static_cast<int>(i);
    exchanges.push_back(around ? halo_begin_around(*plans[i], owned, mesh.comm(), tag)
                               : halo_begin(*plans[i], owned, mesh.comm(), tag));
    if (exchanges.back().interior_unfilled())
      context.interiors.add(i, owned, plans[i]->interior_box());
    exchanged.push_back(i);
  }
  std::vector<Tensor> locals(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    locals[i] = ready[i]->to_local();
    Box owned = ready[i]->local_box();
    context.input_boxes.push_back(plans[i] ? plans[i]->needed_box() : owned);
    context.owned_boxes.push_back(std::move(owned));
  }
  for (const ShardSpec& spec : context.output_specs)
    context.output_boxes.push_back(spec.local_box(mesh.coord()));
  // Interiors the kernel will not read in place are filled now.
  if (op.owned_in_place) {
    std::vector<Tensor> haloed = locals;
    for (size_t e = 0; e < exchanges.size(); ++e) haloed[exchanged[e]] = exchanges[e].haloed();
    for (size_t i : exchanged)
      if (context.interiors.owned(i) && !op.owned_in_place(context, haloed, i))
        context.interiors.fill(i, haloed[i]);
  }

  // 3. The kernel: with an overlap split, its interior runs while the halos are in flight.
  std::vector<Tensor> results;
  // Only worth it when halo cells come from other ranks (not just zero padding or self copies).
  const bool remote = std::any_of(plans.begin(), plans.end(),
                                  [](const auto& plan) { return plan && !plan->recvs().empty(); });
  // The split of the inputs' device, if the op has one.
  const OverlapKernel* split = nullptr;
  if (all_on(Device::Kind::cpu) && op.cpu_overlap) split = &*op.cpu_overlap;
  if (all_on(Device::Kind::cuda) && op.cuda_overlap) split = &*op.cuda_overlap;
  // Estimate mode: the messages travel (halo_end below), the kernel does not run.
  // A kernel that communicates (estimate/real_data.hpp) runs, on the shape-only pieces.
  const bool estimating = estimate::active() && !estimate::runs_kernel_in_estimate_mode(name);
  const bool overlap =
      !estimating && split != nullptr && remote && halo_overlap(context.device.kind);
  if (overlap) {
    for (size_t e = 0; e < exchanges.size(); ++e) locals[exchanged[e]] = exchanges[e].haloed();
    results = split->interior(context, locals);
  }
  for (size_t e = 0; e < exchanges.size(); ++e) locals[exchanged[e]] = halo_end(exchanges[e]);
  if (estimating)
    results = shape_only_outputs(context, rule, inputs, attrs);
  else if (overlap)
    split->boundary(context, locals, results);
  else
    results = kernel_for(op, inputs)(context, locals);

  // 4. The outputs.
  TESSERA_CHECK_ARG(results.size() == context.output_specs.size(), name,
                    "the kernel returned {} outputs, the rule promised {}", results.size(),
                    context.output_specs.size());
  if (span.recording())
    note_cost(span, op, context, locals, results, overlap ? interior_share(context, plans) : 0);
  // 5. Record for autograd (the inputs, outputs and layouts the backward reads are copied only
  // then).
  Tape* tape = Tape::active();
  const bool recording = tape && op.backward &&
                         std::any_of(ready.begin(), ready.end(),
                                     [](const ShardTensor* t) { return t->requires_grad(); });
  std::vector<ShardTensor> outputs;
  for (size_t o = 0; o < results.size(); ++o) {
    const Box& box = context.output_boxes[o];
    bool fits = static_cast<size_t>(results[o].ndim()) == box.ndim();
    for (size_t d = 0; fits && d < box.ndim(); ++d) fits = results[o].shape()[d] == box.extent(d);
    TESSERA_CHECK_ARG(fits, name,
                      "the kernel's output {} has shape {} on rank {}, the rule's layout says {}",
                      o, results[o].shape(), mesh.rank(), box.shape());
    // A dtype the rule names (what estimate mode's shape-only outputs get) is the kernel's.
    const DType declared = o < rule.output_dtypes.size() && rule.output_dtypes[o]
                               ? *rule.output_dtypes[o]
                               : results[o].dtype();
    TESSERA_CHECK_ARG(results[o].dtype() == declared, name,
                      "the kernel's output {} is {} on rank {}, the rule says {}", o,
                      dtype_name(results[o].dtype()), mesh.rank(), dtype_name(declared));
    if (recording)
      outputs.emplace_back(results[o], mesh, context.output_specs[o]);
    else
      outputs.emplace_back(std::move(results[o]), mesh, std::move(context.output_specs[o]));
  }
  if (recording) {
    context.interiors.fill_all(locals);  // the backward reads the haloed inputs whole
    // Integer outputs (max_pool's indices) take no gradient, as in PyTorch.
    for (ShardTensor& output : outputs) output.set_requires_grad(is_floating(output.dtype()));
    rule.inputs = std::move(context.input_specs);
    rule.outputs = std::move(context.output_specs);
    std::vector<ShardTensor> recorded;
    for (const ShardTensor* input : ready) recorded.push_back(*input);
    tape->record(
        OpRecord{definition, attrs, std::move(rule), std::move(recorded), locals, plans, outputs});
  }
  return outputs;
}

}  // namespace tessera
