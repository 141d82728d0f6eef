// Instantiates every layer's forward and backward (float and double, both
// layouts, Tensor and TensorMap) so that static analysis (clang-tidy,
// cppcheck in .ci/robustness.sh) sees the template code of include/normcore
// with real types. Also built and run as a smoke test.
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

}  // namespace

int main() {
  const int n = exercise<float, Eigen::RowMajor>() + exercise<float, Eigen::ColMajor>() +
                exercise<double, Eigen::RowMajor>() + exercise<double, Eigen::ColMajor>();
  return n > 0 ? 0 : 1;
}
