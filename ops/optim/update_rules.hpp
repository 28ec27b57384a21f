// The per-element update rules of the optimizers, in plain C++17 so that the cpu loops
// (optimizer.cpp) and the cuda kernels (optimizer_cuda.cu) run the same formulas: PyTorch's
// torch.optim.SGD and Adam/AdamW (foreach=False) for one element. T is float or double.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define TESSERA_UPDATE_RULE __host__ __device__ inline
#else
#define TESSERA_UPDATE_RULE inline
#endif

namespace tessera::optim::rules {

/// SGD's constants for one step (momentum 0: no buffer).
template <typename T>
struct Sgd {
  T lr, weight_decay, momentum, dampening_weight;  // dampening_weight = 1 - dampening
  bool nesterov, maximize, first;                  // first: the buffer starts as g
  bool has_weight_decay, has_momentum;

  /// p -= lr * g, g with weight decay added and through the momentum buffer b (when kept).
  TESSERA_UPDATE_RULE void operator()(T& p, T grad, T* b) const {
    T g = maximize ? -grad : grad;
    if (has_weight_decay) g = g + weight_decay * p;
    if (has_momentum) {
      *b = first ? g : momentum * *b + dampening_weight * g;
      g = nesterov ? g + momentum * *b : *b;
    }
    p = p - lr * g;
  }
};

/// Adam's constants for one step (AdamW: decoupled weight decay).
template <typename T>
struct Adam {
  T beta1_weight, beta2, one_minus_beta2;  // beta1_weight = 1 - beta1
  T decay, weight_decay, eps;              // decay = 1 - lr * weight_decay (decoupled)
  T step_size, bias_correction2_sqrt;      // lr / (1 - beta1^t), sqrt(1 - beta2^t)
  bool decoupled, maximize, has_weight_decay;

  /// One Adam/AdamW update of p with moments m, v (and the running max of v with amsgrad).
  TESSERA_UPDATE_RULE void operator()(T& p, T grad, T& m, T& v, T* v_max) const {
    T g = maximize ? -grad : grad;
    if (decoupled)
      p = p * decay;
    else if (has_weight_decay)
      g = g + weight_decay * p;
    // lerp(m, g, w) as PyTorch computes it: m + w * (g - m) for w < 0.5, else g - (g - m) * (1 -
    // w).
    m = beta1_weight < T(0.5) ? m + beta1_weight * (g - m) : g - (g - m) * (T(1) - beta1_weight);
    v = v * beta2 + one_minus_beta2 * g * g;
    T second = v;
    if (v_max) {
      if (v > *v_max) *v_max = v;
      second = *v_max;
    }
    using std::sqrt;  // float stays float (device code has std::sqrt too)
    const T denom = sqrt(second) / bias_correction2_sqrt + eps;
    p = p - step_size * (m / denom);
  }
};

}  // namespace tessera::optim::rules
