// Pipeline schedules (ops/nn/pipeline_schedule.hpp).
#include "ops/nn/pipeline_schedule.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <utility>

#include "core/errors.hpp"

namespace tessera::nn {

std::string schedule_name(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::gpipe: return "gpipe";
    case PipelineSchedule::one_f_one_b: return "1f1b";
    case PipelineSchedule::interleaved: return "interleaved";
  }
  return "?";
}

PipelineSchedule parse_schedule(const std::string& name) {
  for (PipelineSchedule schedule :
       {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b, PipelineSchedule::interleaved})
    if (schedule_name(schedule) == name) return schedule;
  throw InvalidArgument("pipeline",
                        fmt::format("unknown schedule '{}' (gpipe, 1f1b or interleaved)", name));
}

std::optional<std::string> schedule_problem(PipelineSchedule schedule, int pp_size, int stages,
                                            int micro_batches) {
  if (pp_size < 1) return fmt::format("a pp size of {}", pp_size);
  if (micro_batches < 1) return fmt::format("{} micro-batches (at least 1)", micro_batches);
  if (schedule != PipelineSchedule::interleaved) {
    if (stages != pp_size)
      return fmt::format("{} stages for a pp size of {} ({} needs one stage per pp rank)", stages,
                         pp_size, schedule_name(schedule));
    return std::nullopt;
  }
  if (stages % pp_size != 0 || stages < 2 * pp_size)
    return fmt::format(
        "{} stages for a pp size of {} (interleaved needs a multiple of at least 2 per pp rank)",
        stages, pp_size);
  if (micro_batches % pp_size != 0)
    return fmt::format("{} micro-batches for a pp size of {} (interleaved needs a multiple of it)",
                       micro_batches, pp_size);
  return std::nullopt;
}

std::vector<PipelineAction> schedule_actions(PipelineSchedule schedule, int pp_size, int pp_rank,
                                             int micro_batches, int chunks) {
  using Kind = PipelineAction::Kind;
  std::vector<PipelineAction> actions;
  if (schedule == PipelineSchedule::gpipe) {
    for (int m = 0; m < micro_batches; ++m) actions.push_back({Kind::forward, 0, m});
    for (int m = 0; m < micro_batches; ++m) actions.push_back({Kind::backward, 0, m});
    return actions;
  }
  // 1F1B is the interleaved schedule with one chunk: units k = 0 .. v M - 1 in the order below,
  // forwards and backwards each in unit order.
  const int v = schedule == PipelineSchedule::interleaved ? chunks : 1;
  const int total = micro_batches * v;
  const int group = pp_size * v;  // p micro-batches through each of the v chunks
  auto unit = [&](Kind kind, int k) {
    int chunk = (k % group) / pp_size;
    if (kind == Kind::backward) chunk = v - 1 - chunk;  // backwards leave the last chunk first
    const int micro_batch = v == 1 ? k : (k / group) * pp_size + k % pp_size;
    return PipelineAction{kind, chunk, micro_batch};
  };
  // Warm-up: the forwards that must run before this rank's first backward can have its
  // gradient: p - r - 1 for 1F1B; with chunks, the rest of the first group plus the distance to
  // the last rank and back.
  const int warmup = v == 1 ? std::min(pp_size - pp_rank - 1, total)
                            : std::min((pp_size - pp_rank - 1) * 2 + (v - 1) * pp_size, total);
  for (int k = 0; k < warmup; ++k) actions.push_back(unit(Kind::forward, k));
  for (int k = 0; k < total - warmup; ++k) {
    actions.push_back(unit(Kind::forward, warmup + k));
    actions.push_back(unit(Kind::backward, k));
  }
  for (int k = total - warmup; k < total; ++k) actions.push_back(unit(Kind::backward, k));
  return actions;
}

int max_in_flight(const std::vector<PipelineAction>& actions) {
  std::set<std::pair<int, int>> alive;
  size_t most = 0;
  for (const PipelineAction& action : actions) {
    const std::pair<int, int> unit{action.chunk, action.micro_batch};
    if (action.kind == PipelineAction::Kind::forward)
      alive.insert(unit);
    else
      alive.erase(unit);
    most = std::max(most, alive.size());
  }
  return static_cast<int>(most);
}

double ideal_bubble_fraction(PipelineSchedule schedule, int pp_size, int micro_batches,
                             int chunks) {
  const int v = schedule == PipelineSchedule::interleaved ? chunks : 1;
  return static_cast<double>(pp_size - 1) / (v * micro_batches + pp_size - 1);
}

}  // namespace tessera::nn
