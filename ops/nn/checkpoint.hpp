// Training checkpoints: a Module's parameters, an optimizer's state and the run's counters (step,
// RNG seed, data position: any named integers) in one sharded, atomic checkpoint file
// (io::save_checkpoint), loadable onto any mesh and layout: the values are read onto the mesh of
// the module's first parameter and moved to each parameter's (and state buffer's) layout, so a
// run saved on 2x2 ranks continues on one rank or on another decomposition with the same losses.
//
// File layout: "model/<parameter path>", "optim/<state key>", "run/<counter>" (0-d i64: the
// caller's counters) and "counter/<module path>" (0-d i64: the module's counters, such as
// Dropout's call count, so resumed masks continue the uninterrupted run's) datasets, each with
// the attributes of docs/io.md ("Checkpoints"); with a GradScaler also "scaler/scale" (0-d f64)
// and "scaler/growth_tracker" (0-d i64).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "ops/nn/mixed_precision.hpp"
#include "ops/nn/module.hpp"
#include "ops/optim/optimizer.hpp"

namespace tessera::nn {

/// Collective over the module's mesh: writes the checkpoint (replacing `file` atomically).
void save_training_checkpoint(const std::string& file, const Module& module,
                              const optim::Optimizer& optimizer,
                              const std::map<std::string, int64_t>& counters = {},
                              const GradScaler* scaler = nullptr);

/// Collective: restores the module's parameters and the optimizer's state from `file` and returns
/// the counters. A file that lacks a parameter or state buffer, or holds unknown ones, raises one
/// error naming the key on every rank, before any value is written; so does a scaler state in
/// the file without a `scaler` to restore it into, or a `scaler` without its state in the file.
std::map<std::string, int64_t> load_training_checkpoint(const std::string& file, Module& module,
                                                        optim::Optimizer& optimizer,
                                                        GradScaler* scaler = nullptr);

}  // namespace tessera::nn
