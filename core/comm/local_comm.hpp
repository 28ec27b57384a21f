// The `local` backend: ranks are threads of one process sharing memory. Collectives are a
// rendezvous in which every rank reads its peers' buffers directly (no staging copies);
// point-to-point transfers are copied by the receiver straight from the sender's buffer. When
// either side of a copy is device memory, the reader copies on its comm stream after an event
// the publisher recorded on its compute stream, and finishes its copies before the closing
// rendezvous; reductions of device buffers run on the reader's device in rank order.
#pragma once

#include <functional>
#include <memory>

#include "core/comm/comm.hpp"

namespace tessera {

/// A rank of the local backend gave up because another rank of the same launch failed.
class PeerFailed : public CommError {
 public:
  using CommError::CommError;
};

/// The most local ranks (threads) one launch may run: more would oversubscribe any machine
/// Tessera targets by far, so a larger count is refused as a mistake.
inline constexpr int kMaxLocalRanks = 256;

/// Runs `body` on `ranks` (1 to kMaxLocalRanks) threads, each given its own world Comm of the
/// local backend and its RankContext on launch_device(thread index), and joins them. If any rank
/// throws, the others' waits fail promptly with PeerFailed, and the error of the lowest rank that
/// failed on its own is rethrown.
void run_local_ranks(int ranks, const std::function<void(std::shared_ptr<Comm>)>& body);

}  // namespace tessera
