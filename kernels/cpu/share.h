// How the compiled CPU kernels split costed items among their threads.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

// The items [begin, end) of `thread`'s share: contiguous, each item going to the thread its cost's midpoint falls
// in, so that threads get about equal costs (LoRA pieces differ up to 8x in rank, attention rows in context length).
inline std::pair<int64_t, int64_t> share(const std::vector<int64_t>& costs, int thread, int num_threads) {
  int64_t total = 0;
  for (int64_t c : costs) total += c;
  int64_t begin = 0, end = 0, before = 0;                        // 2 x midpoint x num_threads vs 2 x bound x total
  for (int64_t i = 0; i < static_cast<int64_t>(costs.size()); before += costs[i++]) {
    const int64_t mid = (2 * before + costs[i]) * num_threads;
    if (mid < 2 * thread * total) begin = i + 1;
    if (mid < 2 * (thread + 1) * total) end = i + 1;
  }
  return {begin, end};
}
