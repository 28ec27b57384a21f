// agree_on_error: one all_reduce(min) of the first failing rank, then a broadcast of its text.
#include "core/agree.hpp"

#include <functional>

namespace tessera {

void agree_on_error(Comm& comm, const std::string& op, const std::optional<std::string>& error) {
  int32_t first_failing = error ? comm.rank() : comm.size();
  comm.all_reduce(&first_failing, &first_failing, 1, DType::i32, ReduceOp::min);
  if (first_failing == comm.size()) return;
  int64_t length = comm.rank() == first_failing ? static_cast<int64_t>(error->size()) : 0;
  comm.broadcast(&length, 1, DType::i64, first_failing);
  std::string message = comm.rank() == first_failing ? *error : std::string(length, ' ');
  comm.broadcast(message.data(), static_cast<size_t>(length), DType::u8, first_failing);
  throw AgreedError(op, message);
}

}  // namespace tessera

namespace tessera {

void agree_on_description(Comm& comm, const std::string& op, const std::string& what,
                          const std::string& description) {
  int64_t fingerprint[2];
  fingerprint[0] = static_cast<int64_t>(std::hash<std::string>{}(description) >> 1);
  fingerprint[1] = -fingerprint[0];
  comm.all_reduce(fingerprint, fingerprint, 2, DType::i64, ReduceOp::max);
  if (fingerprint[0] == -fingerprint[1]) return;
  // Rare path: collect every description to name the disagreeing ranks.
  const int64_t length = static_cast<int64_t>(description.size());
  std::vector<int64_t> lengths(comm.size());
  std::vector<size_t> ones(comm.size(), 1);
  comm.all_gather_v(&length, 1, lengths.data(), ones, DType::i64);
  std::vector<size_t> counts(lengths.begin(), lengths.end());
  std::string all(displacements_of(counts).back() + counts.back(), ' ');
  comm.all_gather_v(description.data(), description.size(), all.data(), counts, DType::u8);
  const std::vector<size_t> displs = displacements_of(counts);
  const std::string first = all.substr(0, counts[0]);
  for (int r = 1; r < comm.size(); ++r) {
    const std::string other = all.substr(displs[r], counts[r]);
    if (other != first)
      throw AgreedError(
          op, fmt::format("ranks disagree about the {}: rank 0 has {}, rank {} has {}", what, first,
                          r, other));
  }
}

}  // namespace tessera
