// The cuDNN convolution through cuDNN's graph (backend) API, the default (conv_cudnn.cpp calls
// it instead of the legacy calls unless TESSERA_CUDNN_API=legacy). A conv is one operation
// graph; the engine configurations cuDNN's heuristics list for it (modes A and fallback) are
// filtered by the conv's numerical contract (cudnn_engine_allowed), built into execution plans,
// timed on the operands once per key and process (one measurement at a time), and the fastest that
// fits the workspace limit and the determinism rule (choose_algorithm) is kept. Plans hold the
// cuDNN handle they were built with, so each thread builds its own from the process-wide choice.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/runtime/rank_context.hpp"
#include "ops/conv/conv_cudnn_key.hpp"

namespace tessera::ops {

/// Queues the convolution `key` describes on `stream` (the device current), reading and writing
/// the operands at `x`, `w`, `y` (forward terms: the direction's output is written, scaled by 1,
/// nothing added). `what` names the conv in errors and logs.
void conv_graph_run(const CudnnConvKey& key, void* x, void* w, void* y, const Stream& stream,
                    const std::string& what);

/// Builds and finalizes the descriptors of `key`'s graph that need no device: the three tensors,
/// the convolution, its operation and the operation graph (not bound to a handle). Throws as
/// conv_graph_run would when cuDNN refuses one. For the tests on machines without a GPU.
void conv_graph_check_descriptors(const CudnnConvKey& key);

/// How many keys have a chosen engine (one measurement each).
size_t conv_graph_cached_choices();

/// The engines chosen so far, one line per key (for bench conv's JSON and TESSERA_CUDNN_LOG).
std::vector<std::string> conv_graph_choices();

}  // namespace tessera::ops
