// One program from two compilers' objects (CI's robustness stage, see
// "Lambdas" in include/normcore/config.hpp). Built three times:
//   -DNORMCORE_SIDE=1 with g++     -> side_1 runs every layer, both layouts,
//   -DNORMCORE_SIDE=2 with clang++ -> side_2 runs the same calls,
//   without NORMCORE_SIDE          -> main compares them;
// then linked in both orders, so that each compiler's copy of the shared
// inline functions is the one kept once. Each side's inlined code then calls
// the other compiler's out-of-line functions with closures it built itself.
// Before normcore listed its lambdas' captures this crashed in
// RMSNorm<float>::backward_colmajor. The two sides' results are compared
// with a tolerance (the compilers may contract a multiply and an add
// differently), and each against the reference path for one forward.
#include <cstddef>
#include <vector>

#ifdef NORMCORE_SIDE
#define EIGEN_USE_THREADS
#include <normcore/normcore.hpp>
#include <normcore/reference/reference.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// The same values on both sides, whatever the compiler: a fixed LCG.
template <typename Tensor>
void fill(Tensor& t, std::uint32_t seed) {
  using S = typename Tensor::Scalar;
  for (Eigen::Index i = 0; i < t.size(); ++i) {
    seed = seed * 1664525u + 1013904223u;
    t.data()[i] = S(static_cast<float>(seed >> 8) / 16777216.0f * 4.0f - 1.5f);
  }
}

// Each output value, and how far the other side's may lie from it (times
// 1 + |value|): a few ulps of its type. Both sides run the same library
// code, but a compiler may contract a multiply and an add where the other
// does not, or vectorize a scalar loop differently.
struct Out {
  std::vector<double> v, tol;
  template <typename Tensor>
  void add(const Tensor& t) {
    using S = typename Tensor::Scalar;
    const double ulps = std::is_same<S, double>::value  ? 1e-13
                        : std::is_same<S, float>::value ? 1e-5
                                                        : 1.0 / 128;  // 2 ulps of a 16-bit value's 8 or 11 bits
    for (Eigen::Index i = 0; i < t.size(); ++i) {
      v.push_back(static_cast<double>(t.data()[i]));
      tol.push_back(ulps);
    }
  }
};

// Every layer's forward and backward in layout Layout, on a device, with
// storage S (float or bfloat16) and a layer of P.
template <typename P, typename S, int Layout, typename Device>
void layers(const Device& dev, Out& out, Eigen::Index rows, Eigen::Index n) {
  using C = typename normcore::LayerNorm<P>::Compute;
  Eigen::Tensor<S, 2, Layout> x(rows, n), r(rows, n), h(rows, n), y(rows, n), dy(rows, n), dx(rows, n);
  fill(x, 1u);
  fill(r, 2u);
  fill(dy, 3u);
  normcore::NormStats<C> st;
  Eigen::Tensor<P, 1> dw, db;

  normcore::LayerNorm<P> ln(normcore::LayerNormOptions({n}));
  fill(ln.weight(), 4u);
  fill(ln.bias(), 5u);
  ln.forward(dev, x, y, st);
  out.add(y);
  ln.backward(dev, x, dy, &dx, &dw, &db, &st);
  out.add(dx);
  out.add(dw);
  out.add(db);
  ln.backward(dev, x, dy, &dx, &dw, &db);  // statistics recomputed
  out.add(dx);
  ln.forward_add(dev, x, r, h, y, &st);
  out.add(h);
  out.add(y);

  normcore::RMSNorm<P> rn(normcore::RMSNormOptions({n}).eps(1e-6));
  fill(rn.weight(), 6u);
  rn.forward(dev, x, y, st);
  out.add(y);
  rn.backward(dev, x, dy, &dx, &dw, &st);
  out.add(dx);
  out.add(dw);
  rn.backward(dev, x, dy, &dx, &dw);
  out.add(dx);
  rn.forward_add(dev, x, r, h, y, &st);
  out.add(y);

  // BatchNorm: (N, C, L) channels first and (N, L, C) channels last.
  Eigen::Tensor<S, 3, Layout> x3(rows, 8, n / 8), y3(rows, 8, n / 8), dy3(rows, 8, n / 8);
  fill(x3, 7u);
  fill(dy3, 8u);
  for (const int axis : {1, -1}) {
    const Eigen::Index channels = axis == 1 ? 8 : n / 8;
    normcore::BatchNorm<P> bn(normcore::BatchNormOptions(channels).channel_axis(axis));
    fill(bn.weight(), 9u);
    fill(bn.bias(), 10u);
    normcore::NormStats<C> bs;
    bn.forward(dev, x3, y3, bs);
    out.add(y3);
    Eigen::Tensor<S, 3, Layout> dx3(rows, 8, n / 8);
    bn.backward(dev, x3, dy3, &dx3, &dw, &db, &bs);
    out.add(dx3);
    out.add(dw);
    out.add(db);
    bn.eval();
    bn.forward(dev, x3, y3);
    out.add(y3);
  }
}

template <typename Device>
void all(const Device& dev, Out& out) {
  for (const Eigen::Index n : {Eigen::Index(64), Eigen::Index(768)}) {
    layers<float, float, Eigen::RowMajor>(dev, out, 19, n);  // (19 rows: ColMajor's last packet partial)
    layers<float, float, Eigen::ColMajor>(dev, out, 19, n);
    layers<Eigen::bfloat16, Eigen::bfloat16, Eigen::RowMajor>(dev, out, 19, n);
    layers<Eigen::bfloat16, Eigen::bfloat16, Eigen::ColMajor>(dev, out, 19, n);
  }
  layers<float, Eigen::bfloat16, Eigen::RowMajor>(dev, out, 19, 64);  // a float layer on 16-bit tensors
  layers<float, float, Eigen::RowMajor>(dev, out, 160, 256);  // over 32K values: split across threads
  layers<float, float, Eigen::ColMajor>(dev, out, 160, 256);
}

}  // namespace

#define NORMCORE_CAT2(a, b) a##b
#define NORMCORE_CAT(a, b) NORMCORE_CAT2(a, b)
// Every output of the calls above with its tolerance, and the largest error
// of one LayerNorm forward against the reference path.
std::vector<double> NORMCORE_CAT(side_, NORMCORE_SIDE)(std::vector<double>* tol, double* ref_error) {
  Out out;
  all(normcore::Serial(), out);
  Eigen::ThreadPool pool(1);
  Eigen::ThreadPoolDevice dev(&pool, 2);
  all(dev, out);

  Eigen::Tensor<float, 2, Eigen::RowMajor> x(33, 768), y(33, 768);
  fill(x, 11u);
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({768}));
  ln.forward(x, y);
  const auto ref = normcore::reference::layer_norm_forward(x.data(), 33, 768, ln.weight().data(),
                                                           ln.bias().data(), 1e-5);
  double e = 0;
  for (Eigen::Index i = 0; i < y.size(); ++i)
    e = std::fmax(e, std::fabs(static_cast<double>(y.data()[i]) - ref[static_cast<std::size_t>(i)]));
  *ref_error = e;
  *tol = out.tol;
  return out.v;
}

#else  // main

#include <cmath>
#include <cstdio>
#include <vector>

std::vector<double> side_1(std::vector<double>* tol, double* ref_error);
std::vector<double> side_2(std::vector<double>* tol, double* ref_error);

int main() {
  double ea = 0, eb = 0;
  std::vector<double> ta, tb;
  const std::vector<double> a = side_1(&ta, &ea), b = side_2(&tb, &eb);
  const std::size_t na = a.size();
  if (a.size() != b.size() || a.empty() || ta != tb || ta.size() != a.size()) {
    std::printf("mixed_compilers: the sides returned %zu and %zu values (expected the same count)\n", a.size(),
                b.size());
    return 1;
  }
  std::size_t bad = 0, differ = 0;
  double worst = 0;
  for (std::size_t i = 0; i < na; ++i) {
    const double tol = ta[i] * (1.0 + std::fabs(a[i]));
    if (a[i] != b[i] && !(std::isnan(a[i]) && std::isnan(b[i]))) {
      ++differ;
      worst = std::fmax(worst, std::fabs(a[i] - b[i]) / (1.0 + std::fabs(a[i])));
    }
    if (!(std::fabs(a[i] - b[i]) <= tol) && !(std::isnan(a[i]) && std::isnan(b[i]))) {
      if (bad++ < 10) std::printf("mixed_compilers: value %zu: side 1 %.9g, side 2 %.9g\n", i, a[i], b[i]);
    }
  }
  std::printf("mixed_compilers: %zu values, %zu not the same bits (at most %.3g relative), %zu beyond tolerance; "
              "LayerNorm forward against the reference: %.3g, %.3g\n",
              na, differ, worst, bad, ea, eb);
  return bad == 0 && ea < 1e-5 && eb < 1e-5 ? 0 : 1;
}

#endif
