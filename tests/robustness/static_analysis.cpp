// Instantiates every layer's forward and backward (float and double, both
// layouts, Tensor and TensorMap; bfloat16 and half, one layout each) so
// that static analysis (clang-tidy, cppcheck in .ci/robustness.sh) sees the
// template code of include/normcore with real types. Also built and run as
// a smoke test.
#include <normcore/normcore.hpp>
#include <normcore/reference/reference.hpp>

namespace {

template <typename T, int Layout>
int exercise() {
  Eigen::Tensor<T, 3, Layout> x(2, 3, 5), dy(2, 3, 5);
  x.setRandom();
  dy.setRandom();
  Eigen::TensorMap<Eigen::Tensor<T, 3, Layout>> xm(x.data(), 2, 3, 5);

  normcore::LayerNorm<T> ln(normcore::LayerNormOptions({3, 5}));
  normcore::NormStats<T> s;
  Eigen::Tensor<T, 3, Layout> y(2, 3, 5);
  ln.forward(xm, y, s);
  auto g = ln.backward(x, dy, &s);

  normcore::RMSNorm<T> rn(normcore::RMSNormOptions({5}).eps(1e-6));
  rn.forward(x, y, s);
  auto gr = rn.backward(xm, dy, &s);

  normcore::BatchNorm<T> bn(normcore::BatchNormOptions(3).momentum(std::nullopt));
  bn.forward(x, y, s);
  auto gb = bn.backward(x, dy, &s);
  bn.eval();
  const auto ye = bn(xm);
  normcore::BatchNorm<T> nhwc(normcore::BatchNormOptions(5).channel_axis(-1));
  const auto yl = nhwc(x);

  const auto ref = normcore::reference::layer_norm_forward(x.data(), 6, 5, ln.weight().data(), ln.bias().data(), 1e-5);
  const auto rref = normcore::reference::rms_norm_backward(x.data(), dy.data(), 6, 5, rn.weight().data(), 1e-6);
  const auto st = normcore::reference::channel_stats(x.data(), 2, 3, 5);
  normcore::Welford<double> w;
  w.update(1.0);
  return static_cast<int>(g.dx.size() + gr.dx.size() + gb.dx.size() + ye.size() + yl.size() + ref.size() +
                          rref.dx.size() + st.mean.size()) +
         static_cast<int>(w.count());
}

// The 16-bit storage paths: the layers widen each value as they read it
// and round each output once (LayerNorm and RMSNorm rows, BatchNorm's
// forward), or go through float copies (BatchNorm's backward, kept in the
// thread's scratch until release_scratch).
template <typename S, int Layout>
int exercise16() {
  Eigen::Tensor<S, 3, Layout> x(4, 3, 40), dy(4, 3, 40), y(4, 3, 40);
  x.setRandom();
  dy.setRandom();
  normcore::LayerNorm<S> ln(normcore::LayerNormOptions({40}));
  normcore::NormStats<float> s;
  ln.forward(x, y, s);
  auto g = ln.backward(x, dy, &s);
  normcore::RMSNorm<S> rn(normcore::RMSNormOptions({40}));
  rn.forward(x, y);
  auto gr = rn.backward(x, dy);
  normcore::BatchNorm<S> bn(normcore::BatchNormOptions(3));
  bn.forward(x, y, s);
  auto gb = bn.backward(x, dy, &s);
  bn.eval();
  bn.forward(x, y);
  normcore::BatchNorm<S> nhwc(normcore::BatchNormOptions(40).channel_axis(-1));
  nhwc.forward(x, y);
  normcore::release_scratch();
  return static_cast<int>(g.dx.size() + gr.dx.size() + gb.dx.size());
}

}  // namespace

int main() {
  const int n = exercise<float, Eigen::RowMajor>() + exercise<float, Eigen::ColMajor>() +
                exercise<double, Eigen::RowMajor>() + exercise<double, Eigen::ColMajor>() +
                exercise16<Eigen::bfloat16, Eigen::RowMajor>() + exercise16<Eigen::half, Eigen::ColMajor>();
  return n > 0 ? 0 : 1;
}
