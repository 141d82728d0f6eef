// Built with -fno-exceptions: without a handler, an invalid argument prints
// "normcore: <message>" to stderr and aborts; a handler that returns also
// ends in abort. Each case runs in a forked child; the parent checks that the
// child died of SIGABRT and what it wrote to stderr.
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <normcore/normcore.hpp>

#if NORMCORE_HAS_EXCEPTIONS
#error "this test must be compiled with -fno-exceptions"
#endif

namespace {

void trigger_shape_error() {
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({8}));
  Eigen::Tensor<float, 2, Eigen::RowMajor> x(2, 5);
  x.setZero();
  const auto y = ln(x);
  std::fprintf(stderr, "returned from an invalid call (%ld values)\n", static_cast<long>(y.size()));
}

void returning_handler(const char* message) { std::fprintf(stderr, "handler returns: %s\n", message); }

/// Runs body in a child with stderr captured; true if it died of SIGABRT and
/// its stderr contains `want`.
template <typename F>
bool dies_with_abort(const char* name, F body, const char* want) {
  int fds[2];
  if (pipe(fds) != 0) return false;
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], 2);
    body();
    std::_Exit(0);  // not reached when normcore aborts
  }
  close(fds[1]);
  std::string err;
  char buf[512];
  ssize_t got;
  while ((got = read(fds[0], buf, sizeof buf)) > 0) err.append(buf, static_cast<std::size_t>(got));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  const bool aborted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
  const bool message = err.find(want) != std::string::npos;
  std::printf("%s: %s, stderr: %s", name, aborted ? "aborted" : "did NOT abort", err.c_str());
  if (!message) std::printf("%s: stderr lacks \"%s\"\n", name, want);
  return aborted && message;
}

}  // namespace

int main() {
  bool ok = dies_with_abort("default handler", [] { trigger_shape_error(); },
                            "normcore: normcore::LayerNorm: expected input whose trailing dims are [8], got input of shape [2, 5]");
  ok = dies_with_abort("returning handler",
                       [] {
                         normcore::set_error_handler(&returning_handler);
                         trigger_shape_error();
                       },
                       "handler returns: normcore::LayerNorm") && ok;
  ok = dies_with_abort("handler reset with nullptr",
                       [] {
                         normcore::set_error_handler(&returning_handler);
                         normcore::set_error_handler(nullptr);  // back to the default
                         trigger_shape_error();
                       },
                       "normcore: normcore::LayerNorm") && ok;
  std::printf(ok ? "PASS\n" : "FAIL\n");
  return ok ? 0 : 1;
}
