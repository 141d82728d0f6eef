// libFuzzer target: normcore::RMSNorm against normcore::reference (long
// double). RMSNorm promises the right answer for every finite row, however
// huge or tiny, so every finite row is compared.
#include "fuzz_common.hpp"

namespace {

using namespace ncfuzz;

template <typename T, int Layout>
void fuzz(FuzzedDataProvider& p) {
  using Map = Eigen::TensorMap<Eigen::Tensor<T, 3, Layout>>;
  using lim = std::numeric_limits<T>;
  constexpr bool rm = Layout == Eigen::RowMajor;
  const int k = p.ConsumeIntegralInRange<int>(1, 3);
  Dims3 d;
  d[2] = pick_length(p, 4097);
  d[1] = p.ConsumeIntegralInRange<Index>(1, 9);
  d[0] = p.ConsumeIntegralInRange<Index>(0, 9);
  while (d[0] * d[1] * d[2] > kMaxElements) d[2] = (d[2] + 1) / 2;
  const std::vector<Index> shape(d.begin() + (3 - k), d.end());
  Index rows = 1, n = 1;
  for (int i = 0; i < 3 - k; ++i) rows *= d[static_cast<std::size_t>(i)];
  for (Index s : shape) n *= s;
  const Index total = d[0] * d[1] * d[2];

  static const double eps_choices[] = {-1.0 /* unset */, 1e-6, 1e-5, 0.0, 1e-12, 1e-30, 1.0};
  const double eps_opt = eps_choices[p.ConsumeIntegralInRange<std::size_t>(0, std::size(eps_choices) - 1)];
  const bool affine = p.ConsumeIntegralInRange<int>(0, 3) != 0;
  const int scenario = p.ConsumeIntegralInRange<int>(0, 19);
  auto opts = [&] {
    normcore::RMSNormOptions o(shape);
    o.elementwise_affine(affine);
    if (eps_opt >= 0) o.eps(eps_opt);
    return o;
  };
  if (scenario == 13) {
    static const double bad_eps[] = {-1e-6, -1e-300, std::numeric_limits<double>::quiet_NaN(),
                                     -std::numeric_limits<double>::infinity()};
    const double e = bad_eps[p.ConsumeIntegralInRange<std::size_t>(0, 3)];
    expect_invalid("RMSNorm: bad eps", [&] { normcore::RMSNorm<T> r(opts().eps(e)); });
    expect_invalid("RMSNorm: empty normalized_shape", [&] { normcore::RMSNorm<T> r(opts().normalized_shape({})); });
    return;
  }
  if (d[0] == 0 && k == 3) {
    expect_invalid("RMSNorm: zero in normalized_shape", [&] { normcore::RMSNorm<T> r(opts()); });
    return;
  }
  normcore::RMSNorm<T> rn(opts());
  const double eps = rn.eps();
  if (eps_opt < 0 && eps != ueps<T>()) report("RMSNorm: unset eps is not epsilon(T)", "");
  if (affine) fill_params(p, rn.weight().data(), n, 1.0);
  const T* gamma = affine ? rn.weight().data() : nullptr;

  std::vector<T> xl(static_cast<std::size_t>(total)), dyl(static_cast<std::size_t>(total));
  std::vector<RowGen<T>> gens(static_cast<std::size_t>(rows));
  for (Index r = 0; r < rows; ++r) {
    auto& g = gens[static_cast<std::size_t>(r)];
    g = pick_row_gen<T>(p);
    RowGen<T> gd;
    gd.mode = p.ConsumeIntegralInRange<int>(0, 7) == 0 ? Mode::kWild : Mode::kModerate;
    gd.scale = std::ldexp(1.0, p.ConsumeIntegralInRange<int>(-4, 4));
    for (Index j = 0; j < n; ++j) {
      xl[static_cast<std::size_t>(r * n + j)] = draw(p, g);
      dyl[static_cast<std::size_t>(r * n + j)] = draw(p, gd);
    }
  }
  Slab<T> xs(total, p.ConsumeIntegralInRange<Index>(0, 15)), ys(total, p.ConsumeIntegralInRange<Index>(0, 15)),
      dys(total, p.ConsumeIntegralInRange<Index>(0, 15)), dxs(total, p.ConsumeIntegralInRange<Index>(0, 15));
  to_memory(rm, d, xl, xs.data());
  to_memory(rm, d, dyl, dys.data());
  Map x(xs.data(), d[0], d[1], d[2]), y(ys.data(), d[0], d[1], d[2]), dy(dys.data(), d[0], d[1], d[2]),
      dx(dxs.data(), d[0], d[1], d[2]);

  if (scenario >= 14) {
    Eigen::Tensor<T, 3, Layout> other(d[0] + 1, d[1], d[2] + 1);
    other.setZero();
    normcore::NormStats<T> st;
    Eigen::Tensor<T, 1> dw;
    switch (scenario) {
      case 14:
        expect_invalid("RMSNorm: input trailing dims differ", [&] { rn.forward(other, y); });
        break;
      case 15:
        expect_invalid("RMSNorm: output shape differs", [&] { rn.forward(x, other); });
        break;
      case 16:
        expect_invalid("RMSNorm: dy shape differs", [&] { rn.backward(x, other); });
        expect_invalid("RMSNorm: dx shape differs", [&] { rn.backward(x, dy, &other, nullptr); });
        break;
      case 17:
        st.rstd.resize(rows + 1);
        expect_invalid("RMSNorm: saved rstd of the wrong size", [&] { rn.backward(x, dy, &st); });
        break;
      default:
        if (!affine) expect_invalid("RMSNorm: dweight without weight", [&] { rn.backward(x, dy, &dx, &dw); });
        break;
    }
    xs.check("x");
    ys.check("y");
    dxs.check("dx");
    return;
  }

  normcore::NormStats<T> saved;
  rn.forward(x, y, saved);
  xs.check("x");
  ys.check("y");
  const Eigen::Tensor<T, 3, Layout> y2 = rn(x);
  if (!bit_equal(y2.data(), ys.data(), total)) report("RMSNorm: allocating forward differs from forward into a map", "");
  const std::vector<T> yl = to_logical(rm, d, ys.data());
  const std::string note = shape_note("RMSNorm", std::is_same<T, float>::value, rm, d,
                                      "k=" + std::to_string(k) + " eps=" + std::to_string(eps));
  std::vector<long double> rref;
  const auto yref = normcore::reference::rms_norm_forward(xl.data(), rows, n, gamma, eps, &rref);
  const double G = gamma ? abs_max(gamma, n) : 1.0;
  const double abs_tol = static_cast<double>(lim::min()) * (G + 1);
  bool all_rows = true;
  std::vector<char> finite(static_cast<std::size_t>(rows));
  for (Index r = 0; r < rows; ++r) {
    const std::size_t rr = static_cast<std::size_t>(r);
    finite[rr] = all_finite(xl.data() + r * n, n);
    all_rows = all_rows && finite[rr] && all_finite(dyl.data() + r * n, n);
    if (!finite[rr]) continue;
    double ymax = 0;
    for (Index j = 0; j < n; ++j) ymax = std::max(ymax, std::fabs(yref[static_cast<std::size_t>(r * n + j)]));
    const double tol = 8 * ueps<T>() * ymax * growth(static_cast<double>(n)) + abs_tol;
    for (Index j = 0; j < n; ++j) {
      const std::size_t i = static_cast<std::size_t>(r * n + j);
      if (!close(static_cast<double>(yl[i]), yref[i], tol))
        report("RMSNorm forward vs reference", note + "\n  " + describe("y", r * n + j, yl[i], yref[i], tol));
    }
    // Saved rstd: rstd rounded to T (saturating outside T's range).
    const long double want = rref[rr];
    if (want < static_cast<long double>(lim::max()) && want > static_cast<long double>(lim::min())) {
      const double tr = 8 * ueps<T>() * static_cast<double>(want) * growth(static_cast<double>(n));
      if (!close(static_cast<double>(saved.rstd(r)), static_cast<double>(want), tr))
        report("RMSNorm saved rstd", note + "\n  " + describe("rstd", r, saved.rstd(r), static_cast<double>(want), tr));
    }
    // Documented: an all-zero row gives 0 (eps > 0).
    if (eps > 0 && abs_max(xl.data() + r * n, n) == 0) {
      for (Index j = 0; j < n; ++j)
        if (yl[static_cast<std::size_t>(r * n + j)] != T(0)) report("RMSNorm: all-zero row does not give 0", note);
    }
  }

  Eigen::Tensor<T, 1> dw, dw2;
  rn.backward(x, dy, &dx, affine ? &dw : nullptr, &saved);
  xs.check("x");
  dxs.check("dx");
  Eigen::Tensor<T, 3, Layout> dx2(d[0], d[1], d[2]);
  rn.backward(x, dy, &dx2, affine ? &dw2 : nullptr, nullptr);
  if (all_rows) {
    if (!bit_equal(dx2.data(), dxs.data(), total)) report("RMSNorm backward: saved vs recomputed statistics differ (dx)", note);
    if (affine && !bit_equal(dw.data(), dw2.data(), n)) report("RMSNorm backward: saved vs recomputed statistics differ (dweight)", note);
  }
  const auto gref = normcore::reference::rms_norm_backward(xl.data(), dyl.data(), rows, n, gamma, eps);
  const std::vector<T> dxl = to_logical(rm, d, dxs.data());
  std::vector<double> xhmax(static_cast<std::size_t>(rows));
  for (Index r = 0; r < rows; ++r) {
    const std::size_t rr = static_cast<std::size_t>(r);
    if (!finite[rr]) continue;
    const double rs = static_cast<double>(rref[rr]);
    double xh = 0, gd = 0;
    for (Index j = 0; j < n; ++j) {
      const std::size_t i = static_cast<std::size_t>(r * n + j);
      xh = std::max(xh, static_cast<double>(std::fabs(static_cast<long double>(xl[i]) * rref[rr])));
      gd = std::max(gd, std::fabs(static_cast<double>(dyl[i]) * (gamma ? static_cast<double>(gamma[j]) : 1.0)));
    }
    xhmax[rr] = xh;
    if (!all_finite(dyl.data() + r * n, n)) continue;
    const double tol = 16 * ueps<T>() * rs * gd * (1 + xh * xh) * growth(static_cast<double>(n)) + abs_tol;
    for (Index j = 0; j < n; ++j) {
      const std::size_t i = static_cast<std::size_t>(r * n + j);
      if (!close(static_cast<double>(dxl[i]), gref.dx[i], tol))
        report("RMSNorm backward dx vs reference", note + "\n  " + describe("dx", r * n + j, dxl[i], gref.dx[i], tol));
    }
  }
  if (affine && all_rows && rows > 0) {
    const double grow = growth(static_cast<double>(rows)) + static_cast<double>(std::min<Index>(rows, 64));
    for (Index j = 0; j < n; ++j) {
      double mw = 0;
      for (Index r = 0; r < rows; ++r)
        mw += std::fabs(static_cast<double>(dyl[static_cast<std::size_t>(r * n + j)])) * (xhmax[static_cast<std::size_t>(r)] + 1);
      const double tol = 8 * ueps<T>() * mw * grow + abs_tol * static_cast<double>(rows);
      if (!close(static_cast<double>(dw(j)), gref.dweight[static_cast<std::size_t>(j)], tol))
        report("RMSNorm backward dweight vs reference", note + "\n  " + describe("dweight", j, dw(j), gref.dweight[static_cast<std::size_t>(j)], tol));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider p(data, size);
  switch (p.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: fuzz<float, Eigen::RowMajor>(p); break;
    case 1: fuzz<float, Eigen::ColMajor>(p); break;
    case 2: fuzz<double, Eigen::RowMajor>(p); break;
    default: fuzz<double, Eigen::ColMajor>(p); break;
  }
  return 0;
}
