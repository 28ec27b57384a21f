// One cell of the Gray-Scott step, in plain C++17 so that the cpu rows (gray_scott.cpp) and the
// cuda kernel (gray_scott_kernel.cu) run the same operations in the scheme's order: the 7-point
// Laplacian summed x-, x+, y-, y+, z-, z+ then - 6 f, uvv = u v v, then the two updates. Both
// files are compiled without floating-point contraction, so the results agree bit for bit.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TESSERA_CELL __host__ __device__ inline
#else
#define TESSERA_CELL inline
#endif

namespace tessera::sim {

/// The parameters in the field's type, F + k added in that type.
template <class T>
struct CellCoefficients {
  T du, dv, feed, fk, dt;
  TESSERA_CELL CellCoefficients(double du_, double dv_, double feed_, double kill_, double dt_)
      : du(static_cast<T>(du_)),
        dv(static_cast<T>(dv_)),
        feed(static_cast<T>(feed_)),
        fk(static_cast<T>(feed_) + static_cast<T>(kill_)),
        dt(static_cast<T>(dt_)) {}
};

/// un[at], vn[at] from u, v around `at` in haloed arrays with x stride sx and y stride sy (z
/// neighbours adjacent).
template <class T>
TESSERA_CELL void gray_scott_cell(const T* __restrict__ u, const T* __restrict__ v,
                                  T* __restrict__ un, T* __restrict__ vn, int64_t at, int64_t sx,
                                  int64_t sy, const CellCoefficients<T>& c) {
  const T one = 1, six = 6;
  const T uc = u[at], vc = v[at];
  T lu = u[at - sx] + u[at + sx];
  lu = lu + u[at - sy];
  lu = lu + u[at + sy];
  lu = lu + u[at - 1];
  lu = lu + u[at + 1];
  lu = lu - six * uc;
  T lv = v[at - sx] + v[at + sx];
  lv = lv + v[at - sy];
  lv = lv + v[at + sy];
  lv = lv + v[at - 1];
  lv = lv + v[at + 1];
  lv = lv - six * vc;
  const T uvv = uc * vc * vc;
  un[at] = uc + c.dt * ((c.du * lu - uvv) + c.feed * (one - uc));
  vn[at] = vc + c.dt * ((c.dv * lv + uvv) - c.fk * vc);
}

}  // namespace tessera::sim
