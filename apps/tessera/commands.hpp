// The subcommands of the tessera tool; each file registers its own on the CLI11 app.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "apps/tessera/cli_parse.hpp"
#include "core/comm/local_comm.hpp"

namespace tessera::cli {

/// CLI11 check: an integer of at least `minimum` (whole text), e.g. "expected an integer >= 1,
/// got 0"; negative values for unsigned options fail here, before CLI11 converts them.
inline CLI::Validator integer_at_least(long long minimum) {
  return CLI::Validator(
      [minimum](std::string& text) -> std::string {
        try {
          size_t used = 0;
          const long long value = std::stoll(text, &used);
          if (used == text.size() && value >= minimum) return "";
        } catch (const std::exception&) {
        }
        return "expected an integer >= " + std::to_string(minimum) + ", got " + text;
      },
      ">=" + std::to_string(minimum));
}

/// Adds --mesh, --shard-dims (described with `shard_dims_example`, e.g. "1,2"), --extents and
/// --ranks to `command`.
inline void add_mesh_options(CLI::App& command, MeshOptions& options,
                             const std::string& shard_dims_example) {
  command.add_option("--mesh", options.mesh, "Mesh shape, e.g. 2x2")->capture_default_str();
  command.add_option("--shard-dims", options.shard_dims,
                     "Tensor dim sharded by each mesh dim, e.g. " + shard_dims_example);
  command.add_option("--extents", options.extents, "Shard extents per mesh dim, e.g. \"3,5;4,4\"");
  command
      .add_option("--ranks", options.ranks,
                  "Local ranks without mpiexec, 1 to " + std::to_string(kMaxLocalRanks) +
                      " (default: the mesh size)")
      ->check(CLI::Range(1, kMaxLocalRanks));
}

/// `tessera info [--json]`: version, compiled-in backends and library versions.
void register_info(CLI::App& app);
/// `tessera demo`: the main job (scatter, redistribute through layouts, gather, verify).
void register_demo(CLI::App& app);
/// `tessera run-op conv` (and `run-op na`, and `run-op OP` for every other op with a
/// signature): a sharded op on data from an HDF5 file.
void register_run_op(CLI::App& app);
/// `tessera run-op na` (registered under `run-op` by register_run_op).
void register_run_op_na(CLI::App& run_op);
/// `tessera run-op OP` for every registered op with a signature and no command of its own
/// (registered under `run-op` by register_run_op).
void register_run_op_generic(CLI::App& run_op);
/// `tessera infer --model M.onnx --in IN.h5 --out OUT.h5`: a network exported from PyTorch,
/// sharded.
void register_infer(CLI::App& app);
/// `tessera train --model M.onnx --data D.h5 --input x --target y ...`: trains an exported
/// network on HDF5 samples over a dp x domain mesh (DDP, FSDP or hybrid sharding).
void register_train(CLI::App& app);
/// `tessera ops [--json]`: the registered ops, their signatures, devices and gradients.
void register_ops_list(CLI::App& app);
/// `tessera inspect FILE.h5` and `tessera scatter FILE.h5:/dataset`.
void register_io_commands(CLI::App& app);
/// `tessera generate gray-scott`: the sample data generator.
void register_generate(CLI::App& app);
/// `tessera simulate gray-scott`: the sharded Gray-Scott simulation writing HDF5 snapshots.
void register_simulate(CLI::App& app);
/// `tessera plot slice|losses|scaling|mesh`: PNG plots (apps/plot, docs/plots.md).
void register_plot(CLI::App& app);
/// `tessera estimate`: predict a traced run on a modeled machine, or calibrate this one.
void register_estimate(CLI::App& app);
/// `tessera estimate-record --ranks P --out EVENTS.json -- COMMAND ...`: a command recorded in
/// estimate mode on P simulated ranks.
void register_estimate_record(CLI::App& app);
/// `tessera bench comm`: collectives and redistribute beside the raw MPI collectives.
void register_bench(CLI::App& app);

/// `tessera bench conv` (registered under `bench` by register_bench).
void register_conv_bench(CLI::App& bench);

/// `tessera bench io` (registered under `bench` by register_bench).
void register_io_bench(CLI::App& bench);

/// `tessera bench na` (registered under `bench` by register_bench).
void register_na_bench(CLI::App& bench);

/// `tessera bench train` (registered under `bench` by register_bench).
void register_train_bench(CLI::App& bench);

/// `tessera bench ops`: every op of the op library, 1 rank vs 2, beside PyTorch (bench_ops.cpp).
void register_ops_bench(CLI::App& bench);

}  // namespace tessera::cli
