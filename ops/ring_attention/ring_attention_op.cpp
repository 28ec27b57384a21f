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
#include "ops/ring_attention/ring_attention_op.hpp"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "core/autograd.hpp"
#include "core/compute_threads.hpp"
#include "core/estimate/estimate_mode.hpp"
#include "core/estimate/real_data.hpp"
#include "core/parallel_for.hpp"
#include "ops/op_costs.hpp"
#include "ops/op_helpers.hpp"

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
/// position, the K/V blocks' global offsets and extents along the sequence, its queries' offset.
struct Ring {
  std::shared_ptr<Comm> comm;
  int size = 1, rank = 0;
  std::vector<int64_t> key_offsets, key_extents;
  int64_t query_offset = 0;
  int holder(int step) const { return ((rank - step) % size + size) % size; }
};

Ring ring_of(const DeviceMesh& mesh, const ShardSpec& q, const Box& q_box, const ShardSpec& k) {
  Ring ring;
  ring.query_offset = q_box.lo[1];
  const int m = mesh_dim_sharding(q, 1);
  if (m < 0) {
    ring.key_extents = {k.global_shape[1]};
    ring.key_offsets = {0};
    return ring;
  }
  ring.comm = mesh.sub_comm({m});
  ring.size = ring.comm->size();
  ring.rank = ring.comm->rank();
  ring.key_extents = k.extents[m];
  ring.key_offsets = offsets_of(ring.key_extents);
  return ring;
}

/// The local sizes every rank on the ring shares: batch, heads, D, Dv, and the query count.
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
  const int64_t incoming = ring.key_extents[ring.holder(step + 1)];
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

/// Estimate mode (core/estimate/real_data.hpp): the messages of `steps` passes around the ring
/// (start_pass's, block i of per_key[i] doubles per key), posted with no payload and waited on
/// at once, since there is nothing to compute in between.
void estimated_passes(const Ring& ring, int steps, const std::vector<int64_t>& per_key) {
  if (!ring.comm || ring.size == 1) return;
  const int to = (ring.rank + 1) % ring.size, from = (ring.rank - 1 + ring.size) % ring.size;
  for (int step = 0; step < steps; ++step) {
    const int64_t held = ring.key_extents[ring.holder(step)];
    const int64_t incoming = ring.key_extents[ring.holder(step + 1)];
    std::vector<P2POp> ops;
    for (size_t i = 0; i < per_key.size(); ++i) {
      const size_t sent = static_cast<size_t>(held * per_key[i]) * sizeof(double);
      const size_t received = static_cast<size_t>(incoming * per_key[i]) * sizeof(double);
      if (sent > 0) ops.push_back(P2POp::send(nullptr, sent, to, static_cast<int>(i)));
      if (received > 0) ops.push_back(P2POp::recv(nullptr, received, from, static_cast<int>(i)));
    }
    ring.comm->start_send_recv(ops)->wait();
  }
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

/// Whether query global index `i` may see key global index `j`.
bool visible(const Attrs& a, int64_t i, int64_t j) {
  return !a.causal || j <= i;
}

/// Whether a causal block of keys [k0, k0 + sk) is entirely above the diagonal of the queries
/// [q0, q0 + sq) (nothing visible).
bool hidden_block(const Attrs& a, int64_t q0, int64_t sq, int64_t k0, int64_t sk) {
  return sk == 0 || sq == 0 || (a.causal && k0 > q0 + sq - 1);
}

/// The forward on one rank: o [b, sq, h, dv] and lse [b, sq, h] (f64).
std::pair<std::vector<double>, std::vector<double>> ring_forward(const Attrs& a, const Ring& ring,
                                                                 const Dims& n,
                                                                 const std::vector<double>& q,
                                                                 std::vector<double> k,
                                                                 std::vector<double> v) {
  const int64_t rows = n.b * n.sq * n.h;
  std::vector<double> peak(rows, -std::numeric_limits<double>::infinity()), total(rows, 0.0),
      acc(rows * n.dv, 0.0);
  std::vector<double> next_k, next_v;
  for (int step = 0; step < ring.size; ++step) {
    const int holder = ring.holder(step);
    const int64_t sk = ring.key_extents[holder], k0 = ring.key_offsets[holder];
    // The block moves on while this rank computes with it.
    std::unique_ptr<P2PBatch> pass;
    if (step + 1 < ring.size)
      pass =
          start_pass(ring, step, {&k, &v}, {&next_k, &next_v}, {n.b * n.h * n.d, n.b * n.h * n.dv});
    if (!hidden_block(a, ring.query_offset, n.sq, k0, sk)) {
      for_pairs(n, [&](int64_t bb, int64_t hh) {
        std::vector<double> scores(static_cast<size_t>(sk));
        for (int64_t i = 0; i < n.sq; ++i) {
          const int64_t row = (bb * n.sq + i) * n.h + hh;
          const double* qi = q.data() + row * n.d;
          const int64_t gi = ring.query_offset + i;
          double block_max = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < sk; ++j) {
            if (!visible(a, gi, k0 + j)) {
              scores[j] = -std::numeric_limits<double>::infinity();
              continue;
            }
            scores[j] = a.scale * dot(qi, k.data() + ((bb * sk + j) * n.h + hh) * n.d, n.d);
            block_max = std::max(block_max, scores[j]);
          }
          if (block_max == -std::numeric_limits<double>::infinity()) continue;
          const double updated = std::max(peak[row], block_max);
          const double carry = std::exp(peak[row] - updated);  // 0 for the first block
          double* out = acc.data() + row * n.dv;
          total[row] *= carry;
          for (int64_t e = 0; e < n.dv; ++e) out[e] *= carry;
          for (int64_t j = 0; j < sk; ++j) {
            if (scores[j] == -std::numeric_limits<double>::infinity()) continue;
            const double p = std::exp(scores[j] - updated);
            total[row] += p;
            const double* vj = v.data() + ((bb * sk + j) * n.h + hh) * n.dv;
            for (int64_t e = 0; e < n.dv; ++e) out[e] += p * vj[e];
          }
          peak[row] = updated;
        }
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

/// The gradients of q, k, v on one rank from o, lse and their gradients (glse may be empty).
std::vector<std::vector<double>> ring_backward(const Attrs& a, const Ring& ring, const Dims& n,
                                               const std::vector<double>& q, std::vector<double> k,
                                               std::vector<double> v, const std::vector<double>& o,
                                               const std::vector<double>& lse,
                                               const std::vector<double>& go,
                                               const std::vector<double>& glse) {
  const int64_t rows = n.b * n.sq * n.h;
  std::vector<double> delta(rows);
  for (int64_t row = 0; row < rows; ++row)
    delta[row] =
        dot(go.data() + row * n.dv, o.data() + row * n.dv, n.dv) - (glse.empty() ? 0.0 : glse[row]);
  std::vector<double> dq(q.size(), 0.0), dk(k.size(), 0.0), dv(v.size(), 0.0);
  std::vector<double> next_k, next_v, next_dk, next_dv;
  for (int step = 0; step < ring.size; ++step) {
    const int holder = ring.holder(step);
    const int64_t sk = ring.key_extents[holder], k0 = ring.key_offsets[holder];
    if (!hidden_block(a, ring.query_offset, n.sq, k0, sk)) {
      for_pairs(n, [&](int64_t bb, int64_t hh) {
        for (int64_t i = 0; i < n.sq; ++i) {
          const int64_t row = (bb * n.sq + i) * n.h + hh;
          if (lse[row] == -std::numeric_limits<double>::infinity()) continue;  // no key seen
          const double* qi = q.data() + row * n.d;
          const double* goi = go.data() + row * n.dv;
          double* dqi = dq.data() + row * n.d;
          for (int64_t j = 0; j < sk; ++j) {
            if (!visible(a, ring.query_offset + i, k0 + j)) continue;
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
          }
        }
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

Dims dims_of(const Shape& q_local, const Shape& v_local) {
  return {q_local[0], q_local[1], q_local[2], q_local[3], v_local[3]};
}

}  // namespace

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
    const Attrs a = attrs_of(context.attrs, context.input_specs[0].global_shape[3]);
    const Ring ring = ring_of(context.mesh, context.input_specs[0], context.input_boxes[0],
                              context.input_specs[1]);
    const Dims n = dims_of(inputs[0].shape(), inputs[2].shape());
    const DType dtype = inputs[0].dtype();
    if (estimate::active()) {  // the blocks' passes of the forward (all but the last step)
      estimated_passes(ring, ring.size - 1, {n.b * n.h * n.d, n.b * n.h * n.dv});
      return std::vector<Tensor>{Tensor::empty({n.b, n.sq, n.h, n.dv}, dtype),
                                 Tensor::empty({n.b, n.sq, n.h}, dtype)};
    }
    auto [o, lse] = ring_forward(a, ring, n, to_doubles(inputs[0]), to_doubles(inputs[1]),
                                 to_doubles(inputs[2]));
    return std::vector<Tensor>{from_doubles(o, {n.b, n.sq, n.h, n.dv}, dtype),
                               from_doubles(lse, {n.b, n.sq, n.h}, dtype)};
  };
  BackwardFn backward = [](const OpRecord& record,
                           const std::vector<std::optional<ShardTensor>>& grads)
      -> std::vector<std::optional<ShardTensor>> {
    const ShardTensor& q = record.inputs[0];
    const ShardTensor& k = record.inputs[1];
    const ShardTensor& v = record.inputs[2];
    const ShardTensor& o = record.outputs[0];
    const ShardTensor& lse = record.outputs[1];
    auto local_grad = [&](size_t index, const ShardTensor& like) -> std::vector<double> {
      if (!grads[index]) return {};
      const ShardTensor g =
          grads[index]->spec() == like.spec()
              ? *grads[index]
              : grads[index]->redistribute(like.placements(), like.spec().extents);
      if (g.to_local().is_shape_only()) return {};  // estimate mode: the layout moved, no values
      return to_doubles(g.to_local());
    };
    if (estimate::active()) {  // the same redistributes and passes, shape-only gradients
      local_grad(0, o);
      const Ring ring = ring_of(q.mesh(), q.spec(), q.local_box(), k.spec());
      local_grad(1, lse);
      const Dims n = dims_of(q.to_local().shape(), v.to_local().shape());
      estimated_passes(ring, ring.size,
                       {n.b * n.h * n.d, n.b * n.h * n.dv, n.b * n.h * n.d, n.b * n.h * n.dv});
      return {ShardTensor(Tensor::empty(q.to_local().shape(), q.dtype()), q.mesh(), q.spec()),
              ShardTensor(Tensor::empty(k.to_local().shape(), k.dtype()), k.mesh(), k.spec()),
              ShardTensor(Tensor::empty(v.to_local().shape(), v.dtype()), v.mesh(), v.spec())};
    }
    std::vector<double> go = local_grad(0, o);
    const Dims n = dims_of(q.to_local().shape(), v.to_local().shape());
    if (go.empty()) go.assign(static_cast<size_t>(n.b * n.sq * n.h * n.dv), 0.0);
    const Attrs a = attrs_of(record.attrs, q.global_shape()[3]);
    const Ring ring = ring_of(q.mesh(), q.spec(), q.local_box(), k.spec());
    const auto d = ring_backward(a, ring, n, to_doubles(q.to_local()), to_doubles(k.to_local()),
                                 to_doubles(v.to_local()), to_doubles(o.to_local()),
                                 to_doubles(lse.to_local()), go, local_grad(1, lse));
    return {ShardTensor(from_doubles(d[0], q.to_local().shape(), q.dtype()), q.mesh(), q.spec()),
            ShardTensor(from_doubles(d[1], k.to_local().shape(), k.dtype()), k.mesh(), k.spec()),
            ShardTensor(from_doubles(d[2], v.to_local().shape(), v.dtype()), v.mesh(), v.spec())};
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
                    .backward = std::move(backward),
                    .cost = attention_cost});
  // The kernel passes the key and value blocks around the ring of ranks sharding the sequence.
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
