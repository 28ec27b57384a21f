// Harness of the distributed tests: run_world runs a test body on every rank of a world of a
// given size, on the backend chosen by TESSERA_BACKEND. Under `mpi` the launcher fixes the world
// size, so only the bodies asking for exactly that size run (the others do nothing); under
// `local` every size runs on threads. Tests loop over world sizes 1..8 and over every mesh
// factorization (tests/common/layout_cases.hpp), so one binary covers the local backend fully
// and `mpiexec -n N` covers size N.
//
// Rules for bodies, so a failing check cannot deadlock the other ranks: use EXPECT_* (not
// ASSERT_*) for anything that guards a collective, and make every rank reach the same
// collectives. TESSERA_COMM_TIMEOUT (set by CTest) turns a hang into an error anyway.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/tessera.hpp"
#include "tests/common/layout_cases.hpp"

namespace tessera::testing {

/// The largest world size the tests loop over.
inline constexpr int max_world_size = 8;

/// True when the tests run under mpiexec with TESSERA_BACKEND=mpi.
inline bool mpi_backend() {
  return backend_from_env() == Backend::mpi;
}

/// Runs `body` on every rank of a world of `world_size` ranks: under the mpi backend with the
/// MPI world, only when its size is `world_size` (otherwise nothing runs); under the local
/// backend on `world_size` threads.
inline void run_world(int world_size, std::function<void(std::shared_ptr<Comm>)> body) {
  if (mpi_backend()) {
    std::shared_ptr<Comm> world = mpi_world();
    if (world->size() == world_size) body(world);
    return;
  }
  run_local_ranks(world_size, body);
}

/// Rank 0's results of `body` on a world of `world_size` ranks (run_world), first with the cpu
/// halo overlap on, then off; the switch is restored after. Both empty where the world does not
/// run (under mpiexec, a size other than the launcher's).
inline std::array<std::vector<Tensor>, 2> with_and_without_cpu_overlap(
    int world_size, const std::function<std::vector<Tensor>(std::shared_ptr<Comm>)>& body) {
  struct Restore {
    bool before = halo_overlap(Device::Kind::cpu);
    ~Restore() { set_halo_overlap(Device::Kind::cpu, before); }
  } restore;
  std::array<std::vector<Tensor>, 2> results;  // [0]: overlap on, [1]: off
  for (int off = 0; off < 2; ++off) {
    set_halo_overlap(Device::Kind::cpu, off == 0);
    run_world(world_size, [&](std::shared_ptr<Comm> comm) {
      std::vector<Tensor> result = body(comm);
      if (comm->rank() == 0) results[off] = std::move(result);
    });
  }
  return results;
}

/// run_world for every world size 1..max_world_size.
inline void run_every_world(const std::function<void(std::shared_ptr<Comm>)>& body) {
  for (int world_size = 1; world_size <= max_world_size; ++world_size) run_world(world_size, body);
}

/// Collective: every rank's `text`, in rank order.
inline std::vector<std::string> all_gather_strings(Comm& comm, const std::string& text) {
  const int64_t length = static_cast<int64_t>(text.size());
  std::vector<int64_t> lengths(comm.size());
  const std::vector<size_t> ones(comm.size(), 1);
  comm.all_gather_v(&length, 1, lengths.data(), ones, DType::i64);
  const std::vector<size_t> counts(lengths.begin(), lengths.end());
  const std::vector<size_t> displs = displacements_of(counts);
  std::string all(displs.back() + counts.back(), '\0');
  comm.all_gather_v(text.data(), text.size(), all.data(), counts, DType::u8);
  std::vector<std::string> texts;
  for (int r = 0; r < comm.size(); ++r) texts.push_back(all.substr(displs[r], counts[r]));
  return texts;
}

/// Collective: true on every rank when `condition` holds on every rank.
inline bool all_ranks(Comm& comm, bool condition) {
  int32_t value = condition ? 1 : 0;
  comm.all_reduce(&value, &value, 1, DType::i32, ReduceOp::min);
  return value == 1;
}

/// max |a - b| over the largest finite |b| (at least 1e-12): the error of `a` relative to `b`'s
/// scale. An infinity equal in both (a max_pool window with no real cell is -inf) counts as no
/// error; one in only one of them, or of the other sign, is an infinite error; a NaN in either
/// gives NaN (both fail every bound).
inline double relative_error(const Tensor& a, const Tensor& b) {
  check_arg(a.shape() == b.shape(), "test", "relative_error of shapes {} and {}", a.shape(),
            b.shape());
  const Tensor actual = a.to(Device::cpu()).to_dtype(DType::f64).contiguous();
  const Tensor reference = b.to(Device::cpu()).to_dtype(DType::f64).contiguous();
  double scale = 1e-12, worst = 0;
  for (int64_t i = 0; i < reference.numel(); ++i) {
    const double x = actual.data<double>()[i], y = reference.data<double>()[i];
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::quiet_NaN();
    if (std::isinf(x) || std::isinf(y)) {
      if (x != y) return std::numeric_limits<double>::infinity();
      continue;
    }
    scale = std::max(scale, std::fabs(y));
    worst = std::max(worst, std::fabs(x - y));
  }
  return worst / scale;
}

/// "(2, 2, 1)".
inline std::string shape_str(const std::vector<int>& shape) {
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + ")";
}

}  // namespace tessera::testing
