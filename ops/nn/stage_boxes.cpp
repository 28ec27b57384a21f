// Stage-to-stage transfer pieces (ops/nn/stage_boxes.hpp).
#include "ops/nn/stage_boxes.hpp"

#include "core/errors.hpp"

namespace tessera::nn {

std::vector<StageBox> stage_boxes(const ShardSpec& from, const ShardSpec& to) {
  TESSERA_CHECK_ARG(from.mesh_shape == to.mesh_shape && from.global_shape == to.global_shape,
                    "pipeline",
                    "a transfer from {} to {} (the stages' meshes and the tensor's shape must "
                    "match)",
                    from.str(), to.str());
  TESSERA_CHECK_ARG(!from.has_partial() && !to.has_partial(), "pipeline",
                    "a transfer from {} to {} (Partial layouts are reduced before they move)",
                    from.str(), to.str());
  const int ranks = mesh_size(from.mesh_shape);
  std::vector<StageBox> boxes;
  for (int receiver = 0; receiver < ranks; ++receiver) {
    const std::vector<int> receiver_coord = coord_of(receiver, to.mesh_shape);
    const Box needed = to.local_box(receiver_coord);
    if (needed.empty()) continue;
    for (int sender = 0; sender < ranks; ++sender) {
      const std::vector<int> sender_coord = coord_of(sender, from.mesh_shape);
      bool serves = true;  // the replica of `from` at the receiver's coordinate sends
      for (size_t m = 0; m < from.placements.size(); ++m)
        if (from.placements[m].is_replicate() && sender_coord[m] != receiver_coord[m])
          serves = false;
      if (!serves) continue;
      const Box piece = intersect(from.local_box(sender_coord), needed);
      if (!piece.empty()) boxes.push_back({sender, receiver, piece});
    }
  }
  return boxes;
}

int64_t stage_boxes_volume(const std::vector<StageBox>& boxes) {
  int64_t volume = 0;
  for (const StageBox& piece : boxes) volume += piece.box.volume();
  return volume;
}

}  // namespace tessera::nn
