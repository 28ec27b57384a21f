// A parallel loop over an index range for the CPU kernels: OpenMP threads when Tessera is built
// with OpenMP (parallel_for_openmp.cpp), otherwise a plain loop on the calling thread
// (parallel_for_serial.cpp). CMake picks the file; kernels never test for OpenMP themselves.
#pragma once

#include <cstdint>
#include <functional>

namespace tessera {

/// Calls body(begin, end, slot) on disjoint chunks [begin, end) that together cover [0, count),
/// on up to `threads` threads. `slot` is in [0, threads) and no two chunks running at the same
/// time share one, so a body may accumulate into per-slot buffers without locks. Chunks are
/// handed out dynamically (a few per thread). An exception thrown by a body is rethrown here
/// after every thread has stopped.
void parallel_for(int64_t count, int threads,
                  const std::function<void(int64_t begin, int64_t end, int slot)>& body);

/// Whether parallel_for can run on more than one thread in this build.
bool parallel_for_has_threads();

}  // namespace tessera
