// Shared helpers of the benchmark suite: names, the thread setting.
#include "bench_common.hpp"

#include <cstdio>

namespace nbench {

namespace {
int g_threads = 1;
}

int threads() { return g_threads; }
void set_threads(int n) { g_threads = n < 1 ? 1 : n; }

std::string Case::op_name() const {
  std::string base;
  switch (op) {
    case Op::LN_fwd: return "LN_fwd";
    case Op::LN_fwd_stats: return "LN_fwd_stats";
    case Op::LN_bwd: return "LN_bwd";
    case Op::RMS_fwd: return "RMS_fwd";
    case Op::RMS_bwd: return "RMS_bwd";
    case Op::BN_train: base = "BN_train"; break;
    case Op::BN_eval: base = "BN_eval"; break;
    case Op::BN_bwd: base = "BN_bwd"; break;
  }
  return base + (layout == Layout::NHWC ? "_nhwc" : "_nchw");
}

std::string Case::shape_name() const {
  std::vector<std::int64_t> d = dims;
  if (is_batch_norm(op) && is_2d_bn()) d.resize(2);
  std::string s;
  for (std::size_t i = 0; i < d.size(); ++i) {
    if (i) s += 'x';
    s += std::to_string(d[i]);
  }
  return s;
}

std::vector<float> to_float(const std::vector<double>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]);
  return f;
}

std::vector<float> copy_of(const float* p, std::size_t n) { return std::vector<float>(p, p + n); }

}  // namespace nbench
