// normcore::reference: LayerNorm by definition. Plain loops, double
// accumulation, two passes (mean, then squared deviations). Simple on purpose
// and never optimized: the tests compare the fast path against it.
// Data are rows x n, row-major (PyTorch's logical order).
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

namespace normcore {
namespace reference {

struct RowStats {
  std::vector<double> mean;
  std::vector<double> rstd;
};

/// Mean and 1/sqrt(biased var + eps) of each row, two-pass in double.
template <typename T>
RowStats row_stats(const T* x, std::ptrdiff_t rows, std::ptrdiff_t n, double eps) {
  RowStats s;
  s.mean.resize(static_cast<std::size_t>(rows));
  s.rstd.resize(static_cast<std::size_t>(rows));
  for (std::ptrdiff_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (std::ptrdiff_t j = 0; j < n; ++j) sum += static_cast<double>(x[r * n + j]);
    const double mean = sum / static_cast<double>(n);
    double sq = 0;
    for (std::ptrdiff_t j = 0; j < n; ++j) {
      const double d = static_cast<double>(x[r * n + j]) - mean;
      sq += d * d;
    }
    s.mean[static_cast<std::size_t>(r)] = mean;
    s.rstd[static_cast<std::size_t>(r)] = 1.0 / std::sqrt(sq / static_cast<double>(n) + eps);
  }
  return s;
}

/// y = (x - mean) * rstd * gamma + beta; gamma/beta may be null.
template <typename T>
std::vector<double> layer_norm_forward(const T* x, std::ptrdiff_t rows, std::ptrdiff_t n,
                                       const T* gamma, const T* beta, double eps,
                                       RowStats* stats = nullptr) {
  const RowStats s = row_stats(x, rows, n, eps);
  std::vector<double> y(static_cast<std::size_t>(rows * n));
  for (std::ptrdiff_t r = 0; r < rows; ++r) {
    for (std::ptrdiff_t j = 0; j < n; ++j) {
      double v = (static_cast<double>(x[r * n + j]) - s.mean[static_cast<std::size_t>(r)]) *
                 s.rstd[static_cast<std::size_t>(r)];
      if (gamma) v *= static_cast<double>(gamma[j]);
      if (beta) v += static_cast<double>(beta[j]);
      y[static_cast<std::size_t>(r * n + j)] = v;
    }
  }
  if (stats) *stats = s;
  return y;
}

struct Grads {
  std::vector<double> dx;
  std::vector<double> dweight;
  std::vector<double> dbias;
};

/// The textbook LayerNorm backward, statistics recomputed in double:
/// x_hat = (x - mean) * rstd, g = dy * gamma,
/// dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)),
/// dweight = sum over rows of dy * x_hat, dbias = sum over rows of dy.
template <typename T>
Grads layer_norm_backward(const T* x, const T* dy, std::ptrdiff_t rows, std::ptrdiff_t n,
                          const T* gamma, double eps) {
  const RowStats s = row_stats(x, rows, n, eps);
  Grads g;
  g.dx.resize(static_cast<std::size_t>(rows * n));
  g.dweight.assign(static_cast<std::size_t>(n), 0.0);
  g.dbias.assign(static_cast<std::size_t>(n), 0.0);
  std::vector<double> xhat(static_cast<std::size_t>(n)), gg(static_cast<std::size_t>(n));
  for (std::ptrdiff_t r = 0; r < rows; ++r) {
    double mean_g = 0, mean_gx = 0;
    for (std::ptrdiff_t j = 0; j < n; ++j) {
      const std::size_t jj = static_cast<std::size_t>(j);
      xhat[jj] = (static_cast<double>(x[r * n + j]) - s.mean[static_cast<std::size_t>(r)]) *
                 s.rstd[static_cast<std::size_t>(r)];
      gg[jj] = static_cast<double>(dy[r * n + j]) * (gamma ? static_cast<double>(gamma[j]) : 1.0);
      mean_g += gg[jj];
      mean_gx += gg[jj] * xhat[jj];
      g.dweight[jj] += static_cast<double>(dy[r * n + j]) * xhat[jj];
      g.dbias[jj] += static_cast<double>(dy[r * n + j]);
    }
    mean_g /= static_cast<double>(n);
    mean_gx /= static_cast<double>(n);
    for (std::ptrdiff_t j = 0; j < n; ++j) {
      const std::size_t jj = static_cast<std::size_t>(j);
      g.dx[static_cast<std::size_t>(r * n + j)] =
          s.rstd[static_cast<std::size_t>(r)] * (gg[jj] - mean_g - xhat[jj] * mean_gx);
    }
  }
  return g;
}

}  // namespace reference
}  // namespace normcore
