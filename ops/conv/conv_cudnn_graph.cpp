// The cuDNN convolution on cuDNN's graph (backend) API (see conv_cudnn_graph.hpp).
//
// Per key (the legacy key plus the operands' pointer alignment, which the graph's tensors
// declare): one operation graph of one convolution operation over the three operands (uids x,
// w, y); its engine configurations from the heuristics in mode A, then fallback; each kept when
// its numerical notes keep the conv's contract; each built into an execution plan (those that do
// not finalize are skipped) and timed once after a warm-up run, on the operands, with a workspace
// of the largest need within the limit; the choice cached for the process. A thread without a
// plan for a cached choice rebuilds the same list and builds the plan at the chosen position.
#include "ops/conv/conv_cudnn_graph.hpp"

#include <cuda_runtime_api.h>
#include <cudnn.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/errors.hpp"
#include "core/gpu_runtime.hpp"
#include "ops/conv/cudnn_common.hpp"

// The operation graph's and the execution plan's CUDNN_ATTR_*_HANDLE are marked deprecated in
// cuDNN 9 (a device-properties descriptor is their successor for building without a device);
// with a handle at hand they are the way to bind a graph to its device.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace tessera::ops {
namespace {

constexpr const char* kOp = "conv";
constexpr int64_t kUidX = 'x', kUidW = 'w', kUidY = 'y';

/// The calling thread's current device, for errors (-1 when there is none).
int current_device() {
  int device = -1;
  return cudaGetDevice(&device) == cudaSuccess ? device : -1;
}

#define TESSERA_GRAPH_CHECK(call, what) TESSERA_CUDNN_CHECK(call, current_device(), what)

/// One backend descriptor, destroyed with the object.
class BackendDesc {
 public:
  BackendDesc() = default;
  BackendDesc(cudnnBackendDescriptorType_t type, const std::string& what) {
    TESSERA_GRAPH_CHECK(cudnnBackendCreateDescriptor(type, &desc_), what);
  }
  ~BackendDesc() {
    if (desc_ != nullptr) cudnnBackendDestroyDescriptor(desc_);
  }
  BackendDesc(BackendDesc&& other) noexcept : desc_(std::exchange(other.desc_, nullptr)) {}
  BackendDesc& operator=(BackendDesc&& other) noexcept {
    if (this != &other) {
      if (desc_ != nullptr) cudnnBackendDestroyDescriptor(desc_);
      desc_ = std::exchange(other.desc_, nullptr);
    }
    return *this;
  }
  BackendDesc(const BackendDesc&) = delete;
  BackendDesc& operator=(const BackendDesc&) = delete;
  cudnnBackendDescriptor_t get() const { return desc_; }

 private:
  cudnnBackendDescriptor_t desc_ = nullptr;
};

void set_attribute(const BackendDesc& desc, cudnnBackendAttributeName_t name,
                   cudnnBackendAttributeType_t type, int64_t count, const void* values,
                   const std::string& what) {
  TESSERA_GRAPH_CHECK(cudnnBackendSetAttribute(desc.get(), name, type, count, values), what);
}

void set_descriptor(const BackendDesc& desc, cudnnBackendAttributeName_t name,
                    const BackendDesc& value, const std::string& what) {
  cudnnBackendDescriptor_t raw = value.get();
  set_attribute(desc, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw, what);
}

/// The largest power of two up to 16 that divides the address: what the graph's tensor may
/// promise the engines about its start.
int64_t alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  int64_t alignment = 16;
  while (alignment > 1 && address % static_cast<uintptr_t>(alignment) != 0) alignment /= 2;
  return alignment;
}

struct GraphKey {
  CudnnConvKey key;
  std::array<int64_t, 3> alignment{};  // of x, w, y
  bool operator==(const GraphKey&) const = default;
};

struct GraphKeyHash {
  size_t operator()(const GraphKey& k) const {
    size_t seed = CudnnConvKeyHash{}(k.key);
    for (int64_t a : k.alignment)
      seed ^= std::hash<int64_t>{}(a) + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2);
    return seed;
  }
};

BackendDesc tensor_desc(int64_t uid, DType dtype, int rank, const int64_t* dims,
                        const int64_t* strides, int64_t alignment, const std::string& what) {
  BackendDesc tensor(CUDNN_BACKEND_TENSOR_DESCRIPTOR, what);
  const cudnnDataType_t type = cudnn_common::data_type(dtype);
  set_attribute(tensor, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, what);
  set_attribute(tensor, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, rank, dims, what);
  set_attribute(tensor, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, rank, strides, what);
  set_attribute(tensor, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, what);
  set_attribute(tensor, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, what);
  TESSERA_GRAPH_CHECK(cudnnBackendFinalize(tensor.get()), what);
  return tensor;
}

BackendDesc activation_desc(int64_t uid, DType dtype, const CudnnTensorDims& dims,
                            int64_t alignment, const std::string& what) {
  std::array<int64_t, 5> d{}, s{};
  for (int i = 0; i < dims.rank; ++i) {
    d[i] = dims.dims[i];
    s[i] = dims.strides[i];
  }
  return tensor_desc(uid, dtype, dims.rank, d.data(), s.data(), alignment, what);
}

/// The operation descriptor of a direction and its attributes for the operands in forward terms
/// (x, w, y: dx, w, dy for backward data; x, dw, dy for backward filter).
struct OperationAttributes {
  cudnnBackendDescriptorType_t type;
  cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
};

OperationAttributes operation_attributes(CudnnDirection direction) {
  switch (direction) {
    case CudnnDirection::forward:
      return {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA};
    case CudnnDirection::backward_data:
      return {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA};
    case CudnnDirection::backward_filter: break;
  }
  return {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
          CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
          CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
          CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
          CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
          CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
          CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA};
}

/// The descriptors of one conv's operation graph, kept alive as long as its plans.
struct Graph {
  BackendDesc x, w, y, conv, operation, graph;
};

/// The graph of `gk` (with `handle` null: not bound to a device, as the cpu tests build it).
Graph build_graph(cudnnHandle_t handle, const GraphKey& gk, const std::string& what) {
  const CudnnConvKey& key = gk.key;
  Graph g;
  g.x = activation_desc(kUidX, key.dtype, key.x, gk.alignment[0], what);
  std::array<int64_t, 5> w_dims{};
  for (int i = 0; i < key.w.rank; ++i) w_dims[i] = key.w.dims[i];
  const std::array<int64_t, 5> w_strides = cudnn_filter_strides(key.w);
  g.w = tensor_desc(kUidW, key.dtype, key.w.rank, w_dims.data(), w_strides.data(), gk.alignment[1],
                    what);
  g.y = activation_desc(kUidY, key.dtype, key.y, gk.alignment[2], what);

  g.conv = BackendDesc(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, what);
  const bool is_double = key.dtype == DType::f64;
  const cudnnDataType_t compute = is_double ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
  set_attribute(g.conv, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, what);
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  set_attribute(g.conv, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode,
                what);
  const int64_t spatial = key.params.spatial;
  set_attribute(g.conv, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &spatial, what);
  std::array<int64_t, 3> dilation{}, stride{}, padding{};
  for (int i = 0; i < spatial; ++i) {
    dilation[i] = key.params.dilation[i];
    stride[i] = key.params.stride[i];
    padding[i] = key.params.padding[i];
  }
  set_attribute(g.conv, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, spatial,
                dilation.data(), what);
  set_attribute(g.conv, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, spatial,
                stride.data(), what);
  set_attribute(g.conv, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, spatial,
                padding.data(), what);
  set_attribute(g.conv, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, spatial,
                padding.data(), what);
  TESSERA_GRAPH_CHECK(cudnnBackendFinalize(g.conv.get()), what);

  // output = 1 * conv + 0 * output, in the compute type.
  const float alpha_float = 1, beta_float = 0;
  const double alpha_double = 1, beta_double = 0;
  const cudnnBackendAttributeType_t scalar = is_double ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT;
  const void* alpha = is_double ? static_cast<const void*>(&alpha_double) : &alpha_float;
  const void* beta = is_double ? static_cast<const void*>(&beta_double) : &beta_float;
  const OperationAttributes names = operation_attributes(key.direction);
  g.operation = BackendDesc(names.type, what);
  set_descriptor(g.operation, names.x, g.x, what);
  set_descriptor(g.operation, names.w, g.w, what);
  set_descriptor(g.operation, names.y, g.y, what);
  set_descriptor(g.operation, names.conv, g.conv, what);
  set_attribute(g.operation, names.alpha, scalar, 1, alpha, what);
  set_attribute(g.operation, names.beta, scalar, 1, beta, what);
  TESSERA_GRAPH_CHECK(cudnnBackendFinalize(g.operation.get()), what);

  g.graph = BackendDesc(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, what);
  set_descriptor(g.graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, g.operation, what);
  if (handle != nullptr)
    set_attribute(g.graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, what);
  TESSERA_GRAPH_CHECK(cudnnBackendFinalize(g.graph.get()), what);
  return g;
}

/// One engine configuration the conv may run with.
struct Candidate {
  BackendDesc config;
  int64_t engine = -1;  // the engine's global index
  CudnnEngineNotes notes;
};

/// The notes and global index of the engine of `config`.
std::optional<Candidate> describe_config(BackendDesc config, const std::string& what) {
  BackendDesc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR, what);
  cudnnBackendDescriptor_t raw = engine.get();
  int64_t count = 0;
  if (cudnnBackendGetAttribute(config.get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &count,
                               &raw) != CUDNN_STATUS_SUCCESS)
    return std::nullopt;
  Candidate candidate;
  if (cudnnBackendGetAttribute(engine.get(), CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1,
                               &count, &candidate.engine) != CUDNN_STATUS_SUCCESS)
    return std::nullopt;
  std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
  if (cudnnBackendGetAttribute(engine.get(), CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                               CUDNN_TYPE_NUMERICAL_NOTE, static_cast<int64_t>(notes.size()),
                               &count, notes.data()) != CUDNN_STATUS_SUCCESS)
    return std::nullopt;
  for (int64_t i = 0; i < count && i < static_cast<int64_t>(notes.size()); ++i) {
    switch (notes[i]) {
      case CUDNN_NUMERICAL_NOTE_TENSOR_CORE: candidate.notes.tensor_core = true; break;
      case CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS:
        candidate.notes.down_convert_inputs = true;
        break;
      case CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION:
        candidate.notes.reduced_precision_reduction = true;
        break;
      case CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC: candidate.notes.nondeterministic = true; break;
      default: break;
    }
  }
  candidate.config = std::move(config);
  return candidate;
}

/// The engine configurations heuristics `mode` lists for the graph (none when it lists none).
std::vector<BackendDesc> heuristic_configs(const Graph& g, cudnnBackendHeurMode_t mode,
                                           const std::string& what) {
  BackendDesc heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, what);
  set_descriptor(heuristics, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, g.graph, what);
  set_attribute(heuristics, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, what);
  if (cudnnBackendFinalize(heuristics.get()) != CUDNN_STATUS_SUCCESS) return {};
  int64_t count = 0;
  if (cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                               nullptr) != CUDNN_STATUS_SUCCESS ||
      count <= 0)
    return {};
  std::vector<BackendDesc> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, what);
    raw.push_back(configs.back().get());
  }
  int64_t returned = 0;
  if (cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned,
                               raw.data()) != CUDNN_STATUS_SUCCESS)
    return {};
  configs.resize(static_cast<size_t>(std::clamp<int64_t>(returned, 0, count)));
  return configs;
}

/// The candidates of the conv, in a fixed order (heuristics mode A, then fallback; engines
/// whose notes break the conv's contract left out; the first TESSERA_CUDNN_GRAPH_CANDIDATES of
/// them), the same on every thread.
std::vector<Candidate> candidates_of(const Graph& g, const CudnnConvKey& key,
                                     const std::string& what) {
  const CudnnDeterminism determinism = cudnn_determinism_for(key.dtype, key.deterministic);
  std::vector<Candidate> candidates;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    for (BackendDesc& config : heuristic_configs(g, mode, what)) {
      std::optional<Candidate> candidate = describe_config(std::move(config), what);
      if (candidate && cudnn_engine_allowed(candidate->notes, key.dtype, key.math, determinism))
        candidates.push_back(std::move(*candidate));
    }
  }
  static const size_t most =
      cudnn_graph_candidates_from_env(std::getenv("TESSERA_CUDNN_GRAPH_CANDIDATES"));
  if (candidates.size() > most) candidates.resize(most);
  return candidates;
}

/// The execution plan of `config`, or nullopt when it does not finalize for this conv.
std::optional<BackendDesc> build_plan(cudnnHandle_t handle, const BackendDesc& config,
                                      size_t* workspace, const std::string& what) {
  BackendDesc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, what);
  set_attribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, what);
  set_descriptor(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config, what);
  if (cudnnBackendFinalize(plan.get()) != CUDNN_STATUS_SUCCESS) return std::nullopt;
  int64_t bytes = 0, count = 0;
  if (cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                               CUDNN_TYPE_INT64, 1, &count, &bytes) != CUDNN_STATUS_SUCCESS ||
      bytes < 0)
    return std::nullopt;
  *workspace = static_cast<size_t>(bytes);
  return plan;
}

cudnnStatus_t execute(cudnnHandle_t handle, const BackendDesc& plan, void* x, void* w, void* y,
                      void* workspace, const std::string& what) {
  BackendDesc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, what);
  void* pointers[3] = {x, w, y};
  const int64_t uids[3] = {kUidX, kUidW, kUidY};
  set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, pointers,
                what);
  set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids, what);
  set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, what);
  TESSERA_GRAPH_CHECK(cudnnBackendFinalize(pack.get()), what);
  return cudnnBackendExecute(handle, plan.get(), pack.get());
}

/// Milliseconds of one run of `plan` on `stream` (after a warm-up run), or nullopt when it fails.
std::optional<float> time_plan(cudnnHandle_t handle, const BackendDesc& plan, void* x, void* w,
                               void* y, void* workspace, const Stream& stream,
                               const std::string& what) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream.handle);
  if (execute(handle, plan, x, w, y, workspace, what) != CUDNN_STATUS_SUCCESS) return std::nullopt;
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess) return std::nullopt;
  if (cudaEventCreate(&stop) != cudaSuccess) {
    cudaEventDestroy(start);
    return std::nullopt;
  }
  std::optional<float> milliseconds;
  cudaEventRecord(start, cuda_stream);
  const cudnnStatus_t status = execute(handle, plan, x, w, y, workspace, what);
  cudaEventRecord(stop, cuda_stream);
  float elapsed = 0;
  if (cudaEventSynchronize(stop) == cudaSuccess && status == CUDNN_STATUS_SUCCESS &&
      cudaEventElapsedTime(&elapsed, start, stop) == cudaSuccess)
    milliseconds = elapsed;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return milliseconds;
}

/// The process-wide choice of one key: the candidate's position in candidates_of's list.
struct GraphChoice {
  size_t position = 0;
  int64_t engine = -1;
  size_t workspace = 0;
};

struct ChoiceCache {
  std::mutex mu;
  std::unordered_map<GraphKey, GraphChoice, GraphKeyHash> choices;
};

ChoiceCache& choice_cache() {
  static ChoiceCache* cache = new ChoiceCache;
  return *cache;
}

std::optional<GraphChoice> cached_choice(const GraphKey& key) {
  ChoiceCache& cache = choice_cache();
  std::lock_guard lock(cache.mu);
  const auto it = cache.choices.find(key);
  if (it == cache.choices.end()) return std::nullopt;
  return it->second;
}

/// A plan ready to run on the thread that built it, with the graph and the engine configuration
/// it came from (kept alive with it).
struct ReadyPlan {
  Graph graph;
  BackendDesc config;
  BackendDesc plan;
  size_t workspace = 0;
};

/// Times every candidate on the operands and returns the chosen one's plan (caching the choice).
ReadyPlan measure(cudnnHandle_t handle, const GraphKey& gk, Graph graph,
                  std::vector<Candidate>& candidates, void* x, void* w, void* y,
                  const Stream& stream, const std::string& what) {
  const CudnnConvKey& key = gk.key;
  const auto [limit, free_bytes] = cudnn_common::workspace_limit(key.device);
  std::vector<std::optional<BackendDesc>> plans;
  std::vector<size_t> needs(candidates.size(), 0);
  size_t offered = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    plans.push_back(build_plan(handle, candidates[i].config, &needs[i], what));
    if (plans.back() && needs[i] <= limit) offered = std::max(offered, needs[i]);
  }
  cudnn_common::Workspace workspace(offered, Device::cuda(key.device), stream);
  std::vector<CudnnAlgoMeasurement> measurements;
  std::string log;
  for (size_t i = 0; i < candidates.size(); ++i) {
    CudnnAlgoMeasurement m;
    m.algorithm = static_cast<int>(i);
    m.workspace_bytes = needs[i];
    m.deterministic = !candidates[i].notes.nondeterministic;
    if (plans[i] && needs[i] <= offered) {
      const auto milliseconds =
          time_plan(handle, *plans[i], x, w, y, workspace.data(), stream, what);
      m.ok = milliseconds.has_value();
      m.milliseconds = milliseconds.value_or(0);
    }
    measurements.push_back(m);
    if (cudnn_common::log_measurements())
      log += !plans[i] ? fmt::format(" e{}:no-plan", candidates[i].engine)
             : !m.ok
                 ? fmt::format(" e{}:failed({:.1f}MiB)", candidates[i].engine, needs[i] / 1048576.0)
                 : fmt::format(" e{}:{:.3f}ms({:.1f}MiB){}", candidates[i].engine, m.milliseconds,
                               needs[i] / 1048576.0, m.deterministic ? "" : "(atomics)");
  }
  const std::optional<CudnnAlgoChoice> choice =
      choose_algorithm(measurements, cudnn_determinism_for(key.dtype, key.deterministic), offered);
  if (!choice)
    throw NotAvailable(kOp,
                       fmt::format("cuDNN's graph API has no engine for conv {} within a "
                                   "workspace of {} bytes{} ({} candidates; "
                                   "TESSERA_CUDNN_API=legacy tries the legacy algorithms)",
                                   what, offered, key.deterministic ? " that is deterministic" : "",
                                   candidates.size()));
  const size_t position = static_cast<size_t>(choice->algorithm);
  if (cudnn_common::log_measurements())
    fmt::print(
        stderr,
        "[cudnn graph] {}: limit {:.0f} MiB (free or cached {:.0f} MiB), offered {:.1f} MiB; "
        "engines{}; chose engine {} ({:.1f} MiB)\n",
        describe(key), limit / 1048576.0, free_bytes / 1048576.0, offered / 1048576.0, log,
        candidates[position].engine, needs[position] / 1048576.0);
  {
    ChoiceCache& cache = choice_cache();
    std::lock_guard lock(cache.mu);
    cache.choices.emplace(gk, GraphChoice{position, candidates[position].engine, needs[position]});
  }
  return ReadyPlan{std::move(graph), std::move(candidates[position].config),
                   std::move(*plans[position]), needs[position]};
}

/// The plan for `gk` on this thread: built from the cached choice, or measured now (one
/// measurement at a time in the process, as on the legacy path).
ReadyPlan prepare(cudnnHandle_t handle, const GraphKey& gk, void* x, void* w, void* y,
                  const Stream& stream, const std::string& what) {
  const auto from_choice = [&](Graph& graph, std::vector<Candidate>& candidates,
                               const GraphChoice& choice) -> std::optional<ReadyPlan> {
    if (choice.position >= candidates.size() || candidates[choice.position].engine != choice.engine)
      return std::nullopt;
    size_t workspace = 0;
    std::optional<BackendDesc> plan =
        build_plan(handle, candidates[choice.position].config, &workspace, what);
    if (!plan) return std::nullopt;
    return ReadyPlan{std::move(graph), std::move(candidates[choice.position].config),
                     std::move(*plan), workspace};
  };
  Graph graph = build_graph(handle, gk, what);
  std::vector<Candidate> candidates = candidates_of(graph, gk.key, what);
  if (const auto choice = cached_choice(gk))
    if (auto ready = from_choice(graph, candidates, *choice)) return std::move(*ready);
  static std::mutex measuring;
  std::lock_guard lock(measuring);
  if (const auto choice = cached_choice(gk))
    if (auto ready = from_choice(graph, candidates, *choice)) return std::move(*ready);
  return measure(handle, gk, std::move(graph), candidates, x, w, y, stream, what);
}

/// The calling thread's handles (one per device) and plans; the plans go before the handles.
class ThreadState {
 public:
  ~ThreadState() {
    plans_.clear();
    for (const auto& [device, handle] : handles_) {
      try {
        gpu::set_device(device);
      } catch (...) {
        continue;  // the driver is already gone at process exit
      }
      cudnnDestroy(handle);
    }
  }
  cudnnHandle_t handle(int device, const Stream& stream, const std::string& what) {
    auto it = handles_.find(device);
    if (it == handles_.end()) {
      cudnnHandle_t handle = nullptr;
      TESSERA_GRAPH_CHECK(cudnnCreate(&handle), what);
      it = handles_.emplace(device, handle).first;
    }
    TESSERA_GRAPH_CHECK(cudnnSetStream(it->second, static_cast<cudaStream_t>(stream.handle)), what);
    return it->second;
  }
  std::unordered_map<GraphKey, std::shared_ptr<ReadyPlan>, GraphKeyHash>& plans() { return plans_; }

 private:
  std::map<int, cudnnHandle_t> handles_;
  std::unordered_map<GraphKey, std::shared_ptr<ReadyPlan>, GraphKeyHash> plans_;
};

}  // namespace

void conv_graph_run(const CudnnConvKey& key, void* x, void* w, void* y, const Stream& stream,
                    const std::string& what) {
  thread_local ThreadState state;
  cudnnHandle_t handle = state.handle(key.device, stream, what);
  const GraphKey gk{key, {alignment_of(x), alignment_of(w), alignment_of(y)}};
  auto& plans = state.plans();
  auto it = plans.find(gk);
  if (it == plans.end())
    it = plans.emplace(gk, std::make_shared<ReadyPlan>(prepare(handle, gk, x, w, y, stream, what)))
             .first;
  const ReadyPlan& ready = *it->second;
  cudnn_common::Workspace workspace(ready.workspace, Device::cuda(key.device), stream);
  TESSERA_GRAPH_CHECK(execute(handle, ready.plan, x, w, y, workspace.data(), what), what);
}

void conv_graph_check_descriptors(const CudnnConvKey& key) {
  build_graph(nullptr, GraphKey{key, {16, 16, 16}}, describe(key));
}

size_t conv_graph_cached_choices() {
  ChoiceCache& cache = choice_cache();
  std::lock_guard lock(cache.mu);
  return cache.choices.size();
}

std::vector<std::string> conv_graph_choices() {
  std::vector<std::string> lines;
  ChoiceCache& cache = choice_cache();
  std::lock_guard lock(cache.mu);
  for (const auto& [gk, choice] : cache.choices)
    lines.push_back(fmt::format("{} (alignment {}): graph engine {} workspace {} bytes",
                                describe(gk.key), fmt::join(gk.alignment, ","), choice.engine,
                                choice.workspace));
  std::sort(lines.begin(), lines.end());
  return lines;
}

}  // namespace tessera::ops
