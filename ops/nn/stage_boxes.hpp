// Which box of a tensor moves from which rank of one pipeline stage to which rank of the next.
// The two stages live on meshes of the same shape (two slices of one mesh at different pp
// coordinates), each with its own layout of the tensor; every receiving rank gets exactly the
// box it owns in its layout, point to point, and nothing is gathered on one rank. Pure functions
// of the two layouts: both ends compute the same list without asking each other.
#pragma once

#include <cstdint>
#include <vector>

#include "core/layout.hpp"

namespace tessera::nn {

/// One piece of a transfer: `box` (global indices) goes from rank `sender` of the sending
/// stage's mesh to rank `receiver` of the receiving stage's mesh.
struct StageBox {
  int sender = 0;
  int receiver = 0;
  Box box;
  bool operator==(const StageBox&) const = default;
};

/// The pieces that move a tensor laid out as `from` on the sending stage's mesh into the layout
/// `to` on the receiving stage's mesh (same mesh shape, same global shape, neither Partial):
/// each element a receiver owns comes from the one sender that owns it and sits at the
/// receiver's coordinate on every mesh dim where `from` replicates (so replicas share the
/// sending). Ordered by receiver, then sender; empty pieces are left out.
std::vector<StageBox> stage_boxes(const ShardSpec& from, const ShardSpec& to);

/// Elements that `boxes` move in all (the bytes of a transfer are this times the element size).
int64_t stage_boxes_volume(const std::vector<StageBox>& boxes);

}  // namespace tessera::nn
