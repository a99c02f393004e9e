// Inputs of the golden vectors in reference/algorithms-eviction.md §11:
// B=1, Hq=4, Hkv=2, T=12, d=4, RoPE base 10000 with the half-split convention.
#pragma once

#include <cmath>
#include <vector>

namespace golden {

constexpr int kHq = 4, kHkv = 2, kT = 12, kD = 4;

inline void rope(double* x, int pos) {
  // rotate_half convention: pairs (c, c + d/2), inv_freq_i = 10000^(-2i/d).
  for (int i = 0; i < kD / 2; ++i) {
    const double inv = std::pow(10000.0, -2.0 * i / kD);
    const double a = pos * inv, c = std::cos(a), s = std::sin(a);
    const double x0 = x[i], x1 = x[i + kD / 2];
    x[i] = x0 * c - x1 * s;
    x[i + kD / 2] = x1 * c + x0 * s;
  }
}

/// Post-RoPE queries (Hq, T, d) and keys (Hkv, T, d), row-major, double.
inline std::vector<double> queries() {
  std::vector<double> q(kHq * kT * kD);
  for (int h = 0; h < kHq; ++h)
    for (int t = 0; t < kT; ++t) {
      double* r = &q[(h * kT + t) * kD];
      for (int c = 0; c < kD; ++c) r[c] = std::sin(0.25 * (h + 1) * (t + 1) - 0.4 * c);
      rope(r, t);
    }
  return q;
}

inline std::vector<double> keys() {
  std::vector<double> k(kHkv * kT * kD);
  for (int g = 0; g < kHkv; ++g)
    for (int t = 0; t < kT; ++t) {
      double* r = &k[(g * kT + t) * kD];
      for (int c = 0; c < kD; ++c) r[c] = std::cos(0.5 * (g + 1) + 0.3 * t * (c + 1));
      rope(r, t);
    }
  return k;
}

}  // namespace golden
