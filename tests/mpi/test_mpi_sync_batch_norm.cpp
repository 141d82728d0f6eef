// normcore::MpiBatchNormReducer under mpirun: R ranks holding shares of one
// batch (equal, unequal, one of them empty) give what one process gives on
// the whole batch: output, dx, running statistics; dweight and dbias are
// per rank and add up to the single-process ones. Float and double, channels
// in dim 1 (N, C, S) and channels last (N, S, C). Plus the reducer alone:
// states travel bit for bit, are merged in rank order, identically on every
// rank, on a split communicator too.
//
//   mpirun -np R normcore_mpi_tests [R]   (R given: fail unless run on R ranks)
//
// Every rank computes the whole-batch reference itself (the data come from
// fixed seeds), so only the reducer's traffic crosses ranks. Rank 0 prints
// "<n> passed, <m> failed" summed over all ranks; the exit code is non-zero
// on any failure.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <normcore/batch_norm.hpp>
#include <normcore/mpi.hpp>

namespace {

using normcore::BatchNorm;
using normcore::BatchNormOptions;
using normcore::Index;
using normcore::Welford;

int g_rank = 0;
int g_size = 1;

// A hand-rolled check tally (GoogleTest and mpirun do not mix well).
struct Tally {
  long passed = 0;
  long failed = 0;
  double worst = 0;  // largest |error| / tolerance of the passing checks
  int printed = 0;

  void fail(const std::string& what) {
    ++failed;
    if (printed++ < 20) std::printf("[rank %d] FAILED: %s\n", g_rank, what.c_str());
  }
  void truth(bool ok, const std::string& what) {
    if (ok) ++passed;
    else fail(what);
  }
  void near(double got, double want, double tol, const std::string& what) {
    const double err = std::fabs(got - want);
    if (err <= tol) {  // false for NaN
      ++passed;
      if (tol > 0) worst = std::max(worst, err / tol);
      return;
    }
    char buf[256];
    std::snprintf(buf, sizeof buf, ": got %.17g, want %.17g, |error| %.3g > tolerance %.3g", got, want, err, tol);
    fail(what + buf);
  }
  void same_bits(double got, double want, const std::string& what) {
    if (std::memcmp(&got, &want, sizeof got) == 0) {
      ++passed;
      return;
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, ": got %a, want %a (bits differ)", got, want);
    fail(what + buf);
  }
};
Tally g;

template <typename T>
constexpr double eps() {
  return static_cast<double>(std::numeric_limits<T>::epsilon());
}

// Tolerances, as in tests/test_util.hpp: a per-element output of a
// normalization over `count` values is off by a few roundings plus the
// statistics' error, which grows like log2(count); a sum over `count`
// terms by up to eps x magnitude x count. Both are bounded by
// eps x magnitude x count.
template <typename T>
double tol_elem(double magnitude, double count) {
  return eps<T>() * magnitude * (4.0 + std::log2(1.0 + count));
}
template <typename T>
double tol_sum(double magnitude, double count) {
  return eps<T>() * magnitude * std::max(1.0, count);
}

std::string at(const char* what, const std::string& config, Index i) {
  return config + ": " + what + "[" + std::to_string(static_cast<long long>(i)) + "]";
}

std::vector<double> randn(std::size_t n, std::uint64_t seed, double mean, double stddev) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> d(mean, stddev);
  std::vector<double> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

// ---------------------------------------------------------------------------
// The reducer alone.

// Channel c's state on rank r (count 0 where `empty` says so).
Welford<double> state_of(int r, Index c, bool empty) {
  if (empty) return Welford<double>();
  std::mt19937_64 gen(1000003u * static_cast<unsigned>(r + 1) + static_cast<unsigned>(c));
  std::uniform_real_distribution<double> u(-10.0, 10.0);
  const double count = static_cast<double>(1 + (3 * r + 5 * c) % 7);
  const double mean = u(gen) / 3.0;  // not a short binary fraction
  const double m2 = count > 1 ? std::fabs(u(gen)) * count / 7.0 : 0.0;
  return Welford<double>(count, mean, m2);
}

void check_state(const Welford<double>& got, const Welford<double>& want, const std::string& what) {
  g.same_bits(got.count(), want.count(), what + " count");
  g.same_bits(got.mean(), want.mean(), what + " mean");
  g.same_bits(got.m2(), want.m2(), what + " m2");
}

// Every rank ends with rank 0's bits.
void check_same_on_all_ranks(std::vector<double> v, MPI_Comm comm, const std::string& what) {
  std::vector<double> root(v);
  MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_DOUBLE, 0, comm);
  for (std::size_t i = 0; i < v.size(); ++i) g.same_bits(v[i], root[i], what + " (as on rank 0)");
}

void test_reducer() {
  const Index C = 7;
  normcore::MpiBatchNormReducer reducer;

  // The operation's function: `in` is the left (lower-rank) operand.
  {
    const Welford<double> a = state_of(0, 1, false), b = state_of(1, 2, false);
    double in[3] = {a.count(), a.mean(), a.m2()}, io[3] = {b.count(), b.mean(), b.m2()};
    int len = 1;
    MPI_Datatype dt = MPI_DOUBLE;
    normcore::MpiBatchNormReducer::merge_states(in, io, &len, &dt);
    Welford<double> want = a;
    want.merge(b);
    check_state(Welford<double>(io[0], io[1], io[2]), want, "merge_states(in, inout) = in (+) inout");
  }

  // Exact transmission: channel c has values on rank c % R only; every rank
  // receives that rank's state bit for bit (mean and M2 as they are, no
  // conversion to a variance or invstd and back).
  {
    std::vector<Welford<double>> s(static_cast<std::size_t>(C));
    for (Index c = 0; c < C; ++c) s[static_cast<std::size_t>(c)] = state_of(g_rank, c, c % g_size != g_rank);
    reducer.allreduce_moments(s.data(), C);
    for (Index c = 0; c < C; ++c)
      check_state(s[static_cast<std::size_t>(c)], state_of(static_cast<int>(c % g_size), c, false),
                  at("one non-empty rank: state", "reducer", c));
  }

  // All ranks non-empty, plus one channel empty everywhere: the Chan merge in
  // rank order (bit for bit for 2 ranks, where MPI applies the operation
  // once; for more, MPI may group the merges differently), the same bits on
  // every rank.
  for (int empty_rank = -1; empty_rank < std::min(g_size, 2); ++empty_rank) {
    std::vector<Welford<double>> s(static_cast<std::size_t>(C + 1));
    for (Index c = 0; c < C; ++c) s[static_cast<std::size_t>(c)] = state_of(g_rank, c, g_rank == empty_rank);
    reducer.allreduce_moments(s.data(), C + 1);
    const std::string cfg = "rank-order merge (empty rank " + std::to_string(empty_rank) + ")";
    std::vector<double> flat;
    for (Index c = 0; c < C; ++c) {
      Welford<double> want;
      for (int r = 0; r < g_size; ++r) want.merge(state_of(r, c, r == empty_rank));
      const auto& got = s[static_cast<std::size_t>(c)];
      if (g_size <= 2) {
        check_state(got, want, at("state", cfg, c));
      } else {
        g.same_bits(got.count(), want.count(), at("count", cfg, c));
        g.near(got.mean(), want.mean(), tol_sum<double>(10.0, g_size), at("mean", cfg, c));
        g.near(got.m2(), want.m2(), tol_sum<double>(want.m2(), 2.0 * g_size), at("m2", cfg, c));
      }
      flat.insert(flat.end(), {got.count(), got.mean(), got.m2()});
    }
    check_state(s[static_cast<std::size_t>(C)], Welford<double>(), cfg + ": channel empty on every rank");
    check_same_on_all_ranks(flat, MPI_COMM_WORLD, cfg);
  }

  // Sums (MPI_SUM): exact for small integers.
  {
    std::vector<double> v(5);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>((g_rank + 1) * (static_cast<int>(i) + 1));
    reducer.allreduce_sums(v.data(), static_cast<Index>(v.size()));
    const double ranks = static_cast<double>(g_size) * (g_size + 1) / 2;
    for (std::size_t i = 0; i < v.size(); ++i)
      g.same_bits(v[i], ranks * static_cast<double>(i + 1), at("sum", "allreduce_sums", static_cast<Index>(i)));
  }

  // release() frees the type and operation; the next call creates them again.
  {
    reducer.release();
    reducer.release();
    Welford<double> s = state_of(g_rank, 0, false);
    reducer.allreduce_moments(&s, 1);
    Welford<double> want;
    for (int r = 0; r < g_size; ++r) want.merge(state_of(r, 0, false));
    g.near(s.mean(), want.mean(), tol_sum<double>(10.0, g_size), "after release(): mean");
    g.same_bits(s.count(), want.count(), "after release(): count");
  }

  // A communicator of its own: even and odd ranks reduce separately.
  if (g_size >= 2) {
    MPI_Comm half;
    MPI_Comm_split(MPI_COMM_WORLD, g_rank % 2, g_rank, &half);
    {
      normcore::MpiBatchNormReducer split(half);
      std::vector<Welford<double>> s(static_cast<std::size_t>(C));
      for (Index c = 0; c < C; ++c) s[static_cast<std::size_t>(c)] = state_of(g_rank, c, false);
      split.allreduce_moments(s.data(), C);
      for (Index c = 0; c < C; ++c) {
        Welford<double> want;
        for (int r = g_rank % 2; r < g_size; r += 2) want.merge(state_of(r, c, false));
        const auto& got = s[static_cast<std::size_t>(c)];
        g.same_bits(got.count(), want.count(), at("split communicator: count", "reducer", c));
        g.near(got.mean(), want.mean(), tol_sum<double>(10.0, g_size), at("split communicator: mean", "reducer", c));
        g.near(got.m2(), want.m2(), tol_sum<double>(want.m2(), 2.0 * g_size), at("split communicator: m2", "reducer", c));
      }
    }  // the reducer is freed before its communicator
    MPI_Comm_free(&half);
  }
}

// ---------------------------------------------------------------------------
// BatchNorm with the reducer against one process on the whole batch.

enum class Layout { kChannelsFirst, kChannelsLast };

template <typename T>
using Tensor3 = Eigen::Tensor<T, 3, Eigen::RowMajor>;
template <typename T>
using Map3 = Eigen::TensorMap<Eigen::Tensor<T, 3, Eigen::RowMajor>>;

template <typename T>
void check_shares(Layout layout, const std::vector<Index>& shares) {
  const Index C = 5, S = layout == Layout::kChannelsFirst ? 6 : 3;
  const Index block = C * S;  // values per example
  Index N = 0, n0 = 0;
  for (int r = 0; r < g_size; ++r) {
    if (r < g_rank) n0 += shares[static_cast<std::size_t>(r)];
    N += shares[static_cast<std::size_t>(r)];
  }
  const Index n = shares[static_cast<std::size_t>(g_rank)];
  const double count = static_cast<double>(N * S);  // values per channel, whole batch
  const auto d1 = layout == Layout::kChannelsFirst ? C : S, d2 = layout == Layout::kChannelsFirst ? S : C;

  std::string cfg = std::string(sizeof(T) == 4 ? "float" : "double") +
                    (layout == Layout::kChannelsFirst ? " (N, C, S)" : " (N, S, C)") + " shares {";
  for (std::size_t r = 0; r < shares.size(); ++r) cfg += (r ? "," : "") + std::to_string(static_cast<long long>(shares[r]));
  cfg += "}";

  BatchNormOptions opts(C);
  opts.channel_axis(layout == Layout::kChannelsFirst ? 1 : -1);
  if (layout == Layout::kChannelsLast) opts.momentum(std::nullopt);  // cumulative average
  BatchNorm<T> whole(opts), bn(opts);
  for (Index c = 0; c < C; ++c) {  // the same parameters everywhere
    whole.weight()(c) = bn.weight()(c) = static_cast<T>(0.75 + 0.125 * static_cast<double>(c));
    whole.bias()(c) = bn.bias()(c) = static_cast<T>(0.25 * static_cast<double>(c) - 0.5);
  }
  normcore::MpiBatchNormReducer reducer;
  bn.set_reducer(&reducer);

  const double mag = 8.0;  // |y|, |dx|: standardized values of a few sigma
  for (int step = 0; step < 3; ++step) {
    const bool eval = step == 2;
    if (eval) {
      whole.eval();
      bn.eval();
    }
    std::vector<T> xv(static_cast<std::size_t>(N * block)), dv(xv.size());
    {
      const auto xs = randn(xv.size(), 11u + static_cast<unsigned>(step), 2.0, 1.5);
      const auto ds = randn(xv.size(), 23u + static_cast<unsigned>(step), 0.0, 1.0);
      for (std::size_t i = 0; i < xv.size(); ++i) {
        xv[i] = static_cast<T>(xs[i]);
        dv[i] = static_cast<T>(ds[i]);
      }
    }
    // One process on the whole batch.
    Map3<T> x(xv.data(), N, d1, d2), dy(dv.data(), N, d1, d2);
    Tensor3<T> y(N, d1, d2);
    normcore::NormStats<T> st;
    whole.forward(x, y, st);
    const auto gw = whole.backward(x, dy, step == 0 ? &st : nullptr);
    // This rank's share (step 1: backward without saved statistics, which
    // merges the moments again).
    Map3<T> xr(xv.data() + n0 * block, n, d1, d2), dyr(dv.data() + n0 * block, n, d1, d2);
    Tensor3<T> yr(n, d1, d2);
    normcore::NormStats<T> sr;
    bn.forward(xr, yr, sr);
    const auto gr = bn.backward(xr, dyr, step == 0 ? &sr : nullptr);

    const std::string c = cfg + (eval ? ", eval" : ", step " + std::to_string(step));
    for (Index i = 0; i < n * block; ++i) {
      g.near(static_cast<double>(yr.data()[i]), static_cast<double>(y.data()[n0 * block + i]), tol_elem<T>(mag, count),
             at("y", c, n0 * block + i));
      g.near(static_cast<double>(gr.dx.data()[i]), static_cast<double>(gw.dx.data()[n0 * block + i]),
             tol_elem<T>(mag, count), at("dx", c, n0 * block + i));
    }
    // Parameter gradients are per rank: their sum over ranks is the whole's.
    std::vector<double> dwb(static_cast<std::size_t>(2 * C));
    for (Index k = 0; k < C; ++k) {
      dwb[static_cast<std::size_t>(k)] = static_cast<double>(gr.dweight(k));
      dwb[static_cast<std::size_t>(C + k)] = static_cast<double>(gr.dbias(k));
    }
    MPI_Allreduce(MPI_IN_PLACE, dwb.data(), static_cast<int>(2 * C), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    for (Index k = 0; k < C; ++k) {
      g.near(dwb[static_cast<std::size_t>(k)], static_cast<double>(gw.dweight(k)), tol_sum<T>(mag, count),
             at("sum over ranks of dweight", c, k));
      g.near(dwb[static_cast<std::size_t>(C + k)], static_cast<double>(gw.dbias(k)), tol_sum<T>(mag, count),
             at("sum over ranks of dbias", c, k));
    }
    // Running statistics: as the whole's; running_var has the same bits on
    // every rank (it depends only on the merged M2 and count).
    std::vector<double> rv(static_cast<std::size_t>(C));
    for (Index k = 0; k < C; ++k) {
      g.near(static_cast<double>(bn.running_mean()(k)), static_cast<double>(whole.running_mean()(k)),
             tol_elem<T>(mag, count), at("running_mean", c, k));
      g.near(static_cast<double>(bn.running_var()(k)), static_cast<double>(whole.running_var()(k)),
             tol_elem<T>(mag, count), at("running_var", c, k));
      rv[static_cast<std::size_t>(k)] = static_cast<double>(bn.running_var()(k));
    }
    check_same_on_all_ranks(rv, MPI_COMM_WORLD, c + ": running_var");
    g.truth(bn.num_batches_tracked() == whole.num_batches_tracked(), c + ": num_batches_tracked");
  }
  bn.set_reducer(nullptr);
}

template <typename T>
void test_batch_norm() {
  // Shares of one batch for this many ranks: equal, unequal, one rank empty
  // (the first, then the last).
  std::vector<std::vector<Index>> sets;
  std::vector<Index> equal(static_cast<std::size_t>(g_size), 4), unequal(static_cast<std::size_t>(g_size));
  for (int r = 0; r < g_size; ++r) unequal[static_cast<std::size_t>(r)] = 2 + (3 * r + 2) % 5;
  sets.push_back(equal);
  sets.push_back(unequal);
  if (g_size > 1) {
    auto first = unequal, last = unequal;
    first.front() = 0;
    last.back() = 0;
    sets.push_back(first);
    sets.push_back(last);
  }
  for (const auto& s : sets) {
    check_shares<T>(Layout::kChannelsFirst, s);
    check_shares<T>(Layout::kChannelsLast, s);
  }
}

int run(int argc, char** argv) {
  if (argc > 1) {
    const int want = std::atoi(argv[1]);
    g.truth(want == g_size, "expected to run on " + std::string(argv[1]) + " ranks, got " + std::to_string(g_size));
  }
  test_reducer();
  test_batch_norm<double>();
  test_batch_norm<float>();

  long local[2] = {g.passed, g.failed}, total[2] = {0, 0};
  double worst = 0;
  MPI_Allreduce(local, total, 2, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  MPI_Reduce(&g.worst, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  if (g_rank == 0) {
    std::printf("normcore MPI tests on %d rank%s: %ld passed, %ld failed (largest error: %.3g of its tolerance)\n",
                g_size, g_size == 1 ? "" : "s", total[0], total[1], worst);
    std::fflush(stdout);
  }
  return total[1] == 0 && total[0] > 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  int rc = 1;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    // The other ranks would wait in a collective forever: take them down.
    std::printf("[rank %d] FAILED: exception: %s\n", g_rank, e.what());
    std::fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();
  return rc;
}
