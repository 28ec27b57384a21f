// Per-rank compute thread counts (see compute_threads.hpp).
#include "core/compute_threads.hpp"

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace tessera {

namespace {

thread_local int assigned_threads = 0;
thread_local bool assigned_by_user = false;

int env_int(const char* name) {
  const char* text = std::getenv(name);
  return text ? std::atoi(text) : 0;
}

/// Ranks of this MPI job on this node, as MPICH, Open MPI or Slurm report it (1 when unknown).
int ranks_on_node() {
  for (const char* name :
       {"MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"})
    if (const int ranks = env_int(name); ranks > 0) return ranks;
  return 1;
}

}  // namespace

int compute_threads() {
  if (const int forced = env_int("TESSERA_THREADS_PER_RANK"); forced > 0) return forced;
  if (assigned_threads > 0) return assigned_threads;
  // Once: std::thread::hardware_concurrency reads /sys/devices/system/cpu/online at every call
  // (glibc's get_nprocs), and the kernels ask for their threads at every call.
  static const int share = std::max(
      1, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) / ranks_on_node());
  return share;
}

void set_compute_threads(int threads) {
  assigned_threads = std::max(1, threads);
  assigned_by_user = false;
}

void choose_compute_threads(int threads) {
  assigned_threads = std::max(1, threads);
  assigned_by_user = true;
}

int chosen_compute_threads() {
  if (const int forced = env_int("TESSERA_THREADS_PER_RANK"); forced > 0) return forced;
  return assigned_by_user ? assigned_threads : 0;
}

}  // namespace tessera
