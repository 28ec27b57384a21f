// Training batches from an HDF5 dataset of samples, (samples, C, spatial..), on a ("dp", domain..)
// mesh: every step's global batch is `batch_size` samples in a deterministic (seeded) order;
// the batch dim is split over the "dp" mesh dim (different ranks of it get different samples) and
// the spatial dims over the domain mesh dims (each rank reads only its spatial box of its own
// samples, straight from the file, which each rank opens once for the reader's lifetime). A
// background thread reads the next batches while the caller computes on the current one; next()
// hands the batch over on the calling rank's device (one host-to-device copy of the rank's piece
// on cuda).
//
//   io::BatchReader reader("runs.h5", "/snapshots", mesh, {.batch_size = 8, .seed = 1});
//   for (int step = 0; step < 1000; ++step) {
//     ShardTensor batch = reader.next();  // [8, C, X, Y, Z], Shard(0) over dp, spatial shards
//     ...
//   }
//
// Order: epoch e visits every sample once, in a permutation of 0..samples-1 drawn by a
// Fisher-Yates shuffle driven by std::mt19937_64 seeded from (seed, e); the same seed gives the
// same order on every machine and library. Step t of epoch e is samples
// order[t*batch_size, (t+1)*batch_size); with drop_last the incomplete tail of an epoch is
// skipped, otherwise it is a smaller last batch. The reader never changes the order of the
// samples a batch holds, so batch row r is always order[t*batch_size + r].
//
// Errors: the constructor and next() are collective over the mesh; a bad dataset or option, or a
// read failure on any rank (also one met by the background thread) is raised as the same
// AgreedError on every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/shard_tensor.hpp"

namespace tessera::io {

struct BatchReaderOptions {
  int64_t batch_size = 1;     ///< samples per step over all dp ranks
  uint64_t seed = 0;          ///< shuffling seed (the same on every rank)
  bool shuffle = true;        ///< false: samples in file order
  bool drop_last = true;      ///< skip an epoch's incomplete last batch
  int read_ahead = 2;         ///< batches read ahead on a background thread (0: read in next())
  std::string dp_dim = "dp";  ///< mesh dim splitting the batch; absent from the mesh: none
  /// For every mesh dim other than dp_dim, in order: the dim of the (samples, C, spatial..)
  /// dataset it shards (>= 1), or -1 to replicate over it. Empty: the first non-dp mesh dim
  /// shards dim 2, the next dim 3, and so on.
  std::vector<int> shard_dims = {};
  /// Extents of the sharded spatial dims per mesh dim (as in ShardSpec; empty: default split).
  std::vector<std::vector<int64_t>> extents = {};
  std::optional<DType> as =
      std::nullopt;  ///< convert the elements on read (default: the file's dtype)
};

/// Where next() is: the epoch and step of the batch it returns next.
struct BatchPosition {
  int64_t epoch = 0;
  int64_t step = 0;
  bool operator==(const BatchPosition&) const = default;
};

class BatchReader {
 public:
  /// Collective: checks the dataset and options (AgreedError on every rank when bad) and starts
  /// reading ahead from epoch 0, step 0.
  BatchReader(std::string file, std::string dataset, const DeviceMesh& mesh,
              BatchReaderOptions options);
  ~BatchReader();
  BatchReader(const BatchReader&) = delete;
  BatchReader& operator=(const BatchReader&) = delete;

  /// Collective: the batch at position(), then advances (to the next epoch after its last step).
  ShardTensor next();
  /// The position of the batch next() returns.
  BatchPosition position() const;
  /// Continues from `position` (e.g. when training resumes from a checkpoint); the same on every
  /// rank. Batches read ahead for other positions are dropped.
  void seek(BatchPosition position);

  /// Samples in the dataset (its leading extent).
  int64_t samples() const;
  /// Shape of one sample, (C, spatial..).
  Shape sample_shape() const;
  /// Steps in one epoch.
  int64_t steps_per_epoch() const;
  /// The dataset indices of the samples of the batch at `position`, in batch order.
  std::vector<int64_t> batch_samples(BatchPosition position) const;
  /// The permutation of 0..samples-1 that epoch `epoch` visits (identity without shuffle).
  std::vector<int64_t> epoch_order(int64_t epoch) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace tessera::io
