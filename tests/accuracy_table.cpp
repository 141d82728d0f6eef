// Prints the README's accuracy table (markdown). Run: normcore_accuracy_table
#include <cstdio>

#include "accuracy.hpp"

int main() {
  std::printf("| H | offset | floor | normcore fwd | normcore fwd / floor | naive one-pass | normcore bwd dx |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  bool ok = true;
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
      std::printf("| %ld | %.0e | %.1e | %.1e | %s | %s | %.1e |\n", H, offset, r.floor, r.fwd, ratio,
                  naive, r.bwd_dx);
      ok = ok && (r.floor > 0 ? r.fwd <= 1.5 * r.floor : r.fwd <= 6.4e-7);
    }
  }
  return ok ? 0 : 1;
}
