// The simulated communicator of estimate mode: P ranks (up to kMaxSimulatedRanks) are threads of
// this process that run the real program on shape-only tensors. A buffer that is null (a
// shape-only tensor's comm_data()) is a payload: its message is not moved, only recorded by the
// trace's recording communicator around this one. Real buffers (counts, shapes, agreed errors:
// the metadata that decides control flow) are copied exactly as the local backend would.
//
// Collectives rendezvous once (every rank of the communicator, whatever its buffers, so the
// ranks agree on the order of collectives); each rank publishes a copy of its real send bytes
// in a slot and reads what it needs from the others' slots. Slots alternate between two banks,
// so a rank that leaves collective k may publish for k+1 while slower ranks still read k.
// Point-to-point payloads are not matched at all; real point-to-point bytes go through a
// mailbox. Every rank does O(P) work per collective, never O(P^2).
#pragma once

#include <functional>
#include <memory>

#include "core/comm/comm.hpp"

namespace tessera::estimate {

/// The most simulated ranks one recording may run.
inline constexpr int kMaxSimulatedRanks = 4096;

/// Runs `body` on `ranks` (1 to kMaxSimulatedRanks) threads, each given its rank of a simulated
/// world communicator and a cpu RankContext, and joins them. The threads have small stacks
/// (estimate mode runs no kernels). If a rank throws, the others' waits fail promptly and the
/// error of the lowest rank that failed on its own is rethrown.
void run_simulated_ranks(int ranks, const std::function<void(int, std::shared_ptr<Comm>)>& body);

}  // namespace tessera::estimate
