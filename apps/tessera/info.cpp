// `tessera info`: what this build of Tessera contains and which library versions it uses.
#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "apps/plot/plot.hpp"
#include "apps/tessera/commands.hpp"
#include "core/comm/launch.hpp"
#include "core/comm/mpi_comm.hpp"
#include "core/comm/nccl_support.hpp"
#include "core/config.hpp"
#include "core/gpu_runtime.hpp"
#include "core/parallel_for.hpp"
#include "io/hdf5/hdf5_support.hpp"
#include "ops/dnnl/dnnl_support.hpp"

namespace tessera::cli {

namespace {

nlohmann::json collect_info() {
  nlohmann::json info;
  info["version"] = TESSERA_VERSION;
  std::vector<std::string> backends{"local"};
  if (mpi_compiled()) backends.push_back("mpi");
  if (!nccl_version().empty()) backends.push_back("nccl");
  info["backends"] = backends;
  info["default_backend"] = backend_name(backend_from_env());
  // Initializing MPI just to print its version would need a launcher on some systems; the
  // version string is available before MPI_Init.
  info["mpi"] = mpi_library_version();
  std::vector<std::string> gpus;
  for (int index = 0; index < gpu::device_count(); ++index)
    gpus.push_back(fmt::format("cuda:{}: {}", index, gpu::device_description(index)));
  info["cuda"] = {{"compiled", gpu::compiled()},
                  {"runtime", gpu::runtime_version()},
                  {"driver", gpu::driver_version()},
                  {"devices", gpu::device_count()},
                  {"gpus", gpus}};
  // Whether MPI takes device buffers is the library's answer after MPI_Init, so it is asked only
  // under a launcher (initializing MPI elsewhere may need one).
  if (mpi_compiled() && launched_by_mpi_launcher())
    info["mpi_cuda_aware"] =
        mpi_cuda_aware() ? "yes" : "no (device buffers staged through pinned memory)";
  else
    info["mpi_cuda_aware"] = mpi_compiled() ? "asked at run time under mpiexec/srun" : "";
  info["cudnn"] = gpu::cudnn_version();
  info["nccl"] = nccl_version();
  info["hdf5"] = {{"version", io::hdf5_version()}, {"parallel", io::hdf5_is_parallel()}};
  info["onednn"] = dnnl_version();
  info["openmp"] = parallel_for_has_threads();
  info["plplot"] = plot::library_version();
  return info;
}

std::string or_none(const std::string& text) {
  return text.empty() ? "not built" : text;
}

}  // namespace

void register_info(CLI::App& app) {
  auto* command = app.add_subcommand("info", "Version, compiled-in backends and library versions");
  auto as_json = std::make_shared<bool>(false);
  command->add_flag("--json", *as_json, "Print JSON");
  command->callback([as_json] {
    const nlohmann::json info = collect_info();
    if (*as_json) {
      std::cout << info.dump(2) << "\n";
      return;
    }
    fmt::print("tessera {}\n", info["version"].get<std::string>());
    fmt::print("  backends        {}\n",
               fmt::join(info["backends"].get<std::vector<std::string>>(), ", "));
    fmt::print("  default backend {}\n", info["default_backend"].get<std::string>());
    fmt::print("  MPI             {}\n", or_none(info["mpi"]));
    fmt::print("  CUDA            {} (driver {}, {} device(s))\n", or_none(info["cuda"]["runtime"]),
               or_none(info["cuda"]["driver"]), info["cuda"]["devices"].get<int>());
    for (const auto& gpu : info["cuda"]["gpus"])
      fmt::print("                  {}\n", gpu.get<std::string>());
    fmt::print("  CUDA-aware MPI  {}\n", or_none(info["mpi_cuda_aware"]));
    fmt::print("  cuDNN           {}\n", or_none(info["cudnn"]));
    fmt::print("  NCCL            {}\n", or_none(info["nccl"]));
    fmt::print("  HDF5            {}{}\n", or_none(info["hdf5"]["version"]),
               info["hdf5"]["parallel"].get<bool>() ? " (parallel)" : "");
    fmt::print("  oneDNN          {}\n", or_none(info["onednn"]));
    fmt::print("  OpenMP          {}\n", info["openmp"].get<bool>() ? "yes" : "not built");
    fmt::print("  PLplot (plots)  {}\n", or_none(info["plplot"]));
  });
}

}  // namespace tessera::cli
