// How many threads one rank's compute kernels (oneDNN, OpenMP loops) may use. Several local
// ranks share one process and the cores; several MPI ranks may share a node. Each rank gets
// its share so that kernels do not oversubscribe the cores.
#pragma once

namespace tessera {

/// Threads this rank's kernels use: TESSERA_THREADS_PER_RANK when set; else the cores of the
/// machine divided by the ranks sharing them (local ranks of this launch, or the MPI ranks on
/// this node as the launcher reports them), at least 1.
int compute_threads();

/// Sets this thread's share (run_local_ranks calls it on every rank thread).
void set_compute_threads(int threads);

}  // namespace tessera
