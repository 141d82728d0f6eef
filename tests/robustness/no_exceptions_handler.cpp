// Built with -fno-exceptions: an invalid argument goes to the handler
// installed with normcore::set_error_handler. The handler here checks that the
// message names the expected and the actual shape, prints it and exits 0;
// reaching the end of main (the handler was not called, or returned) fails.
//
//   no_exceptions_handler layer_norm|rms_norm|batch_norm
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <normcore/normcore.hpp>

#if NORMCORE_HAS_EXCEPTIONS
#error "this test must be compiled with -fno-exceptions"
#endif

namespace {

const char* g_expect[2] = {nullptr, nullptr};

void handler(const char* message) {
  std::printf("handler called: %s\n", message);
  for (const char* want : g_expect) {
    if (!std::strstr(message, want)) {
      std::printf("FAIL: the message does not contain \"%s\"\n", want);
      std::fflush(stdout);
      std::_Exit(2);
    }
  }
  std::fflush(stdout);
  std::_Exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  const char* which = argc > 1 ? argv[1] : "layer_norm";
  normcore::set_error_handler(&handler);
  // A valid call first: without exceptions the library works as usual.
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({8}));
  Eigen::Tensor<float, 2, Eigen::RowMajor> ok(3, 8);
  ok.setConstant(2.0f);
  const Eigen::Tensor<float, 2, Eigen::RowMajor> y = ln(ok);
  if (y(1, 3) != 0.0f) {
    std::printf("FAIL: LayerNorm of a constant row is not 0\n");
    return 1;
  }
  if (std::strcmp(which, "layer_norm") == 0) {
    g_expect[0] = "[8]";
    g_expect[1] = "[2, 5]";
    Eigen::Tensor<float, 2, Eigen::RowMajor> x(2, 5);
    x.setZero();
    const auto bad = ln(x);  // trailing dim 5, normalized_shape [8]
    std::printf("FAIL: no error (got %ld values)\n", static_cast<long>(bad.size()));
  } else if (std::strcmp(which, "rms_norm") == 0) {
    g_expect[0] = "[4, 3]";
    g_expect[1] = "[4, 2]";
    normcore::RMSNorm<double> rn(normcore::RMSNormOptions({3}));
    Eigen::Tensor<double, 2> x(4, 3), dy(4, 2);
    x.setZero();
    dy.setZero();
    const auto g = rn.backward(x, dy);  // dy of the wrong shape
    std::printf("FAIL: no error (got %ld values)\n", static_cast<long>(g.dx.size()));
  } else {
    g_expect[0] = "expected 6 channels in dim 1";
    g_expect[1] = "[2, 4, 5]";
    normcore::BatchNorm<float> bn(normcore::BatchNormOptions(6));
    Eigen::Tensor<float, 3, Eigen::RowMajor> x(2, 4, 5);
    x.setZero();
    const auto bad = bn(x);
    std::printf("FAIL: no error (got %ld values)\n", static_cast<long>(bad.size()));
  }
  return 1;
}
