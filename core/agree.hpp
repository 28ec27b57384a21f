// Collective validation: a check whose outcome could differ between ranks is decided by all
// of them together, so a bad input raises the same error on every rank instead of leaving
// some ranks waiting in a collective that the failing rank never reaches.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "core/comm/comm.hpp"

namespace tessera {

/// An error that every rank of a communicator raised together (same op, same message).
class AgreedError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

/// Collective: if any rank passes an error message, every rank throws AgreedError with the
/// message of the lowest such rank (tagged with `op`). Costs one small all_reduce when all pass.
void agree_on_error(Comm& comm, const std::string& op, const std::optional<std::string>& error);

}  // namespace tessera

namespace tessera {

/// Collective: checks that every rank passed the same `description` (e.g. a ShardSpec's str);
/// otherwise every rank throws AgreedError naming two ranks that differ and what they passed.
void agree_on_description(Comm& comm, const std::string& op, const std::string& what,
                          const std::string& description);

/// Collective: agree_on_error, then agree_on_description of `description()` (not called on a
/// rank that passes an error), in one small all_reduce when every rank passes.
void agree_on_error_and_description(Comm& comm, const std::string& op,
                                    const std::optional<std::string>& error,
                                    const std::string& what,
                                    const std::function<std::string()>& description);

}  // namespace tessera
