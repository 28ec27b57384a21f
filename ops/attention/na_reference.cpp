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
#include "ops/attention/na_problem.hpp"

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

using namespace na_detail;

/// A contiguous f64 copy (or view) of a tensor.
Tensor as_f64(const Tensor& t) {
  return t.to_dtype(DType::f64).contiguous();
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
  check_backward_grads(q, grad_output, grad_lse);
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
