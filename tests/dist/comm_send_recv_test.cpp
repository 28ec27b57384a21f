// Distributed tests of Comm's batched point-to-point transfers (start_send_recv / wait): a ring
// exchange in both directions in one batch (uneven and empty messages, self-messages on one
// rank), and in-order arrival of messages that share a peer and a tag.
#include <gtest/gtest.h>

#include <cstring>

#include "tests/dist/harness.hpp"

namespace tessera {
namespace {

/// Bytes of the message `sender` sends in direction `direction` (0 = right, 1 = left): uneven,
/// zero for some senders.
size_t message_bytes(int sender, int direction) {
  return static_cast<size_t>((sender * 5 + direction * 3) % 7) * 3;
}

/// Fills a message with bytes identifying (sender, direction, position).
std::vector<uint8_t> message(int sender, int direction, int serial = 0) {
  std::vector<uint8_t> bytes(message_bytes(sender, direction) + serial);
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<uint8_t>(sender * 31 + direction * 7 + serial * 13 + i);
  return bytes;
}

TEST(CommSendRecv, RingExchangeInBothDirectionsInOneBatch) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank(), size = comm->size();
    const int right = (rank + 1) % size, left = (rank + size - 1) % size;
    for (int tag_mode = 0; tag_mode < 2; ++tag_mode) {
      // tag_mode 0: one tag for both directions (with 1 or 2 ranks both messages go to the same
      // peer, and arrive in the order posted); tag_mode 1: a tag per direction.
      const int right_tag = tag_mode ? 11 : 5, left_tag = tag_mode ? 12 : 5;
      const std::vector<uint8_t> to_right = message(rank, 0), to_left = message(rank, 1);
      std::vector<uint8_t> from_left(message_bytes(left, 0), 0xee);
      std::vector<uint8_t> from_right(message_bytes(right, 1), 0xee);
      const P2POp ops[] = {
          P2POp::send(to_right.data(), to_right.size(), right, right_tag),
          P2POp::send(to_left.data(), to_left.size(), left, left_tag),
          P2POp::recv(from_left.data(), from_left.size(), left, right_tag),
          P2POp::recv(from_right.data(), from_right.size(), right, left_tag),
      };
      comm->send_recv(ops);
      EXPECT_EQ(from_left, message(left, 0)) << "rank " << rank << " of " << size;
      EXPECT_EQ(from_right, message(right, 1)) << "rank " << rank << " of " << size;
    }
  });
}

TEST(CommSendRecv, StartReturnsBeforeTheTransfersComplete) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank(), size = comm->size();
    const int right = (rank + 1) % size, left = (rank + size - 1) % size;
    int64_t received = -1;
    // Post the receive first: it can only complete after the peer posts its send below.
    const P2POp recv_op = P2POp::recv(&received, sizeof received, left, 3);
    auto receiving = comm->start_send_recv({&recv_op, 1});
    const int64_t value = 1000 + rank;
    const P2POp send_op = P2POp::send(&value, sizeof value, right, 3);
    auto sending = comm->start_send_recv({&send_op, 1});
    receiving->wait();
    sending->wait();
    EXPECT_EQ(received, 1000 + left);
  });
}

TEST(CommSendRecv, MessagesWithTheSameTagArriveInTheOrderPosted) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    const int rank = comm->rank(), size = comm->size();
    const int right = (rank + 1) % size, left = (rank + size - 1) % size;
    constexpr int messages = 6;
    constexpr int tag = 9;
    // Sizes differ per message, so a receive matched out of order would fail its size check
    // as well as its contents.
    std::vector<std::vector<uint8_t>> outgoing, incoming;
    for (int serial = 0; serial < messages; ++serial) {
      outgoing.push_back(message(rank, 0, serial));
      incoming.emplace_back(message_bytes(left, 0) + serial, 0xee);
    }
    // Two batches of sends (the second posted before the first completes) and one batch of
    // receives posted last.
    std::vector<P2POp> first_sends, second_sends, receives;
    for (int serial = 0; serial < messages; ++serial) {
      auto& batch = serial < messages / 2 ? first_sends : second_sends;
      batch.push_back(P2POp::send(outgoing[serial].data(), outgoing[serial].size(), right, tag));
      receives.push_back(P2POp::recv(incoming[serial].data(), incoming[serial].size(), left, tag));
    }
    auto first = comm->start_send_recv(first_sends);
    auto second = comm->start_send_recv(second_sends);
    comm->send_recv(receives);
    first->wait();
    second->wait();
    for (int serial = 0; serial < messages; ++serial)
      EXPECT_EQ(incoming[serial], message(left, 0, serial))
          << "message " << serial << " on rank " << rank << " of " << size;
  });
}

TEST(CommSendRecv, EmptyBatchesAndZeroByteMessagesComplete) {
  testing::run_every_world([](std::shared_ptr<Comm> comm) {
    comm->send_recv({});
    const int peer = comm->size() - 1 - comm->rank();  // mirror image; the middle rank self-sends
    const P2POp ops[] = {P2POp::send(nullptr, 0, peer, 1), P2POp::recv(nullptr, 0, peer, 1)};
    comm->send_recv(ops);
    SUCCEED();
  });
}

}  // namespace
}  // namespace tessera
