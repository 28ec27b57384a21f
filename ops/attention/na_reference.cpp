// Plain C++ neighborhood attention: straightforward loops over (batch, query, head) and the
// query's window, computed in double whatever the input dtype (inputs are converted once),
// with the softmax taken after subtracting the row maximum. Every call is run as a 3-d call:
// 1-d and 2-d problems get leading spatial axes of extent 1 (kernel 1, dilation 1), which
// leaves the flattened layout unchanged.
#include "ops/attention/na_reference.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "core/errors.hpp"

namespace tessera::ops {

NaWindow na_window(int64_t index, int64_t length, int64_t kernel, int64_t dilation, bool causal) {
  // Queries and keys of one dilation group g = i mod d form a sub-grid of Lg points; the window
  // is taken on that sub-grid and mapped back (j = jj * d + g).
  const int64_t group = index % dilation, sub_index = index / dilation;
  NaWindow window;
  window.step = dilation;
  if (causal) {
    const int64_t start = std::max<int64_t>(sub_index - kernel + 1, 0);
    window.first = start * dilation + group;
    window.count = sub_index - start + 1;
    return window;
  }
  const int64_t group_length = (length - group + dilation - 1) / dilation;
  const int64_t left = kernel / 2;
  const int64_t start = std::clamp<int64_t>(sub_index - left, 0, group_length - kernel);
  window.first = start * dilation + group;
  window.count = kernel;
  return window;
}

Shape na_rpb_shape(int64_t heads, const NaGeometry& geometry) {
  Shape shape{heads};
  for (int64_t kernel : geometry.kernel) shape.push_back(2 * kernel - 1);
  return shape;
}

namespace {

constexpr int kAxes = 3;
using Axes = std::array<int64_t, kAxes>;

/// One validated call, seen as 3-d, with every window of the local queries precomputed.
struct Problem {
  int spatial = 1;
  int64_t batch = 0, heads = 0, dim = 0;
  Axes queries{1, 1, 1}, query_offset{0, 0, 0};  // local query piece
  Axes tile{1, 1, 1}, tile_offset{0, 0, 0};      // the k/v tile
  Axes kernel{1, 1, 1}, dilation{1, 1, 1};
  Axes rpb{1, 1, 1};                                 // extents of the bias table per axis (2k - 1)
  std::array<std::vector<NaWindow>, kAxes> windows;  // per axis, per local query
  double scale = 1.0;

  int64_t query_count() const { return queries[0] * queries[1] * queries[2]; }
  int64_t tile_count() const { return tile[0] * tile[1] * tile[2]; }
};

/// Validates the call and fills a Problem (axis a of the user's problem is axis
/// kAxes - spatial + a here).
Problem make_problem(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                     const NaGeometry& geometry, const NaPieces& pieces) {
  Problem p;
  const int spatial = q.ndim() - 3;
  check_arg(spatial >= 1 && spatial <= 3, "na",
            "expected q of shape [B, X(, Y(, Z)), heads, D] (3 to 5 dims), got shape {}",
            q.shape());
  p.spatial = spatial;
  check_arg(geometry.extent.size() == static_cast<size_t>(spatial) &&
                geometry.kernel.size() == geometry.extent.size() &&
                geometry.dilation.size() == geometry.extent.size() &&
                geometry.causal.size() == geometry.extent.size() &&
                pieces.query_offset.size() == geometry.extent.size() &&
                pieces.key_offset.size() == geometry.extent.size(),
            "na",
            "na{}d needs {} values per axis: extent {}, kernel {}, dilation {}, causal {}, "
            "query offset {}, key offset {}",
            spatial, spatial, geometry.extent, geometry.kernel, geometry.dilation, geometry.causal,
            pieces.query_offset, pieces.key_offset);
  for (const Tensor* t : {&k, &v})
    check_arg(t->ndim() == q.ndim() && t->shape(0) == q.shape(0) &&
                  t->shape(q.ndim() - 2) == q.shape(q.ndim() - 2) &&
                  t->shape(q.ndim() - 1) == q.shape(q.ndim() - 1),
              "na", "key/value tile of shape {} for q of shape {} (batch, heads and D must match)",
              t->shape(), q.shape());
  check_arg(k.shape() == v.shape(), "na", "k of shape {} and v of shape {} differ", k.shape(),
            v.shape());
  check_arg(q.dtype() == k.dtype() && q.dtype() == v.dtype() && is_floating(q.dtype()), "na",
            "q, k, v must share one floating dtype, got {}, {}, {}", dtype_name(q.dtype()),
            dtype_name(k.dtype()), dtype_name(v.dtype()));
  for (const Tensor* t : {&q, &k, &v})
    check_arg(t->device().is_cpu(), "na", "cpu kernel got a {} tensor", t->device().str());
  p.batch = q.shape(0);
  p.heads = q.shape(q.ndim() - 2);
  p.dim = q.shape(q.ndim() - 1);
  p.scale = geometry.scale;
  const int shift = kAxes - spatial;
  for (int a = 0; a < spatial; ++a) {
    const int64_t length = geometry.extent[a], kernel = geometry.kernel[a];
    const int64_t dilation = geometry.dilation[a];
    check_arg(kernel >= 1 && dilation >= 1 && kernel * dilation <= length, "na",
              "kernel size {} with dilation {} does not fit the extent {} of spatial axis {} "
              "(needs kernel * dilation <= extent)",
              kernel, dilation, length, a);
    const int64_t queries = q.shape(1 + a), offset = pieces.query_offset[a];
    check_arg(offset >= 0 && offset + queries <= length, "na",
              "local queries [{}, {}) of spatial axis {} lie outside the global extent {}", offset,
              offset + queries, a, length);
    p.queries[shift + a] = queries;
    p.query_offset[shift + a] = offset;
    p.tile[shift + a] = k.shape(1 + a);
    p.tile_offset[shift + a] = pieces.key_offset[a];
    p.kernel[shift + a] = kernel;
    p.dilation[shift + a] = dilation;
    p.rpb[shift + a] = 2 * kernel - 1;
  }
  if (rpb) {
    bool allowed = true;
    for (int a = 0; a < spatial; ++a)
      allowed = allowed && !geometry.causal[a] && geometry.kernel[a] % 2 == 1;
    check_arg(allowed, "na",
              "relative positional bias needs a non-causal odd kernel on every axis, got kernel "
              "{} causal {}",
              geometry.kernel, geometry.causal);
    check_arg(rpb->shape() == na_rpb_shape(p.heads, geometry), "na", "rpb of shape {}, expected {}",
              rpb->shape(), na_rpb_shape(p.heads, geometry));
    check_arg(is_floating(rpb->dtype()) && rpb->device().is_cpu(), "na",
              "rpb must be a floating cpu tensor, got {}", rpb->str());
  }
  // Windows of the local queries, and the check that the tile holds every key they read.
  for (int a = 0; a < kAxes; ++a) {
    const int user_axis = a - shift;
    for (int64_t i = 0; i < p.queries[a]; ++i) {
      if (user_axis < 0) {
        p.windows[a].push_back(NaWindow{0, 1, 1});
        continue;
      }
      p.windows[a].push_back(na_window(p.query_offset[a] + i, geometry.extent[user_axis],
                                       geometry.kernel[user_axis], geometry.dilation[user_axis],
                                       geometry.causal[user_axis] != 0));
    }
  }
  if (p.query_count() > 0) {
    for (int a = shift; a < kAxes; ++a) {
      for (int64_t i = 0; i < p.queries[a]; ++i) {
        const NaWindow& w = p.windows[a][i];
        check_arg(w.first >= p.tile_offset[a] && w.end() <= p.tile_offset[a] + p.tile[a], "na",
                  "query {} of spatial axis {} reads keys [{}, {}), outside the key/value tile "
                  "[{}, {})",
                  p.query_offset[a] + i, a - shift, w.first, w.end(), p.tile_offset[a],
                  p.tile_offset[a] + p.tile[a]);
      }
    }
  }
  return p;
}

/// A contiguous f64 copy (or view) of a tensor.
Tensor as_f64(const Tensor& t) {
  return t.to_dtype(DType::f64).contiguous();
}

/// The dtype of lse for inputs of `dtype`.
DType lse_dtype(DType dtype) {
  return dtype == DType::f16 || dtype == DType::bf16 ? DType::f32 : dtype;
}

/// One neighbour of a query: its flat position in the tile and its flat index in the bias
/// table of one head.
struct Neighbour {
  int64_t tile_position;
  int64_t bias_index;
};

/// The neighbours of local query (x, y, z), in window order.
void neighbours_of(const Problem& p, const Axes& query, std::vector<Neighbour>& out) {
  out.clear();
  const NaWindow& w0 = p.windows[0][query[0]];
  const NaWindow& w1 = p.windows[1][query[1]];
  const NaWindow& w2 = p.windows[2][query[2]];
  Axes global{};
  for (int a = 0; a < kAxes; ++a) global[a] = p.query_offset[a] + query[a];
  for (int64_t t0 = 0; t0 < w0.count; ++t0) {
    const int64_t j0 = w0.first + t0 * w0.step;
    const int64_t b0 = p.kernel[0] - 1 + (j0 - global[0]) / p.dilation[0];
    for (int64_t t1 = 0; t1 < w1.count; ++t1) {
      const int64_t j1 = w1.first + t1 * w1.step;
      const int64_t b1 = p.kernel[1] - 1 + (j1 - global[1]) / p.dilation[1];
      for (int64_t t2 = 0; t2 < w2.count; ++t2) {
        const int64_t j2 = w2.first + t2 * w2.step;
        const int64_t b2 = p.kernel[2] - 1 + (j2 - global[2]) / p.dilation[2];
        const int64_t position =
            ((j0 - p.tile_offset[0]) * p.tile[1] + (j1 - p.tile_offset[1])) * p.tile[2] +
            (j2 - p.tile_offset[2]);
        out.push_back(Neighbour{position, (b0 * p.rpb[1] + b1) * p.rpb[2] + b2});
      }
    }
  }
}

/// Calls fn(b, flat query position, query coordinates) for every local query.
template <typename Fn>
void for_each_query(const Problem& p, Fn&& fn) {
  for (int64_t b = 0; b < p.batch; ++b) {
    int64_t flat = 0;
    for (int64_t x = 0; x < p.queries[0]; ++x)
      for (int64_t y = 0; y < p.queries[1]; ++y)
        for (int64_t z = 0; z < p.queries[2]; ++z, ++flat) fn(b, flat, Axes{x, y, z});
  }
}

/// Scaled (and biased) logits of one (query, head) over its neighbours; returns the row max.
double logits_of(const Problem& p, const double* q_row, const double* k_batch, const double* bias,
                 int64_t head, const std::vector<Neighbour>& neighbours,
                 std::vector<double>& logits) {
  logits.resize(neighbours.size());
  double row_max = -std::numeric_limits<double>::infinity();
  const int64_t bias_head = p.rpb[0] * p.rpb[1] * p.rpb[2] * head;
  for (size_t n = 0; n < neighbours.size(); ++n) {
    const double* k_row = k_batch + (neighbours[n].tile_position * p.heads + head) * p.dim;
    double dot = 0;
    for (int64_t e = 0; e < p.dim; ++e) dot += q_row[e] * k_row[e];
    double logit = p.scale * dot;
    if (bias) logit += bias[bias_head + neighbours[n].bias_index];
    logits[n] = logit;
    row_max = std::max(row_max, logit);
  }
  return row_max;
}

}  // namespace

NaForward na_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                     const NaGeometry& geometry, const NaPieces& pieces) {
  const Problem p = make_problem(q, k, v, rpb, geometry, pieces);
  const Tensor qd = as_f64(q), kd = as_f64(k), vd = as_f64(v);
  const Tensor bias = rpb ? as_f64(*rpb) : Tensor();
  Shape lse_shape = q.shape();
  lse_shape.pop_back();
  Tensor output = Tensor::zeros(q.shape(), DType::f64);
  Tensor lse = Tensor::zeros(lse_shape, DType::f64);
  const double* q_data = qd.data<double>();
  const double* k_data = kd.data<double>();
  const double* v_data = vd.data<double>();
  const double* bias_data = rpb ? bias.data<double>() : nullptr;
  double* o_data = output.data<double>();
  double* lse_data = lse.data<double>();
  const int64_t row = p.heads * p.dim;
  std::vector<Neighbour> neighbours;
  std::vector<double> logits;
  for_each_query(p, [&](int64_t b, int64_t flat, const Axes& query) {
    neighbours_of(p, query, neighbours);
    const int64_t query_row = b * p.query_count() + flat;
    const double* k_batch = k_data + b * p.tile_count() * row;
    const double* v_batch = v_data + b * p.tile_count() * row;
    for (int64_t h = 0; h < p.heads; ++h) {
      const double* q_row = q_data + query_row * row + h * p.dim;
      const double row_max = logits_of(p, q_row, k_batch, bias_data, h, neighbours, logits);
      double denominator = 0;
      double* o_row = o_data + query_row * row + h * p.dim;
      for (size_t n = 0; n < neighbours.size(); ++n) {
        const double weight = std::exp(logits[n] - row_max);
        denominator += weight;
        const double* v_row = v_batch + (neighbours[n].tile_position * p.heads + h) * p.dim;
        for (int64_t e = 0; e < p.dim; ++e) o_row[e] += weight * v_row[e];
      }
      for (int64_t e = 0; e < p.dim; ++e) o_row[e] /= denominator;
      lse_data[query_row * p.heads + h] = row_max + std::log(denominator);
    }
  });
  return NaForward{output.to_dtype(q.dtype()), lse.to_dtype(lse_dtype(q.dtype()))};
}

NaGradients na_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                        const Tensor& grad_output, const Tensor* grad_lse,
                        const NaGeometry& geometry, const NaPieces& pieces) {
  const Problem p = make_problem(q, k, v, rpb, geometry, pieces);
  check_arg(grad_output.shape() == q.shape(), "na", "gradient of o of shape {}, expected {}",
            grad_output.shape(), q.shape());
  Shape lse_shape = q.shape();
  lse_shape.pop_back();
  if (grad_lse)
    check_arg(grad_lse->shape() == lse_shape, "na", "gradient of lse of shape {}, expected {}",
              grad_lse->shape(), lse_shape);
  const Tensor qd = as_f64(q), kd = as_f64(k), vd = as_f64(v), god = as_f64(grad_output);
  const Tensor bias = rpb ? as_f64(*rpb) : Tensor();
  const Tensor glse = grad_lse ? as_f64(*grad_lse) : Tensor();
  Tensor dq = Tensor::zeros(q.shape(), DType::f64);
  Tensor dk = Tensor::zeros(k.shape(), DType::f64);
  Tensor dv = Tensor::zeros(v.shape(), DType::f64);
  Tensor drpb = rpb ? Tensor::zeros(rpb->shape(), DType::f64) : Tensor();
  const double* q_data = qd.data<double>();
  const double* k_data = kd.data<double>();
  const double* v_data = vd.data<double>();
  const double* go_data = god.data<double>();
  const double* bias_data = rpb ? bias.data<double>() : nullptr;
  const double* glse_data = grad_lse ? glse.data<double>() : nullptr;
  double* dq_data = dq.data<double>();
  double* dk_data = dk.data<double>();
  double* dv_data = dv.data<double>();
  double* drpb_data = rpb ? drpb.data<double>() : nullptr;
  const int64_t row = p.heads * p.dim;
  const int64_t bias_per_head = p.rpb[0] * p.rpb[1] * p.rpb[2];
  std::vector<Neighbour> neighbours;
  std::vector<double> logits, grad_probs;
  for_each_query(p, [&](int64_t b, int64_t flat, const Axes& query) {
    neighbours_of(p, query, neighbours);
    const int64_t query_row = b * p.query_count() + flat;
    const int64_t tile_base = b * p.tile_count() * row;
    for (int64_t h = 0; h < p.heads; ++h) {
      const double* q_row = q_data + query_row * row + h * p.dim;
      const double* go_row = go_data + query_row * row + h * p.dim;
      const double row_max =
          logits_of(p, q_row, k_data + tile_base, bias_data, h, neighbours, logits);
      // Probabilities p_j = exp(s_j - lse); dp_j = go . v_j; delta = sum_j p_j dp_j.
      double denominator = 0;
      for (double& logit : logits) denominator += (logit = std::exp(logit - row_max));
      grad_probs.resize(neighbours.size());
      double delta = 0;
      for (size_t n = 0; n < neighbours.size(); ++n) {
        logits[n] /= denominator;
        const double* v_row =
            v_data + tile_base + (neighbours[n].tile_position * p.heads + h) * p.dim;
        double dot = 0;
        for (int64_t e = 0; e < p.dim; ++e) dot += go_row[e] * v_row[e];
        grad_probs[n] = dot;
        delta += logits[n] * dot;
      }
      // ds_j = p_j (dp_j - delta + glse): the softmax adjoint, plus d lse / d s_j = p_j.
      const double lse_grad = glse_data ? glse_data[query_row * p.heads + h] : 0.0;
      double* dq_row = dq_data + query_row * row + h * p.dim;
      for (size_t n = 0; n < neighbours.size(); ++n) {
        const double prob = logits[n];
        const double grad_logit = prob * (grad_probs[n] - delta + lse_grad);
        const int64_t key_row = tile_base + (neighbours[n].tile_position * p.heads + h) * p.dim;
        const double* k_row = k_data + key_row;
        double* dk_row = dk_data + key_row;
        double* dv_row = dv_data + key_row;
        for (int64_t e = 0; e < p.dim; ++e) {
          dq_row[e] += p.scale * grad_logit * k_row[e];
          dk_row[e] += p.scale * grad_logit * q_row[e];
          dv_row[e] += prob * go_row[e];
        }
        if (drpb_data) drpb_data[bias_per_head * h + neighbours[n].bias_index] += grad_logit;
      }
    }
  });
  NaGradients grads{dq.to_dtype(q.dtype()), dk.to_dtype(k.dtype()), dv.to_dtype(v.dtype()),
                    Tensor()};
  if (rpb) grads.drpb = drpb.to_dtype(rpb->dtype());
  return grads;
}

}  // namespace tessera::ops
