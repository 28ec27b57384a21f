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

/// Sets this thread's count as the user chose it (a command's --threads): a trace records it, so
/// that an estimate prices the rank with the cores it really used.
void choose_compute_threads(int threads);

/// The count the user chose for this rank (TESSERA_THREADS_PER_RANK or choose_compute_threads),
/// 0 when the rank runs with its default share of the cores.
int chosen_compute_threads();

}  // namespace tessera
