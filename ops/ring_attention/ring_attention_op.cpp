// attention over a sharded sequence: rule, ring forward and backward (cpu), registration.
//
// Layouts: q keeps its placements on B, Sq and heads (D is never sharded); k and v take q's
// placements on B and heads, and along the sequence the mesh dim that shards q's (their own
// extents when they are sharded that way, else the default split); a second mesh dim sharding
// the sequence replicates instead. The ring is that mesh dim's sub-communicator: at step t rank
// r holds the K/V block of rank r - t and, while it computes with it, passes it on to r + 1
// (start_send_recv before the compute, wait after). Every query row keeps (max, sum, acc) of an
// online softmax in f64; blocks entirely above a causal diagonal are skipped. o = acc / sum,
// lse = max + log(sum). Backward (FlashAttention's): with D_i = dO_i . o_i, each rank computes
// p = exp(s - lse) for the block it holds, adds dq += scale ds k, and adds into the block's
// travelling dK, dV, which arrive back at their owner after P passes. Sums run in another order
// than on one rank: sharded equals one rank within 1e-12 relative in f64, not bit for bit.
// Estimate mode runs the same moves and passes on shape-only pieces (no payload, no kernel).
#include "ops/ring_attention/ring_attention_op.hpp"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "core/autograd.hpp"
#include "core/compute_threads.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/estimate/real_data.hpp"
#include "core/parallel_for.hpp"
#include "ops/cpu_loops.hpp"
#include "ops/op_costs.hpp"
#include "ops/op_helpers.hpp"
#include "ops/pointwise/vector_math.hpp"
#include "ops/ring_attention/attention_cuda.hpp"
#include "ops/ring_attention/zigzag_plan.hpp"

namespace tessera::ops {

namespace {

constexpr const char* kOp = "attention";

/// The mesh dim that shards dim `dim` of `spec` (-1: none).
int mesh_dim_sharding(const ShardSpec& spec, int dim) {
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (spec.placements[m].is_shard() && spec.placements[m].dim == dim) return static_cast<int>(m);
  return -1;
}

void check_shapes(const Shape& q, const Shape& k, const Shape& v) {
  check_arg(q.size() == 4, kOp, "q of shape {}: expected [B, S, heads, D]", q);
  check_arg(k.size() == 4 && k[0] == q[0] && k[2] == q[2] && k[3] == q[3], kOp,
            "k of shape {} for q of shape {}: expected [{}, Sk, {}, {}]", k, q, q[0], q[2], q[3]);
  check_arg(v.size() == 4 && v[0] == k[0] && v[1] == k[1] && v[2] == k[2], kOp,
            "v of shape {} for k of shape {}: expected [{}, {}, {}, Dv]", v, k, k[0], k[1], k[2]);
}

/// q's layout: no Partial, D unsharded, at most one mesh dim sharding the sequence.
ShardSpec query_layout(const ShardSpec& given) {
  ShardSpec spec = without_partial(given);
  bool seen_sequence = false;
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    Placement& p = spec.placements[m];
    if (!p.is_shard()) continue;
    if (p.dim == 3 || (p.dim == 1 && seen_sequence)) {
      p = Placement::replicate();
      spec.extents[m].clear();
    } else if (p.dim == 1) {
      seen_sequence = true;
    }
  }
  return ShardSpec::make(spec.global_shape, spec.mesh_shape, spec.placements, spec.extents);
}

/// k's (or v's) layout under q's: q's placements on B and heads, the sequence on q's ring dim.
ShardSpec key_layout(const ShardSpec& q, const ShardSpec& given) {
  std::vector<Placement> placements;
  std::vector<std::vector<int64_t>> extents;
  for (size_t m = 0; m < q.placements.size(); ++m) {
    const Placement& p = q.placements[m];
    if (p.is_shard() && p.dim == 1) {
      const bool same_way = given.placements[m].is_shard() && given.placements[m].dim == 1;
      placements.push_back(p);
      extents.push_back(same_way ? given.extents[m]
                                 : default_split(given.global_shape[1], q.mesh_shape[m]));
    } else {
      placements.push_back(p);
      extents.push_back(p.is_shard() ? q.extents[m] : std::vector<int64_t>{});
    }
  }
  return ShardSpec::make(given.global_shape, given.mesh_shape, placements, extents);
}

struct Attrs {
  bool causal = false;
  double scale = 1;
};

Attrs attrs_of(const OpAttrs& attrs, int64_t d) {
  Attrs a;
  a.causal = attrs.has("causal") && attrs.get_int("causal") != 0;
  a.scale = attrs.has("scale") ? attrs.get_double("scale") : 1 / std::sqrt(static_cast<double>(d));
  check_arg(std::isfinite(a.scale), kOp, "attribute 'scale' = {} is not finite", a.scale);
  return a;
}

/// One rank's view of the ring: its communicator (null: the sequence is not sharded), its
/// position, where the caller's layout keeps the query and key rows (`caller_*`, contiguous
/// shards) and where the ring works on them (the zigzag assignment for causal attention, else
/// the caller's own). The local rows of a rank are its segments' rows in order.
struct Ring {
  std::shared_ptr<Comm> comm;
  int size = 1, rank = 0;
  SequenceAssignment caller_queries, caller_keys, queries, keys;
  bool zigzag = false;
  int holder(int step) const { return ((rank - step) % size + size) % size; }
  const std::vector<SequenceSegment>& own_queries() const {
    return queries[static_cast<size_t>(rank)];
  }
  int64_t key_rows(int owner) const { return rows_of(keys[static_cast<size_t>(owner)]); }
};

Ring ring_of(const Attrs& a, const DeviceMesh& mesh, const ShardSpec& q, const Box& q_box,
             const ShardSpec& k) {
  Ring ring;
  const int m = mesh_dim_sharding(q, 1);
  if (m < 0) {
    ring.caller_queries = {{{q_box.lo[1], q_box.hi[1] - q_box.lo[1]}}};
    ring.caller_keys = {{{0, k.global_shape[1]}}};
  } else {
    ring.comm = mesh.sub_comm({m});
    ring.size = ring.comm->size();
    ring.rank = ring.comm->rank();
    ring.caller_queries = contiguous_assignment(q.extents[m]);
    ring.caller_keys = contiguous_assignment(k.extents[m]);
  }
  ring.zigzag = use_zigzag(a.causal, ring.size);
  ring.queries =
      ring.zigzag ? zigzag_assignment(q.global_shape[1], ring.size) : ring.caller_queries;
  ring.keys = ring.zigzag ? zigzag_assignment(k.global_shape[1], ring.size) : ring.caller_keys;
  return ring;
}

/// The box of `count` rows from `first` along dim 1 of a tensor of `shape` ([batch, rows, ...]).
Box rows_box(const Shape& shape, int64_t first, int64_t count) {
  Box box = Box::of_shape(shape);
  box.lo[1] = first;
  box.hi[1] = first + count;
  return box;
}

/// `values` [batch, rows, ...] (this rank's rows of `source`, on any device) as this rank's rows
/// of `target`: one all_to_all_v over the ring on the tensor's device, every rank packing the
/// runs of row_moves for each peer in the order the peer unpacks them.
Tensor move_rows(const Ring& ring, const SequenceAssignment& source,
                 const SequenceAssignment& target, const Tensor& values) {
  if (source == target) return values;
  Shape shape = values.shape();
  shape[1] = rows_of(target[static_cast<size_t>(ring.rank)]);
  // Elements per moved row across the batch (a run packs as [batch, rows, ...]).
  int64_t per_row = 1;
  for (size_t d = 0; d < shape.size(); ++d)
    if (d != 1) per_row *= shape[d];
  const size_t peers = static_cast<size_t>(ring.size);
  std::vector<size_t> send_counts(peers), send_displs(peers), recv_counts(peers),
      recv_displs(peers);
  size_t sent = 0, received = 0;
  for (int peer = 0; peer < ring.size; ++peer) {
    send_displs[static_cast<size_t>(peer)] = sent;
    for (const RowMove& run : row_moves(source, target, ring.rank, peer))
      sent += static_cast<size_t>(run.count * per_row);
    send_counts[static_cast<size_t>(peer)] = sent - send_displs[static_cast<size_t>(peer)];
    recv_displs[static_cast<size_t>(peer)] = received;
    for (const RowMove& run : row_moves(source, target, peer, ring.rank))
      received += static_cast<size_t>(run.count * per_row);
    recv_counts[static_cast<size_t>(peer)] = received - recv_displs[static_cast<size_t>(peer)];
  }
  const size_t element = dtype_size(values.dtype());
  Tensor send = Tensor::empty({static_cast<int64_t>(sent)}, values.dtype(), values.device());
  Tensor incoming =
      Tensor::empty({static_cast<int64_t>(received)}, values.dtype(), values.device());
  Tensor moved = Tensor::empty(shape, values.dtype(), values.device());
  // Estimate mode: the exchange is posted with no payload, nothing is packed.
  const bool shape_only = values.is_shape_only();
  if (!shape_only) {
    char* packed = static_cast<char*>(send.raw_data());
    for (int peer = 0; peer < ring.size; ++peer)
      for (const RowMove& run : row_moves(source, target, ring.rank, peer)) {
        values.pack_box(rows_box(values.shape(), run.from_row, run.count), packed);
        packed += run.count * per_row * element;
      }
  }
  ring.comm->all_to_all_v(send.comm_data(), send_counts, send_displs, incoming.comm_data(),
                          recv_counts, recv_displs, values.dtype());
  if (!shape_only) {
    const char* next = static_cast<const char*>(incoming.raw_data());
    for (int peer = 0; peer < ring.size; ++peer)
      for (const RowMove& run : row_moves(source, target, peer, ring.rank)) {
        moved.unpack_box(rows_box(shape, run.to_row, run.count), next);
        next += run.count * per_row * element;
      }
  }
  return moved;
}

/// Query rows between the caller's layout and the ring's.
Tensor queries_to_ring(const Ring& ring, const Tensor& values) {
  return move_rows(ring, ring.caller_queries, ring.queries, values.contiguous());
}
Tensor queries_from_ring(const Ring& ring, const Tensor& values) {
  return move_rows(ring, ring.queries, ring.caller_queries, values.contiguous());
}
/// Key (or value) rows between the caller's layout and the ring's.
Tensor keys_to_ring(const Ring& ring, const Tensor& values) {
  return move_rows(ring, ring.caller_keys, ring.keys, values.contiguous());
}
Tensor keys_from_ring(const Ring& ring, const Tensor& values) {
  return move_rows(ring, ring.keys, ring.caller_keys, values.contiguous());
}

/// The local sizes every rank on the ring shares: batch, heads, D, Dv, and the query count
/// (this rank's rows in the ring's assignment).
struct Dims {
  int64_t b, sq, h, d, dv;
};

/// Passes the held blocks one step around the ring: `held` to rank + 1 while `next` receives
/// (resized to) the blocks of holder(step + 1) from rank - 1; `per_key[i]` doubles per key of
/// block i. Returns the batch to wait on (null when there is no ring to pass along).
std::unique_ptr<P2PBatch> start_pass(const Ring& ring, int step,
                                     const std::vector<std::vector<double>*>& held,
                                     const std::vector<std::vector<double>*>& next,
                                     const std::vector<int64_t>& per_key) {
  if (!ring.comm || ring.size == 1) return nullptr;
  const int to = (ring.rank + 1) % ring.size, from = (ring.rank - 1 + ring.size) % ring.size;
  const int64_t incoming = ring.key_rows(ring.holder(step + 1));
  std::vector<P2POp> ops;
  for (size_t i = 0; i < held.size(); ++i) {
    next[i]->assign(static_cast<size_t>(incoming * per_key[i]), 0.0);
    if (!held[i]->empty())
      ops.push_back(
          P2POp::send(held[i]->data(), held[i]->size() * sizeof(double), to, static_cast<int>(i)));
    if (!next[i]->empty())
      ops.push_back(P2POp::recv(next[i]->data(), next[i]->size() * sizeof(double), from,
                                static_cast<int>(i)));
  }
  return ring.comm->start_send_recv(ops);
}

std::vector<double> to_doubles(const Tensor& t) {
  const Tensor c = t.to_dtype(DType::f64).contiguous();
  return std::vector<double>(c.data<double>(), c.data<double>() + c.numel());
}

Tensor from_doubles(const std::vector<double>& values, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, DType::f64);
  std::copy(values.begin(), values.end(), t.data<double>());
  return t.to_dtype(dtype);
}

double dot(const double* a, const double* b, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

/// Calls body(bb, hh) for every (batch, head) pair on the compute threads: pairs touch
/// disjoint rows of every block, so they never write the same element.
template <typename Body>
void for_pairs(const Dims& n, Body&& body) {
  parallel_for(n.b * n.h, compute_threads(), [&](int64_t begin, int64_t end, int) {
    for (int64_t pair = begin; pair < end; ++pair) body(pair / n.h, pair % n.h);
  });
}

/// Whether any query of `queries` sees any key of `keys` (blocks with nothing visible, those
/// entirely above a causal diagonal, are skipped).
bool block_has_work(const Attrs& a, const std::vector<SequenceSegment>& queries,
                    const std::vector<SequenceSegment>& keys) {
  for (const SequenceSegment& q : queries)
    for (const SequenceSegment& k : keys)
      if (q.extent > 0 && visible_keys(a.causal, q.offset + q.extent - 1, k) > 0) return true;
  return false;
}

/// Calls body(i, gi) for every local query row i of the ring's assignment with its global index.
template <typename Body>
void for_queries(const Ring& ring, Body&& body) {
  int64_t i = 0;
  for (const SequenceSegment& segment : ring.own_queries())
    for (int64_t gi = segment.offset; gi < segment.offset + segment.extent; ++gi, ++i) body(i, gi);
}

/// Calls body(j) for every local key row j of `keys` that the query at global index gi sees:
/// per key segment a prefix (all of it, part of it on the diagonal, or none).
template <typename Body>
void for_visible_keys(const Attrs& a, int64_t gi, const std::vector<SequenceSegment>& keys,
                      Body&& body) {
  int64_t first = 0;
  for (const SequenceSegment& segment : keys) {
    const int64_t seen = visible_keys(a.causal, gi, segment);
    for (int64_t j = first; j < first + seen; ++j) body(j);
    first += segment.extent;
  }
}

// ---------------------------------------------------------------------------------------------
// f32 block kernels: for f32 inputs the O(queries x keys) work of a (batch, head) pair against
// the held block runs in f32, vectorised over keys and D for the instruction set cpu_isa_level()
// picks (run_with_isa: the bodies below are compiled for AVX-512, AVX2 and the baseline), as
// PyTorch computes f32 attention in f32. The block's k and v are copied once per pair and step
// into f32 tiles (k and, for the backward, v transposed: [D][key], so that a query's scores are
// one multiply-add per D over a contiguous run of keys); per query row the scores of the visible
// keys, their maximum, exp (vm::exp_f32) and sum, and p.v or the gradient products follow as
// loops over keys or D. What crosses blocks stays in f64 as in the f64 path: each row's running
// maximum, sum and output (forward), dq and the travelling dk, dv (backward, summed per pair and
// block in f32 first).

/// The held block of one (batch, head) pair in f32, as much as a pass reads: k transposed
/// [D][stride] always; the forward v [key][Dv]; the backward k [key][D] and v transposed
/// [Dv][stride]. stride >= keys, a multiple of 16.
struct PairTiles {
  int64_t keys = 0, stride = 0;
  std::vector<float> k, kt, v, vt;
};

void fill_tiles(const Dims& n, int64_t sk, int64_t bb, int64_t hh, const std::vector<double>& k,
                const std::vector<double>& v, bool backward, PairTiles& t) {
  t.keys = sk;
  t.stride = (sk + 15) / 16 * 16;
  t.kt.assign(static_cast<size_t>(n.d * t.stride), 0.0f);
  if (backward) {
    t.k.resize(static_cast<size_t>(sk * n.d));
    t.vt.assign(static_cast<size_t>(n.dv * t.stride), 0.0f);
  } else {
    t.v.resize(static_cast<size_t>(sk * n.dv));
  }
  for (int64_t j = 0; j < sk; ++j) {
    const double* kj = k.data() + ((bb * sk + j) * n.h + hh) * n.d;
    const double* vj = v.data() + ((bb * sk + j) * n.h + hh) * n.dv;
    for (int64_t e = 0; e < n.d; ++e) {
      t.kt[e * t.stride + j] = static_cast<float>(kj[e]);
      if (backward) t.k[j * n.d + e] = static_cast<float>(kj[e]);
    }
    for (int64_t e = 0; e < n.dv; ++e) {
      if (backward)
        t.vt[e * t.stride + j] = static_cast<float>(vj[e]);
      else
        t.v[j * n.dv + e] = static_cast<float>(vj[e]);
    }
  }
}

/// The keys of the held block the query at global index gi sees: per key segment a prefix,
/// as (first local key, count) into `first`/`count`; returns how many ranges.
int visible_ranges(const Attrs& a, int64_t gi, const std::vector<SequenceSegment>& keys,
                   int64_t* first, int64_t* count) {
  int ranges = 0;
  int64_t at = 0;
  for (const SequenceSegment& segment : keys) {
    const int64_t seen = visible_keys(a.causal, gi, segment);
    if (seen > 0) {
      first[ranges] = at;
      count[ranges++] = seen;
    }
    at += segment.extent;
  }
  return ranges;
}

/// out[j] = sum_e row[e] * t[e * stride + j] for j in [lo, hi): a row against keys (or values)
/// transposed.
TESSERA_LOOP_BODY inline void row_products(const float* row, int64_t dims, const float* t,
                                           int64_t stride, int64_t lo, int64_t hi, float* out) {
  for (int64_t j = lo; j < hi; ++j) out[j] = 0.0f;
  for (int64_t e = 0; e < dims; ++e) {
    const float x = row[e];
    const float* te = t + e * stride;
    for (int64_t j = lo; j < hi; ++j) out[j] += x * te[j];
  }
}

/// The largest of values[lo, hi) (-inf when empty), in 16 independent lanes.
TESSERA_LOOP_BODY inline float max_of(const float* values, int64_t lo, int64_t hi) {
  float lanes[16];
  for (float& l : lanes) l = -std::numeric_limits<float>::infinity();
  int64_t j = lo;
  for (; j + 16 <= hi; j += 16)
    for (int l = 0; l < 16; ++l) lanes[l] = values[j + l] > lanes[l] ? values[j + l] : lanes[l];
  for (; j < hi; ++j) lanes[0] = values[j] > lanes[0] ? values[j] : lanes[0];
  float best = lanes[0];
  for (int l = 1; l < 16; ++l) best = lanes[l] > best ? lanes[l] : best;
  return best;
}

/// values[j] = exp(values[j] - shift) for j in [lo, hi); returns their sum (16 lanes, then f64).
TESSERA_LOOP_BODY inline double exp_sum(float* values, int64_t lo, int64_t hi, float shift) {
  float lanes[16] = {};
  int64_t j = lo;
  for (; j + 16 <= hi; j += 16)
    for (int l = 0; l < 16; ++l) {
      const float p = vm::exp_f32(values[j + l] - shift);
      values[j + l] = p;
      lanes[l] += p;
    }
  double sum = 0;
  for (; j < hi; ++j) {
    values[j] = vm::exp_f32(values[j] - shift);
    sum += values[j];
  }
  for (const float l : lanes) sum += l;
  return sum;
}

/// acc[e] += sum_j w[j] * rows[j * dims + e] for j in [lo, hi), e < dims.
TESSERA_LOOP_BODY inline void weighted_rows(const float* w, const float* rows, int64_t dims,
                                            int64_t lo, int64_t hi, float* acc) {
  for (int64_t j = lo; j < hi; ++j) {
    const float x = w[j];
    const float* r = rows + j * dims;
    for (int64_t e = 0; e < dims; ++e) acc[e] += x * r[e];
  }
}

/// The f32 forward of pair (bb, hh) against the held block: updates the rows' running maximum
/// `peak`, sum `total` and output `acc` (f64) as ring_forward's f64 loop does.
void forward_pair_f32(const Attrs& a, const Ring& ring, const Dims& n,
                      const std::vector<SequenceSegment>& keys, const std::vector<double>& q,
                      const PairTiles& t, int64_t bb, int64_t hh, std::vector<double>& peak,
                      std::vector<double>& total, std::vector<double>& acc) {
  std::vector<float> qf(static_cast<size_t>(n.d)), scores(static_cast<size_t>(t.stride)),
      out(static_cast<size_t>(n.dv));
  std::vector<int64_t> first(keys.size()), count(keys.size());
  const auto body = [&](int64_t, int64_t) TESSERA_LOOP_BODY {
    int64_t i = 0;
    for (const SequenceSegment& segment : ring.own_queries())
      for (int64_t gi = segment.offset; gi < segment.offset + segment.extent; ++gi, ++i) {
        const int ranges = visible_ranges(a, gi, keys, first.data(), count.data());
        if (ranges == 0) continue;
        const int64_t row = (bb * n.sq + i) * n.h + hh;
        for (int64_t e = 0; e < n.d; ++e) qf[e] = static_cast<float>(a.scale * q[row * n.d + e]);
        float block_max = -std::numeric_limits<float>::infinity();
        for (int r = 0; r < ranges; ++r) {
          row_products(qf.data(), n.d, t.kt.data(), t.stride, first[r], first[r] + count[r],
                       scores.data());
          block_max = std::max(block_max, max_of(scores.data(), first[r], first[r] + count[r]));
        }
        if (block_max == -std::numeric_limits<float>::infinity()) continue;
        const double updated = std::max(peak[row], static_cast<double>(block_max));
        const double carry = std::exp(peak[row] - updated);  // 0 for the first block
        double sum = 0;
        std::fill(out.begin(), out.end(), 0.0f);
        for (int r = 0; r < ranges; ++r) {
          sum += exp_sum(scores.data(), first[r], first[r] + count[r], static_cast<float>(updated));
          weighted_rows(scores.data(), t.v.data(), n.dv, first[r], first[r] + count[r], out.data());
        }
        double* o = acc.data() + row * n.dv;
        for (int64_t e = 0; e < n.dv; ++e) o[e] = o[e] * carry + out[e];
        total[row] = total[row] * carry + sum;
        peak[row] = updated;
      }
  };
  run_with_isa(body, 0, 1);
}

/// The f32 backward of pair (bb, hh) against the held block: adds into dq (f64) and into the
/// travelling dk, dv (f64) as ring_backward's f64 loop does.
void backward_pair_f32(const Attrs& a, const Ring& ring, const Dims& n,
                       const std::vector<SequenceSegment>& keys, const std::vector<double>& q,
                       const std::vector<double>& go, const std::vector<double>& lse,
                       const std::vector<double>& delta, const PairTiles& t, int64_t bb, int64_t hh,
                       std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv) {
  const int64_t sk = t.keys;
  std::vector<float> qs(static_cast<size_t>(n.d)), qu(static_cast<size_t>(n.d)),
      gof(static_cast<size_t>(n.dv)), p(static_cast<size_t>(t.stride)),
      ds(static_cast<size_t>(t.stride)), dqf(static_cast<size_t>(n.d)),
      dkf(static_cast<size_t>(sk * n.d), 0.0f), dvf(static_cast<size_t>(sk * n.dv), 0.0f);
  std::vector<int64_t> first(keys.size()), count(keys.size());
  const float scale = static_cast<float>(a.scale);
  const auto body = [&](int64_t, int64_t) TESSERA_LOOP_BODY {
    int64_t i = 0;
    for (const SequenceSegment& segment : ring.own_queries())
      for (int64_t gi = segment.offset; gi < segment.offset + segment.extent; ++gi, ++i) {
        const int64_t row = (bb * n.sq + i) * n.h + hh;
        if (lse[row] == -std::numeric_limits<double>::infinity()) continue;  // no key seen
        const int ranges = visible_ranges(a, gi, keys, first.data(), count.data());
        if (ranges == 0) continue;
        for (int64_t e = 0; e < n.d; ++e) {
          qu[e] = static_cast<float>(q[row * n.d + e]);
          qs[e] = static_cast<float>(a.scale * q[row * n.d + e]);
        }
        for (int64_t e = 0; e < n.dv; ++e) gof[e] = static_cast<float>(go[row * n.dv + e]);
        const float shift = static_cast<float>(lse[row]), dl = static_cast<float>(delta[row]);
        std::fill(dqf.begin(), dqf.end(), 0.0f);
        for (int r = 0; r < ranges; ++r) {
          const int64_t lo = first[r], hi = first[r] + count[r];
          row_products(qs.data(), n.d, t.kt.data(), t.stride, lo, hi, p.data());
          row_products(gof.data(), n.dv, t.vt.data(), t.stride, lo, hi, ds.data());
          for (int64_t j = lo; j < hi; ++j) {
            p[j] = vm::exp_f32(p[j] - shift);
            ds[j] = p[j] * (ds[j] - dl);
          }
          weighted_rows(ds.data(), t.k.data(), n.d, lo, hi, dqf.data());
          // dk_j += scale ds_j q, dv_j += p_j go for the visible keys.
          for (int64_t j = lo; j < hi; ++j) {
            const float x = scale * ds[j], y = p[j];
            float* dkj = dkf.data() + j * n.d;
            float* dvj = dvf.data() + j * n.dv;
            for (int64_t e = 0; e < n.d; ++e) dkj[e] += x * qu[e];
            for (int64_t e = 0; e < n.dv; ++e) dvj[e] += y * gof[e];
          }
        }
        double* dqi = dq.data() + row * n.d;
        for (int64_t e = 0; e < n.d; ++e) dqi[e] += a.scale * dqf[e];
      }
  };
  run_with_isa(body, 0, 1);
  for (int64_t j = 0; j < sk; ++j) {
    const int64_t key = (bb * sk + j) * n.h + hh;
    for (int64_t e = 0; e < n.d; ++e) dk[key * n.d + e] += dkf[j * n.d + e];
    for (int64_t e = 0; e < n.dv; ++e) dv[key * n.dv + e] += dvf[j * n.dv + e];
  }
}

/// The forward on one rank (ring layout): o [b, sq, h, dv] and lse [b, sq, h] (f64).
/// With `f32`, each pair's block runs in f32 (forward_pair_f32).
std::pair<std::vector<double>, std::vector<double>> ring_forward(const Attrs& a, const Ring& ring,
                                                                 const Dims& n,
                                                                 const std::vector<double>& q,
                                                                 std::vector<double> k,
                                                                 std::vector<double> v, bool f32) {
  constexpr double kNone = -std::numeric_limits<double>::infinity();
  const int64_t rows = n.b * n.sq * n.h;
  std::vector<double> peak(rows, kNone), total(rows, 0.0), acc(rows * n.dv, 0.0);
  std::vector<double> next_k, next_v;
  for (int step = 0; step < ring.size; ++step) {
    const int holder = ring.holder(step);
    const std::vector<SequenceSegment>& keys = ring.keys[static_cast<size_t>(holder)];
    const int64_t sk = ring.key_rows(holder);
    // The block moves on while this rank computes with it.
    std::unique_ptr<P2PBatch> pass;
    if (step + 1 < ring.size)
      pass =
          start_pass(ring, step, {&k, &v}, {&next_k, &next_v}, {n.b * n.h * n.d, n.b * n.h * n.dv});
    const bool work = block_has_work(a, ring.own_queries(), keys);
    if (work && f32) {
      for_pairs(n, [&](int64_t bb, int64_t hh) {
        PairTiles tiles;
        fill_tiles(n, sk, bb, hh, k, v, false, tiles);
        forward_pair_f32(a, ring, n, keys, q, tiles, bb, hh, peak, total, acc);
      });
    } else if (work) {
      for_pairs(n, [&](int64_t bb, int64_t hh) {
        std::vector<double> scores(static_cast<size_t>(sk));
        for_queries(ring, [&](int64_t i, int64_t gi) {
          const int64_t row = (bb * n.sq + i) * n.h + hh;
          const double* qi = q.data() + row * n.d;
          std::fill(scores.begin(), scores.end(), kNone);
          double block_max = kNone;
          for_visible_keys(a, gi, keys, [&](int64_t j) {
            scores[j] = a.scale * dot(qi, k.data() + ((bb * sk + j) * n.h + hh) * n.d, n.d);
            block_max = std::max(block_max, scores[j]);
          });
          if (block_max == kNone) return;
          const double updated = std::max(peak[row], block_max);
          const double carry = std::exp(peak[row] - updated);  // 0 for the first block
          double* out = acc.data() + row * n.dv;
          total[row] *= carry;
          for (int64_t e = 0; e < n.dv; ++e) out[e] *= carry;
          for (int64_t j = 0; j < sk; ++j) {
            if (scores[j] == kNone) continue;
            const double p = std::exp(scores[j] - updated);
            total[row] += p;
            const double* vj = v.data() + ((bb * sk + j) * n.h + hh) * n.dv;
            for (int64_t e = 0; e < n.dv; ++e) out[e] += p * vj[e];
          }
          peak[row] = updated;
        });
      });
    }
    if (pass) {
      pass->wait();
      std::swap(k, next_k);
      std::swap(v, next_v);
    }
  }
  std::vector<double> lse(rows);
  for (int64_t row = 0; row < rows; ++row) {
    // A row that sees no key (no keys at all) is 0, as PyTorch's empty sum, with lse -inf.
    if (total[row] > 0)
      for (int64_t e = 0; e < n.dv; ++e) acc[row * n.dv + e] /= total[row];
    lse[row] = peak[row] + std::log(total[row]);
  }
  return {acc, lse};
}

/// The gradients of q, k, v on one rank (ring layout) from o, lse and their gradients (glse may
/// be empty).
std::vector<std::vector<double>> ring_backward(const Attrs& a, const Ring& ring, const Dims& n,
                                               const std::vector<double>& q, std::vector<double> k,
                                               std::vector<double> v, const std::vector<double>& o,
                                               const std::vector<double>& lse,
                                               const std::vector<double>& go,
                                               const std::vector<double>& glse, bool f32) {
  const int64_t rows = n.b * n.sq * n.h;
  std::vector<double> delta(rows);
  for (int64_t row = 0; row < rows; ++row)
    delta[row] =
        dot(go.data() + row * n.dv, o.data() + row * n.dv, n.dv) - (glse.empty() ? 0.0 : glse[row]);
  std::vector<double> dq(q.size(), 0.0), dk(k.size(), 0.0), dv(v.size(), 0.0);
  std::vector<double> next_k, next_v, next_dk, next_dv;
  for (int step = 0; step < ring.size; ++step) {
    const int holder = ring.holder(step);
    const std::vector<SequenceSegment>& keys = ring.keys[static_cast<size_t>(holder)];
    const int64_t sk = ring.key_rows(holder);
    const bool work = block_has_work(a, ring.own_queries(), keys);
    if (work && f32) {
      for_pairs(n, [&](int64_t bb, int64_t hh) {
        PairTiles tiles;
        fill_tiles(n, sk, bb, hh, k, v, true, tiles);
        backward_pair_f32(a, ring, n, keys, q, go, lse, delta, tiles, bb, hh, dq, dk, dv);
      });
    } else if (work) {
      for_pairs(n, [&](int64_t bb, int64_t hh) {
        for_queries(ring, [&](int64_t i, int64_t gi) {
          const int64_t row = (bb * n.sq + i) * n.h + hh;
          if (lse[row] == -std::numeric_limits<double>::infinity()) return;  // no key seen
          const double* qi = q.data() + row * n.d;
          const double* goi = go.data() + row * n.dv;
          double* dqi = dq.data() + row * n.d;
          for_visible_keys(a, gi, keys, [&](int64_t j) {
            const int64_t key = (bb * sk + j) * n.h + hh;
            const double* kj = k.data() + key * n.d;
            const double* vj = v.data() + key * n.dv;
            const double p = std::exp(a.scale * dot(qi, kj, n.d) - lse[row]);
            const double ds = p * (dot(goi, vj, n.dv) - delta[row]);
            double* dkj = dk.data() + key * n.d;
            double* dvj = dv.data() + key * n.dv;
            for (int64_t e = 0; e < n.d; ++e) {
              dqi[e] += a.scale * ds * kj[e];
              dkj[e] += a.scale * ds * qi[e];
            }
            for (int64_t e = 0; e < n.dv; ++e) dvj[e] += p * goi[e];
          });
        });
      });
    }
    // The block and its gradients move on; after the last pass each rank holds its own.
    if (std::unique_ptr<P2PBatch> pass =
            start_pass(ring, step, {&k, &v, &dk, &dv}, {&next_k, &next_v, &next_dk, &next_dv},
                       {n.b * n.h * n.d, n.b * n.h * n.dv, n.b * n.h * n.d, n.b * n.h * n.dv})) {
      pass->wait();
      std::swap(k, next_k);
      std::swap(v, next_v);
      std::swap(dk, next_dk);
      std::swap(dv, next_dv);
    }
  }
  return {dq, dk, dv};
}

/// The ring's sizes from the caller's local q and v shapes.
Dims dims_of(const Ring& ring, const Shape& q_local, const Shape& v_local) {
  return {q_local[0], rows_of(ring.own_queries()), q_local[2], q_local[3], v_local[3]};
}

/// The position runs of a rank's segments for the device kernels (at most two: a contiguous
/// shard or the zigzag assignment's two chunks).
kernels::PositionRuns runs_of(const std::vector<SequenceSegment>& segments) {
  check_arg(segments.size() <= 2, kOp, "internal: {} sequence segments on one rank",
            segments.size());
  kernels::PositionRuns runs;
  for (const SequenceSegment& segment : segments) {
    runs.offset[runs.count] = segment.offset;
    runs.extent[runs.count] = segment.extent;
    ++runs.count;
  }
  return runs;
}

/// This rank's queries against the block of ring rank `holder`, for the device kernels.
kernels::AttentionBlock block_of(const Attrs& a, const Ring& ring, const Dims& n, int holder) {
  return {.batch = n.b,
          .heads = n.h,
          .d = n.d,
          .dv = n.dv,
          .queries = n.sq,
          .keys = ring.key_rows(holder),
          .query_runs = runs_of(ring.own_queries()),
          .key_runs = runs_of(ring.keys[static_cast<size_t>(holder)]),
          .scale = a.scale,
          .causal = a.causal};
}

/// start_pass for tensors on any device: `held` [b, rows, ...] goes to rank + 1 while `next`
/// receives the blocks of holder(step + 1) (null when there is no ring to pass along).
std::unique_ptr<P2PBatch> start_tensor_pass(const Ring& ring, int step,
                                            const std::vector<const Tensor*>& held,
                                            std::vector<Tensor>& next) {
  if (!ring.comm || ring.size == 1) return nullptr;
  const int to = (ring.rank + 1) % ring.size, from = (ring.rank - 1 + ring.size) % ring.size;
  next.clear();
  std::vector<P2POp> ops;
  for (size_t i = 0; i < held.size(); ++i) {
    Shape shape = held[i]->shape();
    shape[1] = ring.key_rows(ring.holder(step + 1));
    next.push_back(Tensor::empty(shape, held[i]->dtype(), held[i]->device()));
    if (held[i]->numel() > 0)
      ops.push_back(P2POp::send(held[i]->comm_data(), held[i]->nbytes(), to, static_cast<int>(i)));
    if (next.back().numel() > 0)
      ops.push_back(
          P2POp::recv(next.back().comm_data(), next.back().nbytes(), from, static_cast<int>(i)));
  }
  return ring.comm->start_send_recv(ops);
}

/// ring_forward on cuda tensors (ring layout): the block kernels, the blocks passed on the
/// device while the kernel runs.
std::pair<Tensor, Tensor> ring_forward_cuda(const Attrs& a, const Ring& ring, const Dims& n,
                                            const Tensor& q, Tensor k, Tensor v) {
  const Stream stream = compute_stream_for(q.device());
  AttentionState state =
      attention_state_cuda(n.b * n.sq * n.h, n.dv, q.dtype(), q.device(), stream);
  std::vector<Tensor> next;
  for (int step = 0; step < ring.size; ++step) {
    const int holder = ring.holder(step);
    std::unique_ptr<P2PBatch> pass;
    if (step + 1 < ring.size) pass = start_tensor_pass(ring, step, {&k, &v}, next);
    if (block_has_work(a, ring.own_queries(), ring.keys[static_cast<size_t>(holder)]))
      attention_forward_block_cuda(block_of(a, ring, n, holder), q, k, v, state, stream);
    if (pass) {
      pass->wait();
      k = next[0];
      v = next[1];
    }
  }
  return attention_finish_cuda(state, {n.b, n.sq, n.h, n.dv}, {n.b, n.sq, n.h}, q.dtype(), stream);
}

/// ring_backward on cuda tensors (ring layout): dK and dV travel with their block in the
/// accumulation dtype and arrive back at their owner after P passes.
std::vector<Tensor> ring_backward_cuda(const Attrs& a, const Ring& ring, const Dims& n,
                                       const Tensor& q, Tensor k, Tensor v, const Tensor& o,
                                       const Tensor& lse, const Tensor& go, const Tensor* glse) {
  const Stream stream = compute_stream_for(q.device());
  const auto [delta, lse_acc] = attention_backward_prepare_cuda(o, go, lse, glse, stream);
  const DType acc = attention_accumulation_dtype(q.dtype());
  Tensor dq = Tensor::zeros(q.shape(), acc, q.device());
  Tensor dk = Tensor::zeros(k.shape(), acc, k.device());
  Tensor dv = Tensor::zeros(v.shape(), acc, v.device());
  std::vector<Tensor> next;
  for (int step = 0; step < ring.size; ++step) {
    const int holder = ring.holder(step);
    if (block_has_work(a, ring.own_queries(), ring.keys[static_cast<size_t>(holder)]))
      attention_backward_block_cuda(block_of(a, ring, n, holder), q, k, v, go, lse_acc, delta, dq,
                                    dk, dv, stream);
    if (std::unique_ptr<P2PBatch> pass = start_tensor_pass(ring, step, {&k, &v, &dk, &dv}, next)) {
      pass->wait();
      k = next[0];
      v = next[1];
      dk = next[2];
      dv = next[3];
    }
  }
  return {dq.to_dtype(q.dtype()), dk.to_dtype(q.dtype()), dv.to_dtype(q.dtype())};
}

/// Estimate mode: `steps` passes of the shape-only blocks `held` around the ring (each waited on
/// at once: there is nothing to compute in between), no payload moved.
void estimated_passes(const Ring& ring, int steps, std::vector<Tensor> held) {
  std::vector<Tensor> next;
  for (int step = 0; step < steps; ++step) {
    std::vector<const Tensor*> blocks;
    for (const Tensor& block : held) blocks.push_back(&block);
    if (std::unique_ptr<P2PBatch> pass = start_tensor_pass(ring, step, blocks, next)) {
      pass->wait();
      held = next;
    }
  }
}

/// The dtype a ring pass sends the blocks of `dtype` in: the cpu ring passes f64 vectors, the
/// cuda ring the tensors themselves.
DType block_dtype(const Device& device, DType dtype) {
  return device.is_cuda() ? dtype : DType::f64;
}

/// o and lse of the caller's local q, k, v, in the caller's layout: the rows move to the ring's
/// assignment, the ring runs (cuda kernels for cuda tensors, else f64 on the cpu), o and lse
/// move back.
std::pair<Tensor, Tensor> attention_forward(const Attrs& a, const Ring& ring, const Dims& n,
                                            const Tensor& q, const Tensor& k, const Tensor& v) {
  const Tensor qr = queries_to_ring(ring, q), kr = keys_to_ring(ring, k),
               vr = keys_to_ring(ring, v.to_dtype(q.dtype()));
  Tensor o, lse;
  if (estimate::active()) {  // the forward's P - 1 passes of the k and v blocks, no kernel
    const DType block = block_dtype(q.device(), q.dtype());
    estimated_passes(ring, ring.size - 1, {kr.to_dtype(block), vr.to_dtype(block)});
    o = Tensor::empty({n.b, n.sq, n.h, n.dv}, q.dtype(), q.device());
    lse = Tensor::empty({n.b, n.sq, n.h}, q.dtype(), q.device());
  } else if (q.device().is_cuda()) {
    std::tie(o, lse) = ring_forward_cuda(a, ring, n, qr, kr.to_dtype(q.dtype()), vr);
  } else {
    auto [o_values, lse_values] = ring_forward(a, ring, n, to_doubles(qr), to_doubles(kr),
                                               to_doubles(vr), q.dtype() == DType::f32);
    o = from_doubles(o_values, {n.b, n.sq, n.h, n.dv}, q.dtype());
    lse = from_doubles(lse_values, {n.b, n.sq, n.h}, q.dtype());
  }
  return {queries_from_ring(ring, o), queries_from_ring(ring, lse)};
}

/// dq, dk, dv in the caller's layout from the caller's local tensors (glse: null when lse has no
/// gradient; decided alike on every rank, since a rank with no queries holds no values either).
std::vector<Tensor> attention_backward(const Attrs& a, const Ring& ring, const Dims& n,
                                       const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& o, const Tensor& lse, const Tensor& go,
                                       const Tensor* glse) {
  const DType dtype = q.dtype();
  const Tensor qr = queries_to_ring(ring, q), kr = keys_to_ring(ring, k.to_dtype(dtype)),
               vr = keys_to_ring(ring, v.to_dtype(dtype)), or_ = queries_to_ring(ring, o),
               lr = queries_to_ring(ring, lse), gr = queries_to_ring(ring, go.to_dtype(dtype));
  const std::optional<Tensor> glr =
      glse ? std::optional<Tensor>(queries_to_ring(ring, glse->to_dtype(dtype))) : std::nullopt;
  std::vector<Tensor> d;
  if (estimate::active()) {  // the backward's P passes of k, v and their gradients, no kernel
    const DType block = block_dtype(q.device(), dtype);
    const DType gradient = block_dtype(q.device(), attention_accumulation_dtype(dtype));
    estimated_passes(
        ring, ring.size,
        {kr.to_dtype(block), vr.to_dtype(block), Tensor::empty(kr.shape(), gradient, kr.device()),
         Tensor::empty(vr.shape(), gradient, vr.device())});
    d = {Tensor::empty(qr.shape(), dtype, qr.device()),
         Tensor::empty(kr.shape(), dtype, kr.device()),
         Tensor::empty(vr.shape(), dtype, vr.device())};
  } else if (q.device().is_cuda()) {
    d = ring_backward_cuda(a, ring, n, qr, kr, vr, or_, lr, gr, glr ? &*glr : nullptr);
  } else {
    const auto values = ring_backward(
        a, ring, n, to_doubles(qr), to_doubles(kr), to_doubles(vr), to_doubles(or_), to_doubles(lr),
        to_doubles(gr), glr ? to_doubles(*glr) : std::vector<double>{}, dtype == DType::f32);
    d = {from_doubles(values[0], qr.shape(), dtype), from_doubles(values[1], kr.shape(), dtype),
         from_doubles(values[2], vr.shape(), dtype)};
  }
  return {queries_from_ring(ring, d[0]), keys_from_ring(ring, d[1]).to_dtype(k.dtype()),
          keys_from_ring(ring, d[2]).to_dtype(v.dtype())};
}

/// The forward of the op on one rank's pieces (any device).
std::vector<Tensor> forward_kernel(const KernelContext& context,
                                   const std::vector<Tensor>& inputs) {
  const Attrs a = attrs_of(context.attrs, context.input_specs[0].global_shape[3]);
  const Ring ring = ring_of(a, context.mesh, context.input_specs[0], context.input_boxes[0],
                            context.input_specs[1]);
  const Dims n = dims_of(ring, inputs[0].shape(), inputs[2].shape());
  auto [o, lse] = attention_forward(a, ring, n, inputs[0], inputs[1], inputs[2]);
  return {o, lse};
}

}  // namespace

DType attention_accumulation_dtype(DType dtype) {
  return dtype == DType::f64 ? DType::f64 : DType::f32;
}

void register_ring_attention_ops() {
  RuleFn rule = [](const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
    check_arg(inputs.size() == 3, kOp, "expects inputs q, k, v, got {}", inputs.size());
    check_shapes(inputs[0].global_shape, inputs[1].global_shape, inputs[2].global_shape);
    attrs_of(attrs, inputs[0].global_shape[3]);
    const ShardSpec q = query_layout(inputs[0]);
    Shape o_shape = q.global_shape;
    o_shape[3] = inputs[2].global_shape[3];
    const Shape lse_shape{o_shape[0], o_shape[1], o_shape[2]};
    // v follows k exactly (its blocks travel with k's).
    const ShardSpec k = key_layout(q, inputs[1]);
    const ShardSpec v =
        ShardSpec::make(inputs[2].global_shape, k.mesh_shape, k.placements, k.extents);
    return OpRule{{q, k, v},
                  {std::nullopt, std::nullopt, std::nullopt},
                  {ShardSpec::make(o_shape, q.mesh_shape, q.placements, q.extents),
                   ShardSpec::make(lse_shape, q.mesh_shape, q.placements, q.extents)}};
  };
  KernelFn cpu = [](const KernelContext& context, const std::vector<Tensor>& inputs) {
    for (const Tensor& input : inputs) require_floating_cpu(input, kOp);
    return forward_kernel(context, inputs);
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const ShardTensor& q = record.inputs[0];
    const ShardTensor& k = record.inputs[1];
    const ShardTensor& v = record.inputs[2];
    const ShardTensor& o = record.outputs[0];
    const ShardTensor& lse = record.outputs[1];
    auto local_grad = [&](size_t index, const ShardTensor& like) -> std::optional<Tensor> {
      if (!grads[index]) return std::nullopt;
      const ShardTensor g =
          grads[index]->spec() == like.spec()
              ? *grads[index]
              : grads[index]->redistribute(like.placements(), like.spec().extents);
      return g.to_local();
    };
    const Attrs a = attrs_of(record.attrs, q.global_shape()[3]);
    const Ring ring = ring_of(a, q.mesh(), q.spec(), q.local_box(), k.spec());
    const Dims n = dims_of(ring, q.to_local().shape(), v.to_local().shape());
    const std::optional<Tensor> go = local_grad(0, o), glse = local_grad(1, lse);
    const Tensor& o_local = o.to_local();
    const auto d = attention_backward(
        a, ring, n, q.to_local(), k.to_local(), v.to_local(), o_local, lse.to_local(),
        go ? *go : Tensor::zeros(o_local.shape(), o_local.dtype(), o_local.device()),
        glse ? &*glse : nullptr);
    return {ShardTensor(d[0], q.mesh(), q.spec()), ShardTensor(d[1], k.mesh(), k.spec()),
            ShardTensor(d[2], v.mesh(), v.spec())};
  };
  register_op(OpDef{.name = kOp,
                    .summary = "softmax(scale q k^T) v of q, k, v [B, S, heads, D] with the "
                               "sequence sharded (ring attention; o and lse)",
                    .inputs = {{.name = "q"}, {.name = "k"}, {.name = "v"}},
                    .outputs = {"o", "lse"},
                    .attrs = {{.name = "causal",
                               .type = AttrType::boolean,
                               .default_value = int64_t{0},
                               .doc = "query i sees keys j <= i"},
                              {.name = "scale",
                               .type = AttrType::float_scalar,
                               .doc = "the scores' factor (unset: 1/sqrt(D))"}},
                    .rule = std::move(rule),
                    .cpu = std::move(cpu),
                    .cuda = forward_kernel,
                    .backward = std::move(backward),
                    .cost = attention_cost});
  // The kernel moves rows to the zigzag assignment and passes the key and value blocks around
  // the ring of ranks sharding the sequence: in estimate mode it posts those messages.
  estimate::run_kernel_in_estimate_mode(kOp);
}

std::vector<ShardTensor> attention(const ShardTensor& q, const ShardTensor& k, const ShardTensor& v,
                                   const AttentionOptions& options) {
  OpAttrs attrs;
  attrs.set("causal", int64_t{options.causal ? 1 : 0});
  if (options.scale) attrs.set("scale", *options.scale);
  return apply_op(kOp, {q, k, v}, attrs);
}

}  // namespace tessera::ops
