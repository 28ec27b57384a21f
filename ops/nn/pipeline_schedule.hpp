// Pipeline schedules: the order in which one pipeline rank runs the forward and the backward of
// every micro-batch through its model chunks. Pure functions of (schedule, pp size, pp rank,
// micro-batches, chunks per rank), so they are tested without communication.
//
// Stage s of S = v * p stages lives on pp rank s % p as its chunk s / p (interleaved: v chunks
// per rank, round robin; otherwise v = 1 and stage s is rank s). A forward of stage s needs the
// forward of stage s - 1 for the same micro-batch, a backward of stage s the backward of stage
// s + 1; sends never block, so a schedule is correct when those dependencies never wait on a
// later action of the waiting rank (tests/unit/pipeline_schedule_test.cpp simulates it).
//   - GPipe: every forward, then every backward: M micro-batches' activations alive at once.
//   - 1F1B: p - r - 1 warm-up forwards, then one forward and one backward in turn, then the
//     remaining backwards: at most p - r micro-batches alive on rank r (p - s on stage s).
//   - Interleaved 1F1B (Megatron-LM's): forwards go through the chunks in groups of p micro-
//     batches, (p - r - 1) * 2 + (v - 1) * p warm-up forwards, then 1F1B; M must be a multiple
//     of p. Its bubble is v times smaller for v times more stage boundaries.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessera::nn {

/// Which micro-batch schedule a pipeline runs.
enum class PipelineSchedule : uint8_t { gpipe, one_f_one_b, interleaved };

/// "gpipe", "1f1b" or "interleaved".
std::string schedule_name(PipelineSchedule schedule);
/// The schedule named `name` (schedule_name's spelling); an error naming the choices otherwise.
PipelineSchedule parse_schedule(const std::string& name);

/// One step of a rank's schedule: the forward or the backward of one micro-batch through one of
/// the rank's model chunks (stage chunk * p + rank).
struct PipelineAction {
  enum class Kind : uint8_t { forward, backward };
  Kind kind = Kind::forward;
  int chunk = 0;
  int micro_batch = 0;
  bool operator==(const PipelineAction&) const = default;
};

/// The problem with running `stages` stages of `micro_batches` micro-batches under `schedule` on
/// `pp_size` pipeline ranks, or nullopt: GPipe and 1F1B need one stage per rank, interleaved a
/// multiple of at least two per rank and micro-batches a multiple of the pp size.
std::optional<std::string> schedule_problem(PipelineSchedule schedule, int pp_size, int stages,
                                            int micro_batches);

/// The actions of pp rank `pp_rank` of `pp_size`, in order, for `micro_batches` micro-batches
/// through `chunks` model chunks per rank (1 unless interleaved). Assumes schedule_problem
/// found nothing.
std::vector<PipelineAction> schedule_actions(PipelineSchedule schedule, int pp_size, int pp_rank,
                                             int micro_batches, int chunks);

/// The most (chunk, micro-batch) units whose forward has run and whose backward has not, at
/// once, in `actions`: the activations the schedule keeps alive.
int max_in_flight(const std::vector<PipelineAction>& actions);

/// The bubble fraction of `schedule` when every stage's forward and backward take the same time
/// and transfers none: (p - 1) / (m + p - 1), interleaved (p - 1) / (v m + p - 1).
double ideal_bubble_fraction(PipelineSchedule schedule, int pp_size, int micro_batches, int chunks);

}  // namespace tessera::nn
