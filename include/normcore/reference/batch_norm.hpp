// normcore::reference: BatchNorm by definition, in double, two-pass. Data in
// logical row-major order viewed as (outer, C, inner): outer = product of the
// dims before the channel axis, inner = product of the dims after it.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "normcore/reference/layer_norm.hpp"

namespace normcore {
namespace reference {

struct ChannelStats {
  std::vector<double> mean;
  std::vector<double> var;  // biased
};

template <typename T>
ChannelStats channel_stats(const T* x, std::ptrdiff_t outer, std::ptrdiff_t C, std::ptrdiff_t inner) {
  ChannelStats s;
  s.mean.assign(static_cast<std::size_t>(C), 0.0);
  s.var.assign(static_cast<std::size_t>(C), 0.0);
  const double n = static_cast<double>(outer * inner);
  for (std::ptrdiff_t c = 0; c < C; ++c) {
    double sum = 0;
    for (std::ptrdiff_t o = 0; o < outer; ++o)
      for (std::ptrdiff_t i = 0; i < inner; ++i) sum += static_cast<double>(x[(o * C + c) * inner + i]);
    const double m = sum / n;
    double sq = 0;
    for (std::ptrdiff_t o = 0; o < outer; ++o)
      for (std::ptrdiff_t i = 0; i < inner; ++i) {
        const double d = static_cast<double>(x[(o * C + c) * inner + i]) - m;
        sq += d * d;
      }
    s.mean[static_cast<std::size_t>(c)] = m;
    s.var[static_cast<std::size_t>(c)] = sq / n;
  }
  return s;
}

/// y = (x - mean_c) / sqrt(var_c + eps) * gamma_c + beta_c with the given
/// per-channel mean and (biased) variance; gamma/beta may be null.
template <typename T>
std::vector<double> batch_norm_forward(const T* x, std::ptrdiff_t outer, std::ptrdiff_t C,
                                       std::ptrdiff_t inner, const std::vector<double>& mean,
                                       const std::vector<double>& var, const T* gamma,
                                       const T* beta, double eps) {
  std::vector<double> y(static_cast<std::size_t>(outer * C * inner));
  for (std::ptrdiff_t o = 0; o < outer; ++o)
    for (std::ptrdiff_t c = 0; c < C; ++c) {
      const std::size_t cc = static_cast<std::size_t>(c);
      const double r = 1.0 / std::sqrt(var[cc] + eps);
      for (std::ptrdiff_t i = 0; i < inner; ++i) {
        const std::ptrdiff_t k = (o * C + c) * inner + i;
        double v = (static_cast<double>(x[k]) - mean[cc]) * r;
        if (gamma) v *= static_cast<double>(gamma[c]);
        if (beta) v += static_cast<double>(beta[c]);
        y[static_cast<std::size_t>(k)] = v;
      }
    }
  return y;
}

/// Training-mode backward (through the batch statistics) when `training`,
/// else eval-mode backward through the given fixed mean and var.
template <typename T>
Grads batch_norm_backward(const T* x, const T* dy, std::ptrdiff_t outer, std::ptrdiff_t C,
                          std::ptrdiff_t inner, const std::vector<double>& mean,
                          const std::vector<double>& var, const T* gamma, double eps,
                          bool training) {
  Grads g;
  const std::size_t N = static_cast<std::size_t>(outer * C * inner);
  g.dx.assign(N, 0.0);
  g.dweight.assign(static_cast<std::size_t>(C), 0.0);
  g.dbias.assign(static_cast<std::size_t>(C), 0.0);
  const double n = static_cast<double>(outer * inner);
  for (std::ptrdiff_t c = 0; c < C; ++c) {
    const std::size_t cc = static_cast<std::size_t>(c);
    const double r = 1.0 / std::sqrt(var[cc] + eps);
    const double gm = gamma ? static_cast<double>(gamma[c]) : 1.0;
    double sdy = 0, sdyx = 0;
    for (std::ptrdiff_t o = 0; o < outer; ++o)
      for (std::ptrdiff_t i = 0; i < inner; ++i) {
        const std::ptrdiff_t k = (o * C + c) * inner + i;
        const double xh = (static_cast<double>(x[k]) - mean[cc]) * r;
        sdy += static_cast<double>(dy[k]);
        sdyx += static_cast<double>(dy[k]) * xh;
      }
    g.dweight[cc] = sdyx;
    g.dbias[cc] = sdy;
    for (std::ptrdiff_t o = 0; o < outer; ++o)
      for (std::ptrdiff_t i = 0; i < inner; ++i) {
        const std::ptrdiff_t k = (o * C + c) * inner + i;
        const double xh = (static_cast<double>(x[k]) - mean[cc]) * r;
        const double d = static_cast<double>(dy[k]);
        g.dx[static_cast<std::size_t>(k)] =
            training ? gm * r * (d - sdy / n - xh * sdyx / n) : gm * r * d;
      }
  }
  return g;
}

}  // namespace reference
}  // namespace normcore
