// oneDNN conv kernels (f32). Each thread has its own engine, stream and primitive cache (keyed
// by direction, shapes and geometry), so steady-state calls create nothing: they pay the
// convolution plus the reorders between the plain layouts of Tessera tensors (ncw/nchw/ncdhw,
// oiw/../goidhw) and whatever blocked layouts the primitive chose through format_tag::any.
#include "ops/conv/conv_onednn.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>

#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/compute_threads.hpp"
#include "core/errors.hpp"
#include "core/host_allocator.hpp"
#include "ops/conv/conv_kernels.hpp"

namespace tessera::ops {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;

// Primitives cached per thread; past this many the cache starts over (a workload cycling
// through more shapes than this pays primitive creation again, nothing worse).
constexpr size_t kMaxCachedPrimitives = 64;

enum class Direction : uint8_t { forward, backward_data, backward_weight };

const char* direction_name(Direction direction) {
  switch (direction) {
    case Direction::forward: return "forward";
    case Direction::backward_data: return "backward data";
    case Direction::backward_weight: return "backward weight";
  }
  return "?";
}

// oneDNN's view of one problem: tensor dims (weights with a leading group dim when groups > 1),
// strides, dilations in oneDNN's convention (ours - 1) and the zero padding on each side.
struct DnnlDims {
  memory::dims src, weights, dst, strides, dilates, padding_l, padding_r;
  int spatial_dims = 3;
  bool grouped = false;

  explicit DnnlDims(const ConvProblem& problem)
      : src(problem.x_shape()),
        weights(problem.w_shape()),
        dst(problem.y_shape()),
        spatial_dims(problem.spatial_dims),
        grouped(problem.groups > 1) {
    if (grouped) {
      weights[0] = problem.out_channels_per_group();
      weights.insert(weights.begin(), problem.groups);
    }
    for (int slot = 3 - spatial_dims; slot < 3; ++slot) {
      strides.push_back(problem.stride[slot]);
      dilates.push_back(problem.dilation[slot] - 1);
      padding_l.push_back(problem.pad_lo[slot]);
      padding_r.push_back(problem.pad_hi[slot]);
    }
  }

  Tag activation_tag() const {
    static constexpr Tag tags[] = {Tag::ncw, Tag::nchw, Tag::ncdhw};
    return tags[spatial_dims - 1];
  }
  Tag weights_tag() const {
    static constexpr Tag plain[] = {Tag::oiw, Tag::oihw, Tag::oidhw};
    static constexpr Tag with_groups[] = {Tag::goiw, Tag::goihw, Tag::goidhw};
    return grouped ? with_groups[spatial_dims - 1] : plain[spatial_dims - 1];
  }
};

memory::desc f32_desc(const memory::dims& dims, Tag tag) {
  return memory::desc(dims, memory::data_type::f32, tag);
}

struct PrimitiveKey {
  Direction direction;
  bool has_bias;
  memory::dims src, weights, dst, strides, dilates, padding_l, padding_r;
  bool operator==(const PrimitiveKey&) const = default;
};

struct PrimitiveKeyHash {
  size_t operator()(const PrimitiveKey& key) const {
    size_t hash = static_cast<size_t>(key.direction) * 2 + (key.has_bias ? 1 : 0);
    auto mix = [&hash](int64_t value) {
      hash ^= std::hash<int64_t>{}(value) + 0x9e3779b97f4a7c15ULL + (hash << 6) + (hash >> 2);
    };
    for (const memory::dims* dims : {&key.src, &key.weights, &key.dst, &key.strides, &key.dilates,
                                     &key.padding_l, &key.padding_r}) {
      mix(static_cast<int64_t>(dims->size()));
      for (int64_t value : *dims) mix(value);
    }
    return hash;
  }
};

// One tensor argument of a primitive: the plain layout of the Tessera tensor, the layout the
// primitive chose, and (only when they differ) the reorder between them: plain -> chosen for
// an input, chosen -> plain for the output.
struct Operand {
  int arg = 0;  // DNNL_ARG_*
  memory::desc plain;
  memory::desc chosen;
  dnnl::reorder reorder;
  bool needs_reorder = false;
};

struct CachedConv {
  dnnl::primitive conv;
  std::vector<Operand> inputs;
  Operand output;
};

struct ThreadContext {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::unordered_map<PrimitiveKey, CachedConv, PrimitiveKeyHash> cache;
};

ThreadContext& thread_context() {
  thread_local ThreadContext context;
  return context;
}

Operand make_operand(const dnnl::engine& engine, int arg, const memory::desc& plain,
                     const memory::desc& chosen, bool is_output) {
  Operand operand{arg, plain, chosen, {}, plain != chosen};
  if (operand.needs_reorder) {
    operand.reorder =
        is_output ? dnnl::reorder(dnnl::reorder::primitive_desc(engine, chosen, engine, plain))
                  : dnnl::reorder(dnnl::reorder::primitive_desc(engine, plain, engine, chosen));
  }
  return operand;
}

CachedConv create_forward(const dnnl::engine& engine, const DnnlDims& dims, bool has_bias) {
  const memory::desc bias_desc = has_bias ? f32_desc({dims.dst[1]}, Tag::x) : memory::desc();
  const dnnl::convolution_forward::desc desc(
      dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
      f32_desc(dims.src, Tag::any), f32_desc(dims.weights, Tag::any), bias_desc,
      f32_desc(dims.dst, Tag::any), dims.strides, dims.dilates, dims.padding_l, dims.padding_r);
  const dnnl::convolution_forward::primitive_desc pd(desc, engine);
  CachedConv cached{dnnl::convolution_forward(pd), {}, {}};
  cached.inputs.push_back(make_operand(
      engine, DNNL_ARG_SRC, f32_desc(dims.src, dims.activation_tag()), pd.src_desc(), false));
  cached.inputs.push_back(make_operand(engine, DNNL_ARG_WEIGHTS,
                                       f32_desc(dims.weights, dims.weights_tag()),
                                       pd.weights_desc(), false));
  if (has_bias)
    cached.inputs.push_back(make_operand(engine, DNNL_ARG_BIAS, bias_desc, pd.bias_desc(), false));
  cached.output = make_operand(engine, DNNL_ARG_DST, f32_desc(dims.dst, dims.activation_tag()),
                               pd.dst_desc(), true);
  return cached;
}

// The forward primitive descriptor oneDNN wants as a hint for the backward ones.
dnnl::convolution_forward::primitive_desc forward_hint(const dnnl::engine& engine,
                                                       const DnnlDims& dims) {
  const dnnl::convolution_forward::desc desc(
      dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
      f32_desc(dims.src, Tag::any), f32_desc(dims.weights, Tag::any), f32_desc(dims.dst, Tag::any),
      dims.strides, dims.dilates, dims.padding_l, dims.padding_r);
  return dnnl::convolution_forward::primitive_desc(desc, engine);
}

CachedConv create_backward_data(const dnnl::engine& engine, const DnnlDims& dims) {
  const dnnl::convolution_backward_data::desc desc(
      dnnl::algorithm::convolution_direct, f32_desc(dims.src, Tag::any),
      f32_desc(dims.weights, Tag::any), f32_desc(dims.dst, Tag::any), dims.strides, dims.dilates,
      dims.padding_l, dims.padding_r);
  const dnnl::convolution_backward_data::primitive_desc pd(desc, engine,
                                                           forward_hint(engine, dims));
  CachedConv cached{dnnl::convolution_backward_data(pd), {}, {}};
  cached.inputs.push_back(make_operand(engine, DNNL_ARG_DIFF_DST,
                                       f32_desc(dims.dst, dims.activation_tag()),
                                       pd.diff_dst_desc(), false));
  cached.inputs.push_back(make_operand(engine, DNNL_ARG_WEIGHTS,
                                       f32_desc(dims.weights, dims.weights_tag()),
                                       pd.weights_desc(), false));
  cached.output = make_operand(engine, DNNL_ARG_DIFF_SRC, f32_desc(dims.src, dims.activation_tag()),
                               pd.diff_src_desc(), true);
  return cached;
}

CachedConv create_backward_weight(const dnnl::engine& engine, const DnnlDims& dims) {
  // No bias here: conv_backward_bias sums dy on its own.
  const dnnl::convolution_backward_weights::desc desc(
      dnnl::algorithm::convolution_direct, f32_desc(dims.src, Tag::any),
      f32_desc(dims.weights, Tag::any), memory::desc(), f32_desc(dims.dst, Tag::any), dims.strides,
      dims.dilates, dims.padding_l, dims.padding_r);
  const dnnl::convolution_backward_weights::primitive_desc pd(desc, engine,
                                                              forward_hint(engine, dims));
  CachedConv cached{dnnl::convolution_backward_weights(pd), {}, {}};
  cached.inputs.push_back(make_operand(
      engine, DNNL_ARG_SRC, f32_desc(dims.src, dims.activation_tag()), pd.src_desc(), false));
  cached.inputs.push_back(make_operand(engine, DNNL_ARG_DIFF_DST,
                                       f32_desc(dims.dst, dims.activation_tag()),
                                       pd.diff_dst_desc(), false));
  cached.output =
      make_operand(engine, DNNL_ARG_DIFF_WEIGHTS, f32_desc(dims.weights, dims.weights_tag()),
                   pd.diff_weights_desc(), true);
  return cached;
}

const CachedConv& cached_conv(ThreadContext& context, Direction direction, const DnnlDims& dims,
                              bool has_bias) {
  PrimitiveKey key{direction,    has_bias,     dims.src,       dims.weights,  dims.dst,
                   dims.strides, dims.dilates, dims.padding_l, dims.padding_r};
  if (auto found = context.cache.find(key); found != context.cache.end()) return found->second;
  CachedConv created =
      direction == Direction::forward         ? create_forward(context.engine, dims, has_bias)
      : direction == Direction::backward_data ? create_backward_data(context.engine, dims)
                                              : create_backward_weight(context.engine, dims);
  if (context.cache.size() >= kMaxCachedPrimitives) context.cache.clear();
  return context.cache.emplace(std::move(key), std::move(created)).first->second;
}

// Host memory from the caching allocator for one reordered operand, released on scope exit.
class ScratchBuffer {
 public:
  explicit ScratchBuffer(size_t bytes)
      : bytes_(bytes), data_(bytes > 0 ? host_allocate(bytes) : nullptr) {}
  ~ScratchBuffer() {
    if (data_ != nullptr) host_release(data_, bytes_);
  }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  void* data() const { return data_; }

 private:
  size_t bytes_;
  void* data_;
};

// Runs one cached conv on plain-layout tensors: reorders inputs into the chosen layouts, runs
// the conv, and reorders the result back into `output` when the chosen layout is not plain.
void execute(ThreadContext& context, const CachedConv& cached,
             const std::vector<const Tensor*>& inputs, Tensor& output) {
  std::vector<std::unique_ptr<ScratchBuffer>> scratch;
  std::unordered_map<int, memory> args;
  for (size_t i = 0; i < cached.inputs.size(); ++i) {
    const Operand& operand = cached.inputs[i];
    memory user(operand.plain, context.engine, inputs[i]->raw_data());
    if (!operand.needs_reorder) {
      args.emplace(operand.arg, user);
      continue;
    }
    scratch.push_back(std::make_unique<ScratchBuffer>(operand.chosen.get_size()));
    memory reordered(operand.chosen, context.engine, scratch.back()->data());
    operand.reorder.execute(context.stream, user, reordered);
    args.emplace(operand.arg, reordered);
  }
  const Operand& out = cached.output;
  memory user_output(out.plain, context.engine, output.raw_data());
  if (!out.needs_reorder) {
    args.emplace(out.arg, user_output);
    cached.conv.execute(context.stream, args);
  } else {
    scratch.push_back(std::make_unique<ScratchBuffer>(out.chosen.get_size()));
    memory blocked_output(out.chosen, context.engine, scratch.back()->data());
    args.emplace(out.arg, blocked_output);
    cached.conv.execute(context.stream, args);
    out.reorder.execute(context.stream, blocked_output, user_output);
  }
  context.stream.wait();
}

// Creates (or finds) the primitive and runs it; oneDNN failures become tessera errors that
// name the problem.
void run_conv(Direction direction, const ConvProblem& problem,
              const std::vector<const Tensor*>& inputs, bool has_bias, Tensor& output) {
  const DnnlDims dims(problem);
  const std::vector<int64_t> dilation(problem.dilation.end() - problem.spatial_dims,
                                      problem.dilation.end());
  // oneDNN runs on OpenMP: use this rank's share of the cores, set before the engine and the
  // primitives are created (they size their work for the thread count they see then).
  omp_set_num_threads(compute_threads());
  try {
    ThreadContext& context = thread_context();
    execute(context, cached_conv(context, direction, dims, has_bias), inputs, output);
  } catch (const dnnl::error& error) {
    throw NotAvailable(
        "conv", fmt::format("oneDNN conv{}d {} failed for input ({}), weight ({}), stride ({}), "
                            "dilation ({}), padding ({}) / ({}), groups {}: {}",
                            problem.spatial_dims, direction_name(direction),
                            fmt::join(problem.x_shape(), ","), fmt::join(problem.w_shape(), ","),
                            fmt::join(dims.strides, ","), fmt::join(dilation, ","),
                            fmt::join(dims.padding_l, ","), fmt::join(dims.padding_r, ","),
                            problem.groups, error.what()));
  }
}

}  // namespace

bool conv_onednn_available() {
  return true;
}

void conv_forward_onednn(const ConvProblem& problem, const Tensor& x, const Tensor& w,
                         const Tensor* bias, Tensor& y) {
  std::vector<const Tensor*> inputs{&x, &w};
  if (bias != nullptr) inputs.push_back(bias);
  run_conv(Direction::forward, problem, inputs, bias != nullptr, y);
}

void conv_backward_data_onednn(const ConvProblem& problem, const Tensor& dy, const Tensor& w,
                               Tensor& dx) {
  run_conv(Direction::backward_data, problem, {&dy, &w}, false, dx);
}

void conv_backward_weight_onednn(const ConvProblem& problem, const Tensor& x, const Tensor& dy,
                                 Tensor& dw) {
  run_conv(Direction::backward_weight, problem, {&x, &dy}, false, dw);
}

}  // namespace tessera::ops
