// normcore::MpiBatchNormReducer: SyncBatchNorm over MPI.
//
//   #include <normcore/mpi.hpp>            // needs <mpi.h>; link MPI (MPI::MPI_CXX)
//
//   MPI_Init(&argc, &argv);
//   {
//     normcore::MpiBatchNormReducer reducer;            // MPI_COMM_WORLD
//     normcore::BatchNorm<float> bn(normcore::BatchNormOptions(64));
//     bn.set_reducer(&reducer);
//     // every rank: its own share of the batch (any size, even empty)
//     bn.forward(x_local, y_local, saved);              // batch statistics of all ranks
//     auto g = bn.backward(x_local, dy_local, &saved);  // dx as one process on the whole batch
//     // g.dweight, g.dbias are this rank's part: sum them like any parameter gradient
//   }                                                   // reducer freed here: before MPI_Finalize
//   MPI_Finalize();
//
// What goes over the wire. The forward sends, per channel, the Welford state
// (count, mean, M2) of this rank's values as three doubles and combines them
// with a user-defined MPI operation that applies the Chan merge. The three
// doubles are sent as they are: nothing is converted on the way (PyTorch
// sends mean and invstd and converts back to a variance, which costs a few
// bits), so a rank that holds the only values of a batch gets its own state
// back bit for bit, and a merge of several is the same computation one
// process would do with Welford::merge. Counts may differ per rank, and a
// rank may hold no values at all (its count is 0, and the merge skips it).
// Counts travel as doubles: exact up to 2^53 values per channel.
//
// Determinism. The operation is declared non-commutative, so MPI applies it
// in rank order (state of rank 0, then 1, ...): for a given communicator
// size, the merged statistics do not depend on timing. The backward's
// per-channel sums (sum dy, sum dy * (x - mean), sum (x - mean), count) go
// through MPI_Allreduce with MPI_SUM.
//
// Collective calls. Every training forward and training backward of a
// BatchNorm that uses this reducer is a collective operation over the
// communicator: all of its ranks must make the same calls in the same order,
// with the same number of channels (a rank without data still calls, with a
// batch of size 0), and either all ranks or none pass saved statistics to
// backward (without them, backward merges the moments again). Eval mode with
// running statistics does not communicate.
//
// Lifetime of the MPI objects. The MPI datatype (3 contiguous doubles) and
// the operation are created on first use (MPI must be initialized by then;
// constructing the reducer before MPI_Init is fine) and freed by the
// destructor, which therefore must run before MPI_Finalize: give the reducer
// a scope that ends before MPI_Finalize, or call release(). A reducer
// destroyed after MPI_Finalize cannot free them any more and leaves them to
// the MPI library's exit. The communicator is not duplicated nor owned: it
// must stay valid while the reducer is used.
//
// Errors. MPI errors abort by default (MPI_ERRORS_ARE_FATAL). With
// MPI_ERRORS_RETURN set on the communicator, a failed call is reported
// through normcore's usual error path (detail::fail: std::invalid_argument,
// or the installed handler when built without exceptions).
//
// Not thread-safe: one reducer per thread that trains, each on its own
// communicator, and MPI initialized with the matching thread level.
#pragma once

// Only MPI's C API is used. Without these, <mpi.h> of Open MPI 4 and MPICH
// also declares the C++ bindings (removed from the standard in MPI 3.0),
// which need libmpi_cxx and warn under -Wextra. A program that still uses
// MPI:: includes <mpi.h> before this header.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <string>
#include <vector>

#include "normcore/batch_norm.hpp"
#include "normcore/welford.hpp"

namespace normcore {

/// BatchNormReducer over an MPI communicator (SyncBatchNorm).
class MpiBatchNormReducer final : public BatchNormReducer {
 public:
  /// The communicator is used, not duplicated nor freed.
  explicit MpiBatchNormReducer(MPI_Comm comm = MPI_COMM_WORLD) : comm_(comm) {}

  MpiBatchNormReducer(const MpiBatchNormReducer&) = delete;
  MpiBatchNormReducer& operator=(const MpiBatchNormReducer&) = delete;

  /// Frees the MPI datatype and operation if they were created and MPI is
  /// not finalized yet. Must run before MPI_Finalize to free them.
  ~MpiBatchNormReducer() override { release(); }

  MPI_Comm comm() const { return comm_; }

  /// Frees the MPI datatype and operation now (they are created again if the
  /// reducer is used again). Call before MPI_Finalize when the reducer
  /// outlives it. Does nothing after MPI_Finalize (nothing can be freed).
  void release() noexcept {
    if (!created_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      MPI_Op_free(&op_);
      MPI_Type_free(&type_);
    }
    op_ = MPI_OP_NULL;
    type_ = MPI_DATATYPE_NULL;
    created_ = false;
  }

  /// states[c] becomes the Chan merge, in rank order, of channel c's states
  /// of all ranks of the communicator. Collective.
  void allreduce_moments(Welford<double>* states, Index channels) override {
    if (channels <= 0) return;
    create();
    const std::size_t n = static_cast<std::size_t>(channels);
    buffer_.resize(3 * n);
    for (std::size_t c = 0; c < n; ++c) {
      buffer_[3 * c] = states[c].count();
      buffer_[3 * c + 1] = states[c].mean();
      buffer_[3 * c + 2] = states[c].m2();
    }
    // Element-wise operation: chunks of INT_MAX states, the same on every rank.
    for (std::size_t c0 = 0; c0 < n; c0 += static_cast<std::size_t>(INT_MAX)) {
      const int len = static_cast<int>(std::min<std::size_t>(n - c0, static_cast<std::size_t>(INT_MAX)));
      check(MPI_Allreduce(MPI_IN_PLACE, buffer_.data() + 3 * c0, len, type_, op_, comm_), "MPI_Allreduce (moments)");
    }
    for (std::size_t c = 0; c < n; ++c)
      states[c] = Welford<double>(buffer_[3 * c], buffer_[3 * c + 1], buffer_[3 * c + 2]);
  }

  /// values[i] becomes the sum over all ranks (MPI_SUM). Collective.
  void allreduce_sums(double* values, Index n) override {
    if (n <= 0) return;
    const std::size_t total = static_cast<std::size_t>(n);
    for (std::size_t i0 = 0; i0 < total; i0 += static_cast<std::size_t>(INT_MAX)) {
      const int len = static_cast<int>(std::min<std::size_t>(total - i0, static_cast<std::size_t>(INT_MAX)));
      check(MPI_Allreduce(MPI_IN_PLACE, values + i0, len, MPI_DOUBLE, MPI_SUM, comm_), "MPI_Allreduce (sums)");
    }
  }

  /// The MPI operation's function, public for tests: inout[i] = in[i] (+)
  /// inout[i] with (+) the Chan merge of states of 3 doubles, `in` holding
  /// the lower ranks (MPI's order for a non-commutative operation).
  static void merge_states(void* in, void* inout, int* len, MPI_Datatype*) {
    const double* a = static_cast<const double*>(in);
    double* b = static_cast<double*>(inout);
    for (int i = 0; i < *len; ++i, a += 3, b += 3) {
      Welford<double> w(a[0], a[1], a[2]);
      w.merge(Welford<double>(b[0], b[1], b[2]));
      b[0] = w.count();
      b[1] = w.mean();
      b[2] = w.m2();
    }
  }

 private:
  void create() {
    if (created_) return;
    check(MPI_Type_contiguous(3, MPI_DOUBLE, &type_), "MPI_Type_contiguous");
    check(MPI_Type_commit(&type_), "MPI_Type_commit");
    // commute = 0: MPI combines the ranks' states in rank order.
    const int rc = MPI_Op_create(&MpiBatchNormReducer::merge_states, 0, &op_);
    if (rc != MPI_SUCCESS) {
      MPI_Type_free(&type_);
      check(rc, "MPI_Op_create");
    }
    created_ = true;
  }

  static void check(int rc, const char* what) {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) len = 0;
    detail::fail(std::string("normcore::MpiBatchNormReducer: ") + what + " failed: " + std::string(msg, static_cast<std::size_t>(len)));
  }

  MPI_Comm comm_;
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  MPI_Op op_ = MPI_OP_NULL;
  bool created_ = false;
  std::vector<double> buffer_;
};

}  // namespace normcore
