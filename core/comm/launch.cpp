// Backend selection, local ranks and rank devices (see launch.hpp).
#include "core/comm/launch.hpp"

#include <cstdlib>

#include "core/comm/local_comm.hpp"
#include "core/comm/mpi_comm.hpp"
#include "core/comm/nccl_comm.hpp"
#include "core/estimate/record.hpp"
#include "core/gpu_runtime.hpp"
#include "core/runtime/rank_context.hpp"
#include "core/trace.hpp"

namespace tessera {

Backend backend_from_env() {
  const char* text = std::getenv("TESSERA_BACKEND");
  return parse_backend(text ? text : "auto", launched_by_mpi_launcher(), mpi_compiled(),
                       nccl_compiled());
}

Device launch_device(int local_rank) {
  const char* text = std::getenv("TESSERA_DEVICE");
  const std::string requested = text ? text : "";
  // A cpu run asks nothing of CUDA (no driver call).
  if (requested.empty() || requested == "cpu") return Device::cpu();
  return default_rank_device(requested, local_rank, gpu::device_count());
}

void launch(Backend backend, int local_ranks,
            const std::function<void(std::shared_ptr<Comm>)>& user_body) {
  // `tessera estimate-record` (core/estimate/record.hpp): simulated ranks, no data.
  if (estimate::record_launch(local_ranks, user_body)) return;
  // Each rank's body runs traced when TESSERA_TRACE (or --trace) is on.
  const auto body = [&](std::shared_ptr<Comm> world) { trace::traced(world, user_body); };
  if (backend == Backend::local) {
    run_local_ranks(local_ranks, body);
    return;
  }
  if (backend == Backend::nccl && !launched_by_mpi_launcher()) {
    run_local_ranks(local_ranks, [&](std::shared_ptr<Comm> bootstrap) {
      body(make_nccl_comm(std::move(bootstrap)));
    });
    return;
  }
  std::shared_ptr<Comm> world = mpi_world();
  const Device device = launch_device(local_rank_from_env());
  if (device.is_cuda()) gpu::set_device(device.index);
  RankContextScope context(std::make_shared<RankContext>(device));
  body(backend == Backend::nccl ? make_nccl_comm(world) : world);
}

}  // namespace tessera
