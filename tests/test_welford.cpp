// The statistics core: scalar Welford/Chan against two-pass double, and the
// SIMD row and lane moments against the same.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "test_util.hpp"

namespace {

using namespace nctest;
using normcore::Welford;

struct TwoPass {
  double mean, m2;
};
template <typename T>
TwoPass two_pass(const T* x, Index n, Index stride = 1) {
  double s = 0;
  for (Index i = 0; i < n; ++i) s += static_cast<double>(x[i * stride]);
  const double m = s / static_cast<double>(n);
  double q = 0;
  for (Index i = 0; i < n; ++i) q += (static_cast<double>(x[i * stride]) - m) * (static_cast<double>(x[i * stride]) - m);
  return {m, q};
}

TEST(Welford, UpdateAndMergeMatchTwoPass) {
  const auto v = randn<double>(1000, 1, 5.0, 2.0);
  Welford<double> all, a, b, c;
  for (std::size_t i = 0; i < v.size(); ++i) {
    all.update(v[i]);
    (i < 300 ? a : i < 301 ? b : c).update(v[i]);
  }
  const TwoPass ref = two_pass(v.data(), 1000);
  EXPECT_NEAR(all.mean(), ref.mean, 1e-14 * 5);
  EXPECT_NEAR(all.m2(), ref.m2, 1e-12 * ref.m2);
  Welford<double> merged = a;
  merged.merge(b);
  merged.merge(c);
  merged.merge(Welford<double>());  // empty side changes nothing
  EXPECT_EQ(merged.count(), 1000);
  EXPECT_NEAR(merged.mean(), ref.mean, 1e-14 * 5);
  EXPECT_NEAR(merged.m2(), ref.m2, 1e-12 * ref.m2);
  EXPECT_NEAR(merged.variance(), ref.m2 / 1000, 1e-12);
  EXPECT_NEAR(merged.sample_variance(), ref.m2 / 999, 1e-12);
  Welford<double> empty;
  empty.merge(a);
  EXPECT_EQ(empty.mean(), a.mean());
  EXPECT_TRUE(std::isnan(Welford<double>().variance()));
  EXPECT_TRUE(std::isnan(Welford<double>::of(v.data(), 1).sample_variance()));
  const auto of = Welford<double>::of(v.data(), 1000);
  EXPECT_NEAR(of.m2(), ref.m2, 1e-12 * ref.m2);
}

template <typename T>
class MomentsTest : public ::testing::Test {};
using MomentTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MomentsTest, MomentTypes, );

TYPED_TEST(MomentsTest, RowMomentsAnyLengthAnyAlignment) {
  using T = TypeParam;
  for (Index n : awkward_lengths()) {
    for (Index misalign : {Index(0), Index(1), Index(3)}) {
      for (double offset : {0.0, 100.0, 1e4}) {
        auto v = randn<T>(static_cast<std::size_t>(n + misalign), unsigned(n), offset, 1.0);
        const T* x = v.data() + misalign;
        const auto w = normcore::row_moments(x, n);
        const TwoPass ref = two_pass(x, n);
        SCOPED_TRACE(::testing::Message() << "n=" << n << " misalign=" << misalign << " offset=" << offset);
        EXPECT_EQ(w.count(), double(n));
        // Our error plus the double reference's own (recursive sum over n terms).
        EXPECT_NEAR(w.mean(), ref.mean, tol_elem<T>(std::fabs(offset) + 1.0, double(n)) + tol<double>(std::fabs(offset) + 1.0, double(n)));
        EXPECT_NEAR(w.m2(), ref.m2, tol_elem<T>(ref.m2 + 1e-30, double(n)) + tol<double>(ref.m2, double(n)));
      }
    }
  }
}

// rows_moments: short rows go through the grouped kernel, long ones through
// row_moments. Each row against two-pass double, and bit for bit the same
// alone (at an unaligned address) as inside a batch of any size.
TYPED_TEST(MomentsTest, RowsMomentsMatchTwoPassAndIgnoreNeighbours) {
  using T = TypeParam;
  for (Index n : awkward_lengths()) {
    for (double offset : {0.0, 1e4}) {
      const Index rows = 11;
      const auto v = randn<T>(static_cast<std::size_t>(rows * n), unsigned(n + 5), offset, 1.0);
      std::vector<Welford<double>> all(static_cast<std::size_t>(rows));
      normcore::rows_moments(v.data(), n, n, rows, all.data());
      for (Index r = 0; r < rows; ++r) {
        const T* x = v.data() + r * n;
        SCOPED_TRACE(::testing::Message() << "n=" << n << " offset=" << offset << " row=" << r);
        const auto& w = all[static_cast<std::size_t>(r)];
        const TwoPass ref = two_pass(x, n);
        EXPECT_EQ(w.count(), double(n));
        EXPECT_NEAR(double(x[0]) + w.mean(), ref.mean,
                    tol_elem<T>(std::fabs(offset) + 1.0, double(n)) + tol<double>(std::fabs(offset) + 1.0, double(n)));
        EXPECT_NEAR(w.m2(), ref.m2, tol_elem<T>(ref.m2 + 1e-30, double(n)) + tol<double>(ref.m2, double(n)));
        // Alone, one element past an aligned address; and in a batch of 3
        // starting at this row (other neighbours, other group position).
        std::vector<T> one(static_cast<std::size_t>(n + 1));
        std::copy(x, x + n, one.begin() + 1);
        Welford<double> w1;
        normcore::rows_moments(one.data() + 1, n, n, 1, &w1);
        Welford<double> w3[3];
        const Index count3 = std::min<Index>(3, rows - r);
        normcore::rows_moments(x, n, n, count3, w3);
        for (const Welford<double>* o : {&w1, &w3[0]}) {
          EXPECT_EQ(o->m2(), w.m2());
          EXPECT_EQ(o->mean(), w.mean());
        }
      }
    }
  }
}

// detail::inv_sqrt_eps and inv_sqrt_mean_eps (LayerNorm's and RMSNorm's
// rstd, a packet of rows per vector division and sqrt): bit for bit the
// scalar 1 / sqrt(v + eps) and 1 / sqrt(ss / n + eps), which IEEE rounds
// correctly, for every count up to two groups and three more (whole
// packets and a partial one on every packet width), over the whole exponent
// range and at the edges (0, subnormal, the largest double, +inf). Input and
// output are heap buffers of exactly count values (and one guard value
// after the output), so that the sanitizer builds catch a read or a write
// past them.
// detail::sum_lanes: the same bits as Eigen's predux on the build's double
// packets, on lanes of mixed magnitudes and signs, where the order of the
// additions shows in the result.
TEST(SumLanes, SameBitsAsEigenPredux) {
  using PD = normcore::detail::simd<double>::Packet;
  constexpr int LD = normcore::detail::simd<double>::L;
  std::mt19937 gen(11);
  std::uniform_real_distribution<double> mant(-1.0, 1.0);
  std::uniform_int_distribution<int> expo(-30, 30);
  for (int t = 0; t < 2000; ++t) {
    alignas(64) double v[LD];
    for (int i = 0; i < LD; ++i) v[i] = std::ldexp(mant(gen), expo(gen));
    const PD p = Eigen::internal::pload<PD>(v);
    const double a = normcore::detail::sum_lanes(p), b = Eigen::internal::predux(p);
    ASSERT_EQ(std::memcmp(&a, &b, sizeof(double)), 0) << "trial " << t << ": " << a << " vs " << b;
  }
}

TEST(InvSqrtEps, CorrectlyRoundedAsTheScalarExpression) {
  std::mt19937_64 gen(11);
  std::uniform_real_distribution<double> expo(-1000.0, 1000.0);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  const double edges[] = {0.0, 4.9e-324, 1e-310, 2.2250738585072014e-308, 1e-300, 1.0,
                          1.7976931348623157e308, std::numeric_limits<double>::infinity()};
  const double divisors[] = {1.0, 3.0, 50.0, 768.0, 4097.0};
  constexpr Index kMost = 2 * normcore::detail::kInvSqrtGroup + 3;
  int mismatches = 0;
  for (int it = 0; it < 6000; ++it) {
    const Index count = 1 + it % kMost;
    const double eps = it % 3 == 0 ? 0.0 : (it % 3 == 1 ? 1e-5 : 1e-12);
    const double n = divisors[(it / 3) % 5];
    const bool divided = it % 2 == 1;
    std::vector<double> v(static_cast<std::size_t>(count));
    std::vector<double> r(static_cast<std::size_t>(count) + 1, -7.0);  // r[count]: nothing past count is written
    for (Index i = 0; i < count; ++i)
      v[static_cast<std::size_t>(i)] =
          (it + i) % 7 == 0 ? edges[(it + i) % 8] : std::ldexp(mant(gen), static_cast<int>(expo(gen)));
    if (divided) {
      normcore::detail::inv_sqrt_mean_eps(v.data(), n, eps, count, r.data());
    } else {
      normcore::detail::inv_sqrt_eps(v.data(), eps, count, r.data());
    }
    for (std::size_t i = 0; i < static_cast<std::size_t>(count); ++i) {
      const double want = 1.0 / std::sqrt((divided ? v[i] / n : v[i]) + eps);
      if (std::memcmp(&want, &r[i], sizeof want) != 0 && mismatches++ < 5)
        ADD_FAILURE() << "v=" << v[i] << " n=" << (divided ? n : 1.0) << " eps=" << eps << " count=" << count
                      << ": expected " << want << ", got " << r[i];
    }
    EXPECT_EQ(r[static_cast<std::size_t>(count)], -7.0);
  }
  EXPECT_EQ(mismatches, 0);
}

// rows_sum_squares (RMSNorm's statistic): against a double sum, and bit for
// bit the same alone as inside a batch.
TYPED_TEST(MomentsTest, RowsSumSquaresMatchDoubleAndIgnoreNeighbours) {
  using T = TypeParam;
  for (Index n : awkward_lengths()) {
    const Index rows = 11;
    const auto v = randn<T>(static_cast<std::size_t>(rows * n), unsigned(n + 9), 0.5, 2.0);
    std::vector<double> all(static_cast<std::size_t>(rows));
    normcore::rows_sum_squares(v.data(), n, n, rows, all.data());
    for (Index r = 0; r < rows; ++r) {
      const T* x = v.data() + r * n;
      SCOPED_TRACE(::testing::Message() << "n=" << n << " row=" << r);
      double ref = 0;
      for (Index j = 0; j < n; ++j) ref += double(x[j]) * double(x[j]);
      const double got = all[static_cast<std::size_t>(r)];
      EXPECT_NEAR(got, ref, tol_elem<T>(ref, double(n)) + tol<double>(ref, double(n)));
      std::vector<T> one(static_cast<std::size_t>(n + 1));
      std::copy(x, x + n, one.begin() + 1);
      double alone = 0;
      normcore::rows_sum_squares(one.data() + 1, n, n, 1, &alone);
      double three[3];
      normcore::rows_sum_squares(x, n, n, std::min<Index>(3, rows - r), three);
      EXPECT_EQ(alone, got);
      EXPECT_EQ(three[0], got);
    }
  }
}

TYPED_TEST(MomentsTest, LongRowsFlushChunksToDouble) {
  using T = TypeParam;
  const Index n = 200003;  // many chunks of kChunk updates per lane
  const auto v = randn<T>(static_cast<std::size_t>(n), 77, 1e3, 1.0);
  const auto w = normcore::row_moments(v.data(), n);
  const TwoPass ref = two_pass(v.data(), n);
  EXPECT_NEAR(w.mean(), ref.mean, tol_elem<T>(1e3 + 1.0, double(n)) + tol<double>(1e3 + 1.0, double(n)));
  EXPECT_NEAR(w.m2() / double(n), ref.m2 / double(n),
              tol_elem<T>(ref.m2 / double(n), double(n)) + tol<double>(ref.m2 / double(n), double(n)));
}

// Every count of leftover packets (fewer than one per accumulator) after one
// and after two full chunks, with and without a scalar tail. A full chunk
// followed by 1..A-1 leftover packets once read 1/(kChunk+1) past the end of
// the reciprocal table: a wrong mean and variance for rows of, e.g., 16400
// floats with AVX2 or 8200 with SSE.
TYPED_TEST(MomentsTest, EveryLeftoverAfterFullChunks) {
  using T = TypeParam;
  constexpr Index L = normcore::detail::simd<T>::L, A = normcore::detail::simd<T>::A;
  constexpr Index full = A * normcore::detail::kChunk;  // packets in a full chunk
  for (Index chunks : {Index(1), Index(2)}) {
    for (Index left = 0; left <= A; ++left) {
      for (Index tail : {Index(0), Index(1), L - 1}) {
        const Index n = (chunks * full + left) * L + tail;
        const auto v = randn<T>(static_cast<std::size_t>(n), unsigned(n), 2.0, 3.0);
        const auto w = normcore::row_moments(v.data(), n);
        const TwoPass ref = two_pass(v.data(), n);
        SCOPED_TRACE(::testing::Message() << "n=" << n << " chunks=" << chunks << " leftover=" << left);
        EXPECT_EQ(w.count(), double(n));
        EXPECT_NEAR(w.mean(), ref.mean, tol_elem<T>(3.0, double(n)) + tol<double>(3.0, double(n)));
        EXPECT_NEAR(w.m2(), ref.m2, tol_elem<T>(ref.m2, double(n)) + tol<double>(ref.m2, double(n)));
        // In a batch, where long rows go two at a time (detail::kPairRows):
        // each row's bits as alone, in either place of a pair.
        const auto u = randn<T>(static_cast<std::size_t>(2 * n), unsigned(n + 1), -1.0, 2.0);
        std::vector<T> batch(v);
        batch.insert(batch.end(), u.begin(), u.end());
        Welford<double> w3[3];
        normcore::rows_moments(batch.data(), n, n, 3, w3);
        for (Index r = 0; r < 3; ++r) {
          const Welford<double> alone = normcore::row_moments(batch.data() + r * n, n, batch[std::size_t(r * n)]);
          EXPECT_EQ(w3[r].count(), alone.count()) << "row " << r;
          EXPECT_EQ(w3[r].mean(), alone.mean()) << "row " << r;
          EXPECT_EQ(w3[r].m2(), alone.m2()) << "row " << r;
        }
      }
    }
  }
}

TYPED_TEST(MomentsTest, LaneMomentsMatchTwoPassPerColumn) {
  using T = TypeParam;
  for (Index lanes : {Index(1), Index(3), Index(16), Index(21), Index(64), Index(300)}) {
    for (Index count : {Index(1), Index(2), Index(5), Index(600)}) {
      const auto v = randn<T>(static_cast<std::size_t>(lanes * count), unsigned(lanes * 100 + count), 50.0, 3.0);
      std::vector<Welford<double>> out(static_cast<std::size_t>(lanes));
      normcore::lane_moments(v.data(), lanes, count, lanes, v.data(), out.data());
      for (Index c = 0; c < lanes; ++c) {
        const TwoPass ref = two_pass(v.data() + c, count, lanes);
        const auto& w = out[static_cast<std::size_t>(c)];
        SCOPED_TRACE(::testing::Message() << "lanes=" << lanes << " count=" << count << " c=" << c);
        EXPECT_EQ(w.count(), double(count));
        EXPECT_NEAR(double(v[static_cast<std::size_t>(c)]) + w.mean(), ref.mean, tol_elem<T>(50.0, double(count)));
        // Each lane is a sequential recurrence over up to kChunk updates.
        EXPECT_NEAR(w.m2(), ref.m2, tol<T>(ref.m2 + 1e-30, double(std::min<Index>(count, normcore::detail::kChunk))));
      }
    }
  }
}

// lane_chunks keeps the states of whole packets of lanes in registers,
// kRegisterLanePackets packets (a block) at a time: one block down the whole
// chunk, wider rows a tile of rows at a time (kLaneTileBytes), every block
// through the tile before the next; leftover lanes in scalars.
// lane_chunks_in_memory updates every state in memory row after row. Both
// must give the same bits per column: one block or several, with and without
// leftover lanes, chunks whole and partial, tiles whole and partial (302
// rows: a last chunk of 46).
TYPED_TEST(MomentsTest, LaneMomentsSameBitsInRegistersAsInMemory) {
  using T = TypeParam;
  constexpr int L = normcore::detail::simd<T>::L;
  for (int np = 1; np <= 20; ++np) {
    for (Index extra : {Index(0), Index(3)}) {
      const Index lanes = np * L + extra, stride = lanes + 1;
      for (Index count : {Index(1), Index(7), Index(256), Index(302), Index(600)}) {
        const auto v = randn<T>(static_cast<std::size_t>(stride * count), unsigned(np * 1000 + count), 20.0, 2.0);
        std::vector<Welford<double>> reg(static_cast<std::size_t>(lanes)), mem(static_cast<std::size_t>(lanes));
        normcore::lane_moments(v.data(), stride, count, lanes, v.data(), reg.data());
        normcore::detail::lane_chunks_in_memory(v.data(), stride, count, lanes, v.data(),
                                                [&](Index, Index rows, const T* mean, const T* m2) {
                                                  for (Index c = 0; c < lanes; ++c)
                                                    mem[static_cast<std::size_t>(c)].merge(Welford<double>(
                                                        static_cast<double>(rows), static_cast<double>(mean[c]),
                                                        static_cast<double>(m2[c])));
                                                });
        for (Index c = 0; c < lanes; ++c) {
          SCOPED_TRACE(::testing::Message() << "packets=" << np << " extra=" << extra << " count=" << count
                                            << " c=" << c);
          ASSERT_EQ(reg[static_cast<std::size_t>(c)].count(), mem[static_cast<std::size_t>(c)].count());
          ASSERT_EQ(reg[static_cast<std::size_t>(c)].mean(), mem[static_cast<std::size_t>(c)].mean());
          ASSERT_EQ(reg[static_cast<std::size_t>(c)].m2(), mem[static_cast<std::size_t>(c)].m2());
        }
      }
    }
  }
}

// lane_chunks' tiles (rows wider than one block, lying end to end) request
// the next tile into the cache as they go, up to ahead_rows rows past their
// own. Requests only: the same bits per column as lane_chunks_in_memory.
// And the requests (recorded here instead of made) are exactly the lines
// that start in the rows after the first tile, through min(tile,
// ahead_rows) rows past the call's own: every line once or more, none
// outside; none at all without ahead_rows or where the rows do not lie end
// to end. No rows past the chunk, a few or many; whole and partial tiles
// and chunks, with and without leftover lanes, and a tile of one block.
TYPED_TEST(MomentsTest, LaneTileRequestsKeepTheBitsAndCoverTheNextTile) {
  using T = TypeParam;
  constexpr Index L = normcore::detail::simd<T>::L;
  constexpr Index block = normcore::detail::kRegisterLanePackets * L;
  constexpr Index kLine = 64;
  for (Index lanes : {block, block + L, block + L + 3, 3 * block, 4 * block + 5}) {
    const Index tile = std::max<Index>(4, normcore::detail::kLaneTileBytes / (lanes * Index(sizeof(T))));
    for (Index count : {Index(7), Index(256), Index(302)}) {
      for (Index ahead : {Index(-1), Index(0), Index(5), Index(300)}) {
        for (Index stride : {lanes, lanes + 1}) {
          const Index rows = count + std::max<Index>(0, ahead);
          const auto v = randn<T>(static_cast<std::size_t>(stride * rows), unsigned(lanes * 1000 + count), 20.0, 2.0);
          std::vector<Welford<double>> reg(static_cast<std::size_t>(lanes)), mem(static_cast<std::size_t>(lanes));
          const auto into = [&lanes](std::vector<Welford<double>>& out) {
            return [&out, &lanes](Index, Index n, const T* mean, const T* m2) {
              for (Index c = 0; c < lanes; ++c)
                out[static_cast<std::size_t>(c)].merge(Welford<double>(
                    static_cast<double>(n), static_cast<double>(mean[c]), static_cast<double>(m2[c])));
            };
          };
          std::set<std::uintptr_t> asked;
          const auto record = [&asked](const char* line) { asked.insert(reinterpret_cast<std::uintptr_t>(line)); };
          normcore::detail::lane_chunks(v.data(), stride, count, lanes, v.data(), into(reg), ahead, record);
          normcore::detail::lane_chunks_in_memory(v.data(), stride, count, lanes, v.data(), into(mem));
          SCOPED_TRACE(::testing::Message() << "lanes=" << lanes << " count=" << count << " ahead=" << ahead
                                            << " stride=" << stride);
          for (Index c = 0; c < lanes; ++c) {
            ASSERT_EQ(reg[static_cast<std::size_t>(c)].count(), double(count));
            ASSERT_EQ(reg[static_cast<std::size_t>(c)].mean(), mem[static_cast<std::size_t>(c)].mean()) << c;
            ASSERT_EQ(reg[static_cast<std::size_t>(c)].m2(), mem[static_cast<std::size_t>(c)].m2()) << c;
          }
          std::set<std::uintptr_t> expected;
          if (ahead >= 0 && stride == lanes && lanes / L * L > block) {
            const auto base = reinterpret_cast<std::uintptr_t>(v.data());
            const std::uintptr_t row = static_cast<std::uintptr_t>(lanes) * sizeof(T);
            const std::uintptr_t a0 = base + static_cast<std::uintptr_t>(std::min(tile, count)) * row;
            const std::uintptr_t a1 = base + static_cast<std::uintptr_t>(count + std::min(tile, ahead)) * row;
            for (std::uintptr_t a = (a0 + kLine - 1) / kLine * kLine; a < a1; a += kLine) expected.insert(a);
          }
          EXPECT_TRUE(asked == expected) << asked.size() << " lines requested, " << expected.size() << " expected";
        }
      }
    }
  }
}

// detail::Scratch: a thread's arena is a stack of live objects; a request
// that does not fit while another is alive comes from the heap, and the
// arena grows to the largest total at the next first request; requests above
// kScratchKeepBytes never stay. Values are zeroed when asked, 64-byte aligned
// from the arena.
TEST(Scratch, ArenaStackHeapFallbackAndGrowth) {
  std::thread([] {  // a fresh thread: an empty arena
    using normcore::detail::Scratch;
    auto& arena = normcore::detail::scratch_arena();
    ASSERT_EQ(arena.capacity, 0u);
    const std::size_t a_bytes = (800u + 63) / 64 * 64, b_bytes = (4000u + 63) / 64 * 64;
    {
      Scratch<double> a(100, true);
      for (std::size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a.data()[i], 0.0);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % 64, 0u);
      a.data()[99] = 1.0;
      EXPECT_EQ(arena.top, a_bytes);
      Scratch<float> b(1000, true);  // does not fit beside a: the heap
      EXPECT_EQ(arena.top, a_bytes);
      for (std::size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b.data()[i], 0.0f);
      EXPECT_EQ(a.data()[99], 1.0);
    }
    EXPECT_EQ(arena.top, 0u);
    for (int round = 0; round < 2; ++round) {
      Scratch<double> a(100, false);
      Scratch<float> b(1000, true);  // the arena grew to hold both, and stays
      EXPECT_EQ(arena.top, a_bytes + b_bytes);
      EXPECT_EQ(arena.capacity, a_bytes + b_bytes);
      Scratch<double> huge(normcore::detail::kScratchKeepBytes / sizeof(double) + 1, false);
      EXPECT_EQ(arena.top, a_bytes + b_bytes);  // from the heap, never kept
    }
    EXPECT_EQ(arena.top, 0u);
    EXPECT_EQ(arena.capacity, a_bytes + b_bytes);
  }).join();
}

// The CPU checks behind the path choices, against the kernel's own account
// (/proc/cpuinfo: vendor_id, cpu family and model of the first processor),
// and the settings that override them. Skipped off x86 Linux.
TEST(PathChoices, CpuChecksMatchProcCpuinfoAndSettingsOverrideThem) {
  namespace d = normcore::detail;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  std::ifstream info("/proc/cpuinfo");
  std::string line, vendor;
  long family = -1, model = -1;
  while (std::getline(info, line) && (vendor.empty() || family < 0 || model < 0)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos || colon + 2 > line.size()) continue;
    const std::string value = line.substr(colon + 2);
    if (vendor.empty() && line.rfind("vendor_id", 0) == 0) vendor = value;
    if (family < 0 && line.rfind("cpu family", 0) == 0) family = std::stol(value);
    if (model < 0 && line.rfind("model\t", 0) == 0) model = std::stol(value);
  }
  if (vendor.empty() || family < 0 || model < 0) GTEST_SKIP() << "no vendor_id, cpu family and model in /proc/cpuinfo";
  SCOPED_TRACE(::testing::Message() << vendor << ", family " << family << ", model " << model);
  const bool amd = vendor == "AuthenticAMD";
  EXPECT_EQ(d::intel_cpu(), vendor == "GenuineIntel");
  EXPECT_EQ(d::amd_zen5_cpu(), amd && family >= 0x1A);
  EXPECT_EQ(d::amd_zen3_cpu(), amd && family == 0x19 && (model <= 0x0F || (model >= 0x20 && model <= 0x5F)));
  {
    const IntelTuning cpu(-1);
    EXPECT_EQ(d::path_choices(), d::intel_cpu() ? 1 : d::amd_zen5_cpu() ? 2 : d::amd_zen3_cpu() ? 3 : 0);
    EXPECT_EQ(d::intel_tuned(), d::intel_cpu());
    EXPECT_EQ(d::zen5_tuned(), d::amd_zen5_cpu());
    EXPECT_EQ(d::zen3_tuned(), d::amd_zen3_cpu());
    EXPECT_EQ(d::dx_streams_tuned(), d::intel_cpu() || d::amd_zen5_cpu());
  }
#endif
  for (int v : {0, 1, 2, 3}) {
    const IntelTuning forced(v);
    EXPECT_EQ(d::path_choices(), v);
    EXPECT_EQ(d::intel_tuned(), v == 1);
    EXPECT_EQ(d::zen5_tuned(), v == 2);
    EXPECT_EQ(d::zen3_tuned(), v == 3);
    EXPECT_EQ(d::dx_streams_tuned(), v == 1 || v == 2);
  }
}

}  // namespace
