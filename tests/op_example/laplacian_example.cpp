// A user-defined sharded op, written outside Tessera: the 7-point Laplacian of a 3-d field,
//   out[i,j,k] = u[i-1,j,k] + u[i+1,j,k] + u[i,j-1,k] + u[i,j+1,k] + u[i,j,k-1] + u[i,j,k+1] - 6
//   u[i,j,k]
// with zero (or periodic) boundaries. It registers a rule (halo of 1 on every dim), a cpu
// kernel on the haloed piece and a backward, then checks on a 2x2 mesh of local ranks with
// uneven extents that the sharded result and gradient equal the unsharded ones.
#include <cmath>
#include <cstdio>
#include <tessera/tessera.hpp>

using namespace tessera;

namespace {

/// out = stencil(in) over the interior of `in` (in is the haloed piece: 1 larger on each side).
Tensor apply_stencil(const Tensor& in) {
  const Tensor u = in.contiguous();
  const int64_t X = u.shape(0) - 2, Y = u.shape(1) - 2, Z = u.shape(2) - 2;
  Tensor out = Tensor::zeros(
      {std::max<int64_t>(X, 0), std::max<int64_t>(Y, 0), std::max<int64_t>(Z, 0)}, DType::f64);
  if (out.numel() == 0) return out;
  const double* v = u.data<double>();
  double* o = out.data<double>();
  const int64_t sy = u.shape(2), sx = u.shape(1) * u.shape(2);
  for (int64_t i = 0; i < X; ++i)
    for (int64_t j = 0; j < Y; ++j)
      for (int64_t k = 0; k < Z; ++k) {
        const int64_t c = (i + 1) * sx + (j + 1) * sy + (k + 1);
        o[(i * Y + j) * Z + k] =
            v[c - sx] + v[c + sx] + v[c - sy] + v[c + sy] + v[c - 1] + v[c + 1] - 6 * v[c];
      }
  return out;
}

/// The adjoint of apply_stencil: gradient of the haloed input from the gradient of the output.
Tensor stencil_adjoint(const Tensor& grad_out, const Shape& haloed_shape) {
  const Tensor g = grad_out.contiguous();
  Tensor grad_in = Tensor::zeros(haloed_shape, DType::f64);
  const int64_t X = g.shape(0), Y = g.shape(1), Z = g.shape(2);
  double* d = grad_in.data<double>();
  const int64_t sy = haloed_shape[2], sx = haloed_shape[1] * haloed_shape[2];
  for (int64_t i = 0; i < X; ++i)
    for (int64_t j = 0; j < Y; ++j)
      for (int64_t k = 0; k < Z; ++k) {
        const double value = g.data<double>()[(i * Y + j) * Z + k];
        const int64_t c = (i + 1) * sx + (j + 1) * sy + (k + 1);
        for (int64_t step : {sx, sy, int64_t{1}}) {
          d[c - step] += value;
          d[c + step] += value;
        }
        d[c] -= 6 * value;
      }
  return grad_in;
}

/// Rule: same layout out as in; every rank needs its owned box grown by 1 on every dim.
OpRule laplacian_rule(const std::vector<ShardSpec>& inputs, const OpAttrs& attrs) {
  const ShardSpec& u = inputs.at(0);
  if (u.global_shape.size() != 3 || u.has_partial())
    throw InvalidArgument("laplacian7", "expects a 3-d field without partial sums, got " + u.str());
  const BoundaryMode mode = attrs.get_string("boundary", "zero") == "periodic"
                                ? BoundaryMode::periodic
                                : BoundaryMode::zero;
  HaloNeed halo{grown_boxes(u, {1, 1, 1}, {1, 1, 1}), {mode, mode, mode}};
  return OpRule{{u}, {halo}, {u}};
}

std::vector<Tensor> laplacian_cpu(const KernelContext&, const std::vector<Tensor>& inputs) {
  return {apply_stencil(inputs[0])};
}

std::vector<std::optional<ShardTensor>> laplacian_backward(
    const OpRecord& record, const std::vector<std::optional<ShardTensor>>& grads) {
  const ShardTensor& u = record.inputs[0];
  const ShardTensor g = grads[0]->redistribute(u.placements(), u.spec().extents);
  const Tensor grad_haloed = stencil_adjoint(g.to_local(), record.kernel_inputs[0].shape());
  // Gradient that landed in halo cells goes back to the ranks that own them.
  return {ShardTensor(halo_adjoint(*record.plans[0], grad_haloed, u.mesh().comm()), u.mesh(),
                      u.spec())};
}

ShardTensor laplacian(const ShardTensor& u, const std::string& boundary) {
  return apply_op("laplacian7", {u}, OpAttrs().set("boundary", boundary))[0];
}

/// Runs laplacian + loss = sum(out * weight) on `mesh` and returns (out, d loss / du), full.
std::pair<Tensor, Tensor> run(const DeviceMesh& mesh, const std::vector<Placement>& placements,
                              const std::vector<std::vector<int64_t>>& extents, const Tensor& field,
                              const std::string& boundary) {
  Tape tape;
  ShardTensor u = ShardTensor::distribute(field, mesh, placements, extents);
  u.set_requires_grad();
  const ShardTensor out = laplacian(u, boundary);
  // d(sum(out * out) / 2) / d out = out, so the gradient is L^T L u.
  const ShardTensor loss = apply_op("scale", {apply_op("sum", {apply_op("mul", {out, out})[0]})[0]},
                                    OpAttrs().set("factor", 0.5))[0];
  tape.backward(loss);
  return {out.full_tensor(), tape.grad(u)->full_tensor()};
}

}  // namespace

int main() {
  register_op(OpDef{.name = "laplacian7",
                    .summary = "7-point Laplacian of a 3-d field",
                    .inputs = {{.name = "u"}},
                    .outputs = {"y"},
                    .attrs = {{.name = "boundary",
                               .type = AttrType::string,
                               .default_value = std::string("zero"),
                               .doc = "zero or periodic"}},
                    .rule = laplacian_rule,
                    .cpu = laplacian_cpu,
                    .backward = laplacian_backward});
  const Shape shape{9, 7, 5};
  Tensor field = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < field.numel(); ++i)
    field.data<double>()[i] = std::sin(0.37 * i) + 0.01 * (i % 11);
  bool ok = true;
  run_local_ranks(4, [&](std::shared_ptr<Comm> world) {
    DeviceMesh mesh(world, {2, 2}, {"x", "y"});
    DeviceMesh single(world->split(world->rank(), 0), {1});
    for (const std::string boundary : {"zero", "periodic"}) {
      // Uneven extents, one of them thinner than the halo would need from a neighbour's side.
      const auto [out, grad] =
          run(mesh, {Placement::shard(0), Placement::shard(1)}, {{8, 1}, {2, 5}}, field, boundary);
      const auto [ref_out, ref_grad] = run(single, {Placement::replicate()}, {}, field, boundary);
      const double out_error = max_abs_diff(out, ref_out),
                   grad_error = max_abs_diff(grad, ref_grad);
      if (world->rank() == 0)
        std::printf(
            "laplacian7 (%s boundary): max |sharded - unsharded| = %.3g (out), %.3g (grad)\n",
            boundary.c_str(), out_error, grad_error);
      ok = ok && out_error < 1e-12 && grad_error < 1e-12;
    }
  });
  std::printf("%s\n", ok ? "laplacian example: OK" : "laplacian example: MISMATCH");
  return ok ? 0 : 1;
}
