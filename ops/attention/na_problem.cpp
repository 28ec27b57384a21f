// Validation of a neighborhood attention call and its windows (see na_problem.hpp).
#include "ops/attention/na_problem.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/errors.hpp"

namespace tessera::ops::na_detail {

Problem make_problem(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                     const NaGeometry& geometry, const NaPieces& pieces, Device device) {
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
    TESSERA_CHECK_ARG(t->device() == device, "na", "{} kernel got a {} tensor",
                      device.is_cpu() ? "cpu" : "cuda", t->device().str());
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
    TESSERA_CHECK_ARG(is_floating(rpb->dtype()) && rpb->device() == device, "na",
                      "rpb must be a floating tensor on {}, got {}", device.str(), rpb->str());
    p.has_rpb = true;
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

kernels::NaCall make_na_call(const Problem& p, const NaGeometry& geometry) {
  kernels::NaCall call;
  call.spatial = p.spatial;
  call.batch = p.batch;
  call.heads = p.heads;
  call.dim = p.dim;
  call.scale = p.scale;
  // Without it the kernels would neither add the bias nor write d rpb (an uninitialized table).
  call.has_rpb = p.has_rpb;
  const int shift = kAxes - p.spatial;
  for (int a = 0; a < kAxes; ++a) {
    kernels::NaAxis& axis = call.axes[a];
    axis.length = a >= shift ? geometry.extent[a - shift] : 1;
    axis.causal = a >= shift ? static_cast<int>(geometry.causal[a - shift]) : 0;
    axis.kernel = p.kernel[a];
    axis.dilation = p.dilation[a];
    axis.query_offset = p.query_offset[a];
    axis.queries = p.queries[a];
    axis.tile_offset = p.tile_offset[a];
    axis.tile = p.tile[a];
  }
  return call;
}

void check_backward_grads(const Tensor& q, const Tensor& grad_output, const Tensor* grad_lse) {
  check_arg(grad_output.shape() == q.shape(), "na", "gradient of o of shape {}, expected {}",
            grad_output.shape(), q.shape());
  Shape lse_shape = q.shape();
  lse_shape.pop_back();
  if (grad_lse)
    check_arg(grad_lse->shape() == lse_shape, "na", "gradient of lse of shape {}, expected {}",
              grad_lse->shape(), lse_shape);
}

DType lse_dtype(DType dtype) {
  return dtype == DType::f16 || dtype == DType::bf16 ? DType::f32 : dtype;
}

}  // namespace tessera::ops::na_detail
