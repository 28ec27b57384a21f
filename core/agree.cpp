// agree_on_error: one all_reduce(min) of the first failing rank, then a broadcast of its text.
// agree_on_description: one all_reduce(max) of a fingerprint and its negation. Both in one
// all_reduce: agree_on_error_and_description.
#include "core/agree.hpp"

#include <functional>

namespace tessera {

namespace {

/// After the reduce: every rank throws the error of rank `first_failing` (its text broadcast).
[[noreturn]] void throw_error_of(Comm& comm, const std::string& op, int first_failing,
                                 const std::optional<std::string>& error) {
  int64_t length = comm.rank() == first_failing ? static_cast<int64_t>(error->size()) : 0;
  comm.broadcast(&length, 1, DType::i64, first_failing);
  std::string message = comm.rank() == first_failing ? *error : std::string(length, ' ');
  comm.broadcast(message.data(), static_cast<size_t>(length), DType::u8, first_failing);
  throw AgreedError(op, message);
}

int64_t fingerprint_of(const std::string& description) {
  return static_cast<int64_t>(std::hash<std::string>{}(description) >> 1);
}

/// The rare path once fingerprints differ: collects every description and throws naming the
/// first rank whose description differs from rank 0's (returns when they are all equal).
void name_disagreement(Comm& comm, const std::string& op, const std::string& what,
                       const std::string& description) {
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

}  // namespace

void agree_on_error(Comm& comm, const std::string& op, const std::optional<std::string>& error) {
  int32_t first_failing = error ? comm.rank() : comm.size();
  comm.all_reduce(&first_failing, &first_failing, 1, DType::i32, ReduceOp::min);
  if (first_failing == comm.size()) return;
  throw_error_of(comm, op, first_failing, error);
}

void agree_on_description(Comm& comm, const std::string& op, const std::string& what,
                          const std::string& description) {
  int64_t fingerprint[2];
  fingerprint[0] = fingerprint_of(description);
  fingerprint[1] = -fingerprint[0];
  comm.all_reduce(fingerprint, fingerprint, 2, DType::i64, ReduceOp::max);
  if (fingerprint[0] == -fingerprint[1]) return;
  name_disagreement(comm, op, what, description);
}

void agree_on_error_and_description(Comm& comm, const std::string& op,
                                    const std::optional<std::string>& error,
                                    const std::string& what,
                                    const std::function<std::string()>& description) {
  // max of -(first failing rank) is min of the first failing rank.
  int64_t values[3] = {-static_cast<int64_t>(error ? comm.rank() : comm.size()), 0, 0};
  const std::string mine = error ? std::string() : description();
  if (!error) {
    values[1] = fingerprint_of(mine);
    values[2] = -values[1];
  }
  comm.all_reduce(values, values, 3, DType::i64, ReduceOp::max);
  const int first_failing = static_cast<int>(-values[0]);
  if (first_failing != comm.size()) throw_error_of(comm, op, first_failing, error);
  if (values[1] == -values[2]) return;
  name_disagreement(comm, op, what, mine);
}

}  // namespace tessera
