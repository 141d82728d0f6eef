// normcore::reference: RMSNorm by definition, in long double (so that the
// squares of any float or double input neither overflow nor underflow).
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "normcore/reference/layer_norm.hpp"

namespace normcore {
namespace reference {

/// y = x / sqrt(mean(x^2) + eps) * gamma (gamma may be null); rows x n row-major.
template <typename T>
std::vector<double> rms_norm_forward(const T* x, std::ptrdiff_t rows, std::ptrdiff_t n,
                                     const T* gamma, double eps,
                                     std::vector<long double>* rstd = nullptr) {
  std::vector<double> y(static_cast<std::size_t>(rows * n));
  if (rstd) rstd->resize(static_cast<std::size_t>(rows));
  for (std::ptrdiff_t r = 0; r < rows; ++r) {
    long double ss = 0;
    for (std::ptrdiff_t j = 0; j < n; ++j) ss += static_cast<long double>(x[r * n + j]) * x[r * n + j];
    const long double rs = 1.0L / std::sqrt(ss / n + eps);
    if (rstd) (*rstd)[static_cast<std::size_t>(r)] = rs;
    for (std::ptrdiff_t j = 0; j < n; ++j) {
      long double v = x[r * n + j] * rs;
      if (gamma) v *= gamma[j];
      y[static_cast<std::size_t>(r * n + j)] = static_cast<double>(v);
    }
  }
  return y;
}

/// dx = rstd * (g - x_hat * mean(g * x_hat)), g = dy * gamma; dweight summed over rows.
template <typename T>
Grads rms_norm_backward(const T* x, const T* dy, std::ptrdiff_t rows, std::ptrdiff_t n,
                        const T* gamma, double eps) {
  std::vector<long double> rstd;
  rms_norm_forward(x, rows, n, gamma, eps, &rstd);
  Grads g;
  g.dx.resize(static_cast<std::size_t>(rows * n));
  g.dweight.assign(static_cast<std::size_t>(n), 0.0);
  for (std::ptrdiff_t r = 0; r < rows; ++r) {
    const long double rs = rstd[static_cast<std::size_t>(r)];
    long double c = 0;
    for (std::ptrdiff_t j = 0; j < n; ++j)
      c += static_cast<long double>(dy[r * n + j]) * (gamma ? gamma[j] : T(1)) * x[r * n + j] * rs;
    c /= n;
    for (std::ptrdiff_t j = 0; j < n; ++j) {
      const long double xh = x[r * n + j] * rs;
      const long double gg = static_cast<long double>(dy[r * n + j]) * (gamma ? gamma[j] : T(1));
      g.dx[static_cast<std::size_t>(r * n + j)] = static_cast<double>(rs * (gg - xh * c));
      g.dweight[static_cast<std::size_t>(j)] += static_cast<double>(dy[r * n + j] * xh);
    }
  }
  return g;
}

}  // namespace reference
}  // namespace normcore
