// Training checkpoints (ops/nn/checkpoint.hpp).
#include "ops/nn/checkpoint.hpp"

#include "io/hdf5/checkpoint.hpp"

namespace tessera::nn {

namespace {

constexpr const char* kModel = "model/";
constexpr const char* kOptim = "optim/";
constexpr const char* kRun = "run/";
constexpr const char* kCounter = "counter/";
constexpr const char* kScalerScale = "scaler/scale";
constexpr const char* kScalerTracker = "scaler/growth_tracker";

const DeviceMesh& mesh_of(const Module& module, const std::string& op) {
  const auto parameters = module.named_parameters();
  check_arg(!parameters.empty(), op, "the module has no parameters");
  return parameters.front().second.tensor().mesh();
}

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

void save_training_checkpoint(const std::string& file, const Module& module,
                              const optim::Optimizer& optimizer,
                              const std::map<std::string, int64_t>& counters,
                              const GradScaler* scaler) {
  const DeviceMesh& mesh = mesh_of(module, "save_training_checkpoint");
  std::vector<std::pair<std::string, ShardTensor>> tensors;
  for (const auto& [name, value] : module.state_dict()) tensors.emplace_back(kModel + name, value);
  for (const auto& [key, value] : optimizer.state_dict()) tensors.emplace_back(kOptim + key, value);
  const std::vector<Placement> replicated(mesh.ndim(), Placement::replicate());
  auto scalar = [&](int64_t value) {
    return ShardTensor::distribute(Tensor::from_values<int64_t>({}, std::vector<int64_t>{value}),
                                   mesh, replicated);
  };
  for (const auto& [name, value] : counters) tensors.emplace_back(kRun + name, scalar(value));
  for (const auto& [name, value] : module.named_counters())
    tensors.emplace_back(kCounter + name, scalar(value));
  if (scaler != nullptr) {
    tensors.emplace_back(
        kScalerScale, ShardTensor::distribute(Tensor::from_values<double>(
                                                  {}, std::vector<double>{scaler->state().scale}),
                                              mesh, replicated));
    tensors.emplace_back(kScalerTracker, scalar(scaler->state().growth_tracker));
  }
  io::save_checkpoint(file, tensors);
}

std::map<std::string, int64_t> load_training_checkpoint(const std::string& file, Module& module,
                                                        optim::Optimizer& optimizer,
                                                        GradScaler* scaler) {
  const DeviceMesh& mesh = mesh_of(module, "load_training_checkpoint");
  std::map<std::string, ShardTensor> model, state;
  std::map<std::string, int64_t> counters, module_counters;
  auto value_of = [](const ShardTensor& tensor) {
    return tensor.full_tensor().to(Device::cpu()).item_as_double({});
  };
  auto integer = [&](const ShardTensor& tensor) { return static_cast<int64_t>(value_of(tensor)); };
  std::optional<GradScalerState> scaler_state;
  for (const auto& [name, tensor] : io::load_checkpoint(file, mesh)) {
    if (name == kScalerScale || name == kScalerTracker) {
      if (!scaler_state) scaler_state = GradScalerState{};
      if (name == kScalerScale)
        scaler_state->scale = value_of(tensor);
      else
        scaler_state->growth_tracker = integer(tensor);
    } else if (starts_with(name, kCounter) && tensor.global_shape().empty()) {
      module_counters[name.substr(std::string(kCounter).size())] = integer(tensor);
    } else if (starts_with(name, kModel)) {
      model.emplace(name.substr(std::string(kModel).size()), tensor);
    } else if (starts_with(name, kOptim)) {
      state.emplace(name.substr(std::string(kOptim).size()), tensor);
    } else {
      check_arg(starts_with(name, kRun) && tensor.global_shape().empty(),
                "load_training_checkpoint", "'{}' in '{}' is not part of a training checkpoint",
                name, file);
      counters[name.substr(std::string(kRun).size())] = integer(tensor);
    }
  }
  // Every check before anything is written. A file without module counters (written before
  // checkpoints held them) leaves the module's counters as they are. The file is the same on every
  // rank, so these checks agree everywhere.
  check_arg(scaler_state.has_value() == (scaler != nullptr), "load_training_checkpoint",
            "'{}' {} a GradScaler state but {} scaler was given", file,
            scaler_state ? "holds" : "does not hold", scaler ? "a" : "no");
  optimizer.check_state_dict(state);
  if (!module_counters.empty()) {
    std::map<std::string, int64_t> checked;
    for (const auto& [name, value] : module.named_counters()) checked[name] = value;
    for (const auto& [name, value] : checked)
      check_arg(module_counters.count(name) == 1, "load_training_checkpoint",
                "'{}' lacks the module's counter '{}'", file, name);
    for (const auto& [name, value] : module_counters)
      check_arg(checked.count(name) == 1, "load_training_checkpoint",
                "'{}' holds counter '{}', which the module does not have", file, name);
  }
  module.load_state_dict(model);
  if (!module_counters.empty()) module.load_counters(module_counters);
  optimizer.load_state_dict(state);
  if (scaler != nullptr) scaler->load_state(*scaler_state);
  return counters;
}

}  // namespace tessera::nn
