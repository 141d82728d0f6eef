// Two translation units include every normcore header and instantiate the
// same templates; the linker must see one definition of each.
#include <normcore/normcore.hpp>
#include <normcore/reference/reference.hpp>

float other_unit(const Eigen::Tensor<float, 2, Eigen::RowMajor>& x);

int main() {
  Eigen::Tensor<float, 2, Eigen::RowMajor> x(3, 40);
  x.setRandom();
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({40}));
  Eigen::Tensor<float, 2, Eigen::RowMajor> y = ln(x);
  // Both units compute the same thing through the same inline code.
  return y(2, 39) == other_unit(x) ? 0 : 1;
}
