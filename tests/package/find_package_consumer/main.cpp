// A user's program: normalize one row and check the worked example.
#include <cmath>
#include <cstdio>

#include <normcore/normcore.hpp>

int main() {
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({4}).eps(0.0));
  Eigen::Tensor<float, 2, Eigen::RowMajor> x(1, 4);
  x.setValues({{2, 4, 4, 6}});
  Eigen::Tensor<float, 2, Eigen::RowMajor> y = ln(x);
  std::printf("%.4f %.4f %.4f %.4f\n", y(0, 0), y(0, 1), y(0, 2), y(0, 3));
  return std::fabs(y(0, 3) - std::sqrt(2.0f)) < 1e-6f ? 0 : 1;
}
