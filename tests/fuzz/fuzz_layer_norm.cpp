// libFuzzer target: normcore::LayerNorm against normcore::reference.
#include "fuzz_common.hpp"

namespace {

using namespace ncfuzz;

double pick_eps(FuzzedDataProvider& p) {
  static const double v[] = {1e-5, 1e-5, 1e-6, 0.0, 1e-12, 1e-3, 1.0, 1e-30};
  return v[p.ConsumeIntegralInRange<std::size_t>(0, std::size(v) - 1)];
}

template <typename T, int Layout>
void fuzz(FuzzedDataProvider& p) {
  using Map = Eigen::TensorMap<Eigen::Tensor<T, 3, Layout>>;
  constexpr bool rm = Layout == Eigen::RowMajor;
  const int k = p.ConsumeIntegralInRange<int>(1, 3);  // normalized trailing dims
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

  const double eps = pick_eps(p);
  const bool affine = p.ConsumeIntegralInRange<int>(0, 3) != 0;
  const bool has_bias = p.ConsumeIntegralInRange<int>(0, 3) != 0;
  const int scenario = p.ConsumeIntegralInRange<int>(0, 19);  // >= 13: an invalid call
  auto opts = [&] { return normcore::LayerNormOptions(shape).eps(eps).elementwise_affine(affine).bias(has_bias); };

  // Invalid options: every one must throw at construction.
  if (scenario == 13) {
    static const double bad_eps[] = {-1e-5, -1e-300, std::numeric_limits<double>::quiet_NaN(),
                                     std::numeric_limits<double>::infinity()};
    const double e = bad_eps[p.ConsumeIntegralInRange<std::size_t>(0, 3)];
    expect_invalid("LayerNorm: bad eps", [&] { normcore::LayerNorm<T> ln(opts().eps(e)); });
    expect_invalid("LayerNorm: empty normalized_shape", [&] { normcore::LayerNorm<T> ln(opts().normalized_shape({})); });
    std::vector<Index> bad = shape;
    bad[p.ConsumeIntegralInRange<std::size_t>(0, bad.size() - 1)] = -p.ConsumeIntegralInRange<Index>(0, 3);
    expect_invalid("LayerNorm: non-positive normalized_shape", [&] { normcore::LayerNorm<T> ln(opts().normalized_shape(bad)); });
    return;
  }
  if (d[0] == 0 && k == 3) {  // a zero dim in normalized_shape
    expect_invalid("LayerNorm: zero in normalized_shape", [&] { normcore::LayerNorm<T> ln(opts()); });
    return;
  }
  normcore::LayerNorm<T> ln(opts());
  if (affine) {
    fill_params(p, ln.weight().data(), n, 1.0);
    if (has_bias) fill_params(p, ln.bias().data(), n, 0.0);
  }
  const T* gamma = affine ? ln.weight().data() : nullptr;
  const T* beta = affine && has_bias ? ln.bias().data() : nullptr;

  // Data: per-row generators; dy mostly moderate.
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
  const Eigen::TensorMap<const Eigen::Tensor<T, 3, Layout>> cx(xs.data(), d[0], d[1], d[2]);

  // Invalid calls on a valid layer.
  if (scenario >= 14) {
    Eigen::Tensor<T, 3, Layout> other(d[0] + 1, d[1], d[2] + 1);
    other.setZero();
    normcore::NormStats<T> st;
    Eigen::Tensor<T, 1> dw, db;
    switch (scenario) {
      case 14:
        expect_invalid("LayerNorm: input trailing dims differ", [&] { ln.forward(other, y); });
        expect_invalid("LayerNorm: backward input trailing dims differ", [&] { ln.backward(other, other); });
        break;
      case 15:
        expect_invalid("LayerNorm: output shape differs", [&] { ln.forward(cx, other); });
        break;
      case 16:
        expect_invalid("LayerNorm: dy shape differs", [&] { ln.backward(cx, other); });
        expect_invalid("LayerNorm: dx shape differs", [&] { ln.backward(cx, dy, &other, nullptr, nullptr); });
        break;
      case 17:
        st.mean.resize(rows + 1);
        st.rstd.resize(rows);
        expect_invalid("LayerNorm: saved mean of the wrong size", [&] { ln.backward(cx, dy, &st); });
        st.mean.resize(rows);
        st.rstd.resize(rows + 2);
        expect_invalid("LayerNorm: saved rstd of the wrong size", [&] { ln.backward(cx, dy, &st); });
        break;
      default:
        if (!affine) expect_invalid("LayerNorm: dweight without weight", [&] { ln.backward(cx, dy, &dx, &dw, nullptr); });
        if (!affine || !has_bias) expect_invalid("LayerNorm: dbias without bias", [&] { ln.backward(cx, dy, &dx, nullptr, &db); });
        break;
    }
    xs.check("x");
    ys.check("y");
    dxs.check("dx");
    return;
  }

  // Forward, three ways: into a map with and without saved statistics, and allocating.
  normcore::NormStats<T> saved;
  ln.forward(cx, y, saved);
  xs.check("x");
  ys.check("y");
  const Eigen::Tensor<T, 3, Layout> y2 = ln(x);
  if (!bit_equal(y2.data(), ys.data(), total)) report("allocating forward differs from forward into a map", "");
  const std::vector<T> yl = to_logical(rm, d, ys.data());

  const std::string note = shape_note("LayerNorm", std::is_same<T, float>::value, rm, d,
                                      "k=" + std::to_string(k) + " eps=" + std::to_string(eps));
  normcore::reference::RowStats rs;
  const auto yref = normcore::reference::layer_norm_forward(xl.data(), rows, n, gamma, beta, eps, &rs);
  const double G = gamma ? abs_max(gamma, n) : 1.0, B = beta ? abs_max(beta, n) : 0.0;
  // A row is compared when its values are finite, its squares cannot
  // overflow or underflow T's accumulators, and rstd is finite.
  const double big = std::is_same<T, float>::value ? 0x1p50 : 0x1p400;
  const double small = std::is_same<T, float>::value ? 0x1p-90 : 0x1p-900;
  std::vector<char> comparable(static_cast<std::size_t>(rows));
  std::vector<double> quant(static_cast<std::size_t>(rows)), xhmax(static_cast<std::size_t>(rows));
  bool all_rows = true;
  for (Index r = 0; r < rows; ++r) {
    const std::size_t rr = static_cast<std::size_t>(r);
    const T* xr = xl.data() + r * n;
    const double var = 1.0 / (rs.rstd[rr] * rs.rstd[rr]) - eps;
    const bool ok = all_finite(xr, n) && abs_max(xr, n) <= big && var + eps >= small &&
                    std::isfinite(rs.rstd[rr]) && rs.rstd[rr] * abs_max(xr, n) < 1e30;
    comparable[rr] = ok;
    all_rows = all_rows && ok && all_finite(dyl.data() + r * n, n);
    if (!ok) continue;
    quant[rr] = std::fabs(rs.mean[rr]) * rs.rstd[rr];
    double xh = 0;
    for (Index j = 0; j < n; ++j) xh = std::max(xh, std::fabs((static_cast<double>(xr[j]) - rs.mean[rr]) * rs.rstd[rr]));
    xhmax[rr] = xh;
    const double tol = 8 * ueps<T>() * ((xh + quant[rr] + 1) * G + B) * growth(static_cast<double>(n));
    for (Index j = 0; j < n; ++j) {
      const std::size_t i = static_cast<std::size_t>(r * n + j);
      if (!close(static_cast<double>(yl[i]), yref[i], tol))
        report("LayerNorm forward vs reference", note + "\n  " + describe("y", r * n + j, yl[i], yref[i], tol));
    }
    if (saved.mean.dimension(0) != rows || saved.rstd.dimension(0) != rows) report("LayerNorm saved stats size", note);
    if (!close(saved.mean(r), rs.mean[rr], 8 * ueps<T>() * (std::fabs(rs.mean[rr]) + 1.0 / rs.rstd[rr]) * growth(double(n))))
      report("LayerNorm saved mean", note + "\n  " + describe("mean", r, saved.mean(r), rs.mean[rr], 0));
  }
  // Documented: a constant row gives exactly beta (eps > 0).
  for (Index r = 0; r < rows && eps > 0; ++r) {
    if (gens[static_cast<std::size_t>(r)].mode != Mode::kConstant || !std::isfinite(xl[static_cast<std::size_t>(r * n)])) continue;
    for (Index j = 0; j < n; ++j) {
      const double want = beta ? static_cast<double>(beta[j]) : 0.0;
      if (static_cast<double>(yl[static_cast<std::size_t>(r * n + j)]) != want)
        report("LayerNorm constant row is not exactly beta", note + "\n  " + describe("y", r * n + j, yl[static_cast<std::size_t>(r * n + j)], want, 0));
    }
  }

  // Backward: every gradient, with saved statistics and recomputing them.
  Eigen::Tensor<T, 1> dw, db, dw2, db2;
  Eigen::Tensor<T, 1>* pdw = affine ? &dw : nullptr;
  Eigen::Tensor<T, 1>* pdb = affine && has_bias ? &db : nullptr;
  ln.backward(cx, dy, &dx, pdw, pdb, &saved);
  xs.check("x");
  dxs.check("dx");
  Eigen::Tensor<T, 3, Layout> dx2(d[0], d[1], d[2]);
  ln.backward(cx, dy, &dx2, affine ? &dw2 : nullptr, pdb ? &db2 : nullptr, nullptr);
  if (all_rows) {  // only meaningful (and NaN-payload free) for finite data
    if (!bit_equal(dx2.data(), dxs.data(), total)) report("LayerNorm backward: saved vs recomputed statistics differ (dx)", note);
    if (pdw && !bit_equal(dw.data(), dw2.data(), n)) report("LayerNorm backward: saved vs recomputed statistics differ (dweight)", note);
  }
  const auto gref = normcore::reference::layer_norm_backward(xl.data(), dyl.data(), rows, n, gamma, eps);
  const std::vector<T> dxl = to_logical(rm, d, dxs.data());
  for (Index r = 0; r < rows; ++r) {
    const std::size_t rr = static_cast<std::size_t>(r);
    if (!comparable[rr] || !all_finite(dyl.data() + r * n, n)) continue;
    double gd = 0;
    for (Index j = 0; j < n; ++j)
      gd = std::max(gd, std::fabs(static_cast<double>(dyl[static_cast<std::size_t>(r * n + j)]) * (gamma ? static_cast<double>(gamma[j]) : 1.0)));
    const double mag = rs.rstd[rr] * gd * (2 + xhmax[rr] * xhmax[rr]);
    const double tol = 16 * ueps<T>() * mag * (1 + quant[rr]) * growth(static_cast<double>(n));
    for (Index j = 0; j < n; ++j) {
      const std::size_t i = static_cast<std::size_t>(r * n + j);
      if (!close(static_cast<double>(dxl[i]), gref.dx[i], tol))
        report("LayerNorm backward dx vs reference", note + "\n  " + describe("dx", r * n + j, dxl[i], gref.dx[i], tol));
    }
  }
  if (all_rows && rows > 0) {
    for (Index j = 0; j < n; ++j) {
      double mw = 0, mb = 0;
      for (Index r = 0; r < rows; ++r) {
        const std::size_t rr = static_cast<std::size_t>(r);
        const double g = std::fabs(static_cast<double>(dyl[static_cast<std::size_t>(r * n + j)]));
        mw += g * (xhmax[rr] + 1) * (1 + quant[rr]);
        mb += g;
      }
      const double grow = growth(static_cast<double>(rows)) + static_cast<double>(std::min<Index>(rows, 64));
      if (pdw && !close(static_cast<double>(dw(j)), gref.dweight[static_cast<std::size_t>(j)], 8 * ueps<T>() * mw * grow))
        report("LayerNorm backward dweight vs reference", note + "\n  " + describe("dweight", j, dw(j), gref.dweight[static_cast<std::size_t>(j)], 8 * ueps<T>() * mw * grow));
      if (pdb && !close(static_cast<double>(db(j)), gref.dbias[static_cast<std::size_t>(j)], 4 * ueps<T>() * mb * grow))
        report("LayerNorm backward dbias vs reference", note + "\n  " + describe("dbias", j, db(j), gref.dbias[static_cast<std::size_t>(j)], 4 * ueps<T>() * mb * grow));
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
