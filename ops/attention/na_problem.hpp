// The validated form of one neighborhood attention call, shared by the reference
// (na_reference.cpp) and the fast cpu kernels (na_cpu.cpp): every call seen as 3-d (1-d and 2-d
// problems get leading spatial axes of extent 1, kernel 1, dilation 1), with the window of every
// local query precomputed and the check that the key/value tile holds every key they read.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "ops/attention/na_cuda_plan.hpp"
#include "ops/attention/na_reference.hpp"

namespace tessera::ops::na_detail {

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
  bool has_rpb = false;  // a bias table came with the call

  int64_t query_count() const { return queries[0] * queries[1] * queries[2]; }
  int64_t tile_count() const { return tile[0] * tile[1] * tile[2]; }
  int64_t rpb_count() const { return rpb[0] * rpb[1] * rpb[2]; }
};

/// Validates the call and fills a Problem (axis a of the user's problem is axis
/// kAxes - spatial + a here). Throws InvalidArgument naming the offending values. Every tensor
/// must lie on `device` (the cpu kernels' default; the cuda kernels pass q's device).
Problem make_problem(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* rpb,
                     const NaGeometry& geometry, const NaPieces& pieces,
                     Device device = Device::cpu());

/// The cuda kernels' view of a validated call (the same axes, padded at the front to 3, the
/// global extents and causal flags from `geometry`, and whether a bias table is applied). A
/// plain function so that the cpu unit tests check what the launches receive.
kernels::NaCall make_na_call(const Problem& p, const NaGeometry& geometry);

/// Checks the backward's gradients against q's shape (grad_lse: q's shape without D).
void check_backward_grads(const Tensor& q, const Tensor& grad_output, const Tensor* grad_lse);

/// The dtype of lse for inputs of `dtype`: f32 for f16/bf16, otherwise `dtype`.
DType lse_dtype(DType dtype);

}  // namespace tessera::ops::na_detail
