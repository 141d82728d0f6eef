// Prints the README's accuracy table (markdown); with --write FILE, replaces
// the table between the accuracy-table markers in FILE. Exit status 1 if a
// target is missed.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "accuracy.hpp"

int main(int argc, char** argv) {
  std::ostringstream os;
  os << "| H | offset | floor | normcore fwd | normcore fwd / floor | naive one-pass | normcore bwd dx |\n";
  os << "|---|---|---|---|---|---|---|\n";
  bool ok = true;
  char line[256];
  for (long H : {64L, 768L, 4096L}) {
    for (double offset : {0.0, 1e2, 1e4, 1e6}) {
      const auto r = nctest::layer_norm_accuracy(H, offset);
      char ratio[32] = "-";
      if (r.floor > 0) std::snprintf(ratio, sizeof ratio, "%.1e", r.fwd / r.floor);
      char naive[64];
      if (r.naive_nan_rows > 0)
        std::snprintf(naive, sizeof naive, "%.0f%% of rows NaN", 100 * r.naive_nan_rows);
      else
        std::snprintf(naive, sizeof naive, "%.1e", r.naive);
      std::snprintf(line, sizeof line, "| %ld | %.0e | %.1e | %.1e | %s | %s | %.1e |\n", H, offset,
                    r.floor, r.fwd, ratio, naive, r.bwd_dx);
      os << line;
      ok = ok && (r.floor > 0 ? r.fwd <= 1.5 * r.floor : r.fwd <= 6.4e-7);
    }
  }
  const std::string table = os.str();
  std::fputs(table.c_str(), stdout);
  if (argc == 3 && std::string(argv[1]) == "--write") {
    std::ifstream in(argv[2]);
    std::stringstream buf;
    buf << in.rdbuf();
    std::string text = buf.str();
    const std::string begin = "<!-- accuracy-table:begin -->\n", end = "<!-- accuracy-table:end -->";
    const auto b = text.find(begin), e = text.find(end);
    if (b == std::string::npos || e == std::string::npos || e < b) {
      std::fprintf(stderr, "markers not found in %s\n", argv[2]);
      return 2;
    }
    text = text.substr(0, b + begin.size()) + table + text.substr(e);
    std::ofstream(argv[2]) << text;
  }
  return ok ? 0 : 1;
}
