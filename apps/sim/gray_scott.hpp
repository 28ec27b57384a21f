// The domain-decomposed 3-d Gray-Scott simulation behind `tessera simulate gray-scott` (and
// `tessera generate gray-scott`). The scheme, exactly (docs/simulation.md):
//  - periodic grid [X, Y, Z], fields u and v; parameters Du, Dv, F (feed), k (kill), dt are
//    converted to the field's dtype first, and every operation below runs in that dtype;
//  - initial state u = 1, v = 0, then 6 cubes from a xorshift64 stream (state = seed *
//    0x9E3779B97F4A7C15 + 1; draw: state ^= state << 13, state ^= state >> 7, state ^= state <<
//    17, return state % range); per cube cx = draw(X), cy = draw(Y), cz = draw(Z); half =
//    max(1, min(X, Y, Z) / 10); each cell whose every coordinate is within half of the centre
//    (periodically) gets u = 0.5, v = 0.25;
//  - one step: lap(f) = f[x-1] + f[x+1] + f[y-1] + f[y+1] + f[z-1] + f[z+1] - 6 f (summed left
//    to right), uvv = (u v) v, u' = u + dt ((Du lap(u) - uvv) + F (1 - u)),
//    v' = v + dt ((Dv lap(v) + uvv) - (F + k) v), with F + k added in the dtype; no fused
//    multiply-add, so every layout, rank count and device gives the same bits.
// Each rank keeps its box of u and v with a halo of width 1 (periodic, through the halo plan);
// a step starts the halo exchange, updates the cells that need no halo while messages travel,
// then the boundary shell.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tessera.hpp"

namespace tessera::sim {

/// The model's parameters (defaults: the issue's).
struct GrayScottParams {
  double du = 0.16, dv = 0.08, feed = 0.035, kill = 0.065, dt = 1.0;
};

/// What one simulation is: grid, steps, snapshot interval, seed, dtype and parameters.
struct GrayScottConfig {
  Shape size{64, 64, 64};  ///< X, Y, Z
  int64_t steps = 100;     ///< N: time steps asked for
  int64_t every = 10;      ///< K: a snapshot after every K steps
  uint64_t seed = 7;
  DType dtype = DType::f32;
  GrayScottParams params;

  /// T = 1 + N / K snapshots (the initial state, then one after every K steps).
  int64_t snapshots() const { return 1 + steps / every; }
  /// The steps that are run: (T - 1) K. Trailing steps past the last snapshot (N mod K) would
  /// be stored nowhere and are not run.
  int64_t steps_run() const { return (snapshots() - 1) * every; }
};

/// Throws InvalidArgument tagged "simulate" naming the first bad value: a grid of other than 3
/// dims or with an extent below 3, steps < 0, every < 1, a dtype other than f32/f64, a
/// parameter that is not finite.
void check_config(const GrayScottConfig& config);

/// The initial cubes: their centres (x, y, z) in draw order and their half width.
struct InitialCubes {
  std::vector<std::array<int64_t, 3>> centres;
  int64_t half = 1;
};

/// The 6 cubes of `seed` on a grid of `size` (the xorshift64 stream of the scheme).
InitialCubes initial_cubes(const Shape& size, uint64_t seed);

/// The initial values of species `species` (0: u, 1: v) on the global index box `box` of the
/// grid, as a contiguous cpu tensor of `config.dtype`.
Tensor initial_field(const GrayScottConfig& config, int species, const Box& box);

/// One step of the scheme for the owned cells `cells` (owned-piece coordinates) of haloed
/// fields: u and v are [nx + 2, ny + 2, nz + 2] contiguous with valid halos around the cells
/// read, u_next and v_next the same shape; only the cells' interior positions are written. Runs
/// on the fields' device (cpu: parallel_for over rows, a vectorizable loop along z; cuda: one
/// kernel on the rank's compute stream).
void step_cells(const Tensor& u, const Tensor& v, const Tensor& u_next, const Tensor& v_next,
                const Box& cells, const GrayScottParams& params);

/// The sharded state of one simulation on a mesh: u and v of this rank's box, haloed.
class GrayScott {
 public:
  /// Collective: the initial state of `config` on `mesh`, the grid [X, Y, Z] laid out by
  /// `placements` (one per mesh dim) and `extents` (empty: balanced), on the rank's device.
  /// Bad layouts are AgreedErrors tagged "simulate".
  GrayScott(const DeviceMesh& mesh, std::vector<Placement> placements,
            std::vector<std::vector<int64_t>> extents, GrayScottConfig config);

  /// Collective: one time step (halo exchange overlapped with the interior update).
  void step();
  /// Steps taken since the initial state.
  int64_t steps_done() const { return steps_done_; }
  /// Species `species` (0: u, 1: v) as a ShardTensor [X, Y, Z] (a copy of this rank's box).
  ShardTensor field(int species) const;
  /// Replaces the state by this rank's boxes `u` and `v` (of the layout's local shape, any
  /// device) at `steps_done` steps.
  void set_state(const Tensor& u, const Tensor& v, int64_t steps_done);
  /// The layout of each field.
  const ShardSpec& spec() const { return spec_; }
  /// The configuration.
  const GrayScottConfig& config() const { return config_; }

 private:
  DeviceMesh mesh_;
  GrayScottConfig config_;
  ShardSpec spec_;
  std::shared_ptr<const HaloPlan> plan_;
  /// Per dim: whether ranks split it (its halo comes from another rank); an unsplit dim's
  /// periodic halo is a copy that halo_begin makes before it returns.
  std::array<bool, 3> split_{};
  std::array<Tensor, 2> fields_, next_;  // haloed u, v; next state
  int64_t steps_done_ = 0;
};

/// How simulate() writes and reports.
struct SimulateOptions {
  std::string out;       ///< the run's HDF5 file (dataset /snapshots)
  bool restart = false;  ///< continue from the last snapshot written in `out`
  int gzip_level = -1;   ///< compress the snapshots (only for independent writes)
  /// Called on rank 0 after every step with (steps done, steps to do); may be empty.
  std::function<void(int64_t, int64_t)> progress;
  /// Called on rank 0 with t once snapshot t is complete in `out` (every box written, `written`
  /// updated), outside the write timing; may be empty. It must not change the file.
  std::function<void(int64_t)> snapshot_written;
};

/// What a simulate() run did (the same on every rank).
struct SimulateReport {
  int64_t first_step = 0;            ///< the step it started from (0, or the restart's)
  int64_t steps_run = 0;             ///< steps taken in this call
  int64_t snapshots_written = 0;     ///< snapshots written in this call
  std::vector<double> step_seconds;  ///< per step, the slowest rank's time
  double write_seconds = 0;          ///< time spent writing snapshots
  int64_t bytes_written = 0;         ///< element bytes of the snapshots written
  double total_seconds = 0;
};

/// Collective: runs `config` on `mesh` and writes RUN.h5:/snapshots [T, 2, X, Y, Z] (the
/// parameters as attributes; `written` counts the snapshots complete), every rank writing its own
/// box of each snapshot when it is reached. With `restart`, reopens the file, checks that its
/// attributes match `config` (AgreedError tagged "simulate" otherwise) and continues from its
/// last written snapshot.
SimulateReport simulate(const DeviceMesh& mesh, std::vector<Placement> placements,
                        std::vector<std::vector<int64_t>> extents, const GrayScottConfig& config,
                        const SimulateOptions& options);

/// The attributes of /snapshots that describe `config` (restart compares them).
std::map<std::string, std::string> snapshot_attributes(const GrayScottConfig& config);

/// Bytes per second of a large single-threaded memcpy (bytes read plus bytes written over the
/// time of the best of a few copies of `bytes`).
double copy_bandwidth(size_t bytes = size_t{256} << 20);

}  // namespace tessera::sim
