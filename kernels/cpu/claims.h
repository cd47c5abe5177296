// How the compiled CPU kernels split their items among threads. Each thread starts on a contiguous share of about
// equal cost and takes items from its front; a thread whose share is done takes them from the back of the share
// with the most cost left. A static split waits at every op's barrier for the slowest thread, and on a shared host
// one core often runs slower than the other for a while (a neighbour's work beside it): the 30 layers' GEMMs of a
// 512-token prompt chunk took 891 ms split statically against 827 ms claimed (medians of 5, alternating), ~5% of
// the groups of panels taken from the other thread's back.
#pragma once
#include <atomic>
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

// The shares of num_threads threads; a team that came smaller (a nested region) takes the missing threads' shares.
class Claims {
 public:
  Claims(const std::vector<int64_t>& costs, int num_threads) : cost_before_(costs.size() + 1), shares_(num_threads) {
    for (size_t i = 0; i < costs.size(); ++i) cost_before_[i + 1] = cost_before_[i] + costs[i];
    for (int t = 0; t < num_threads; ++t) {
      const auto [begin, end] = share(costs, t, num_threads);
      shares_[t].range.store(pack(begin, end), std::memory_order_relaxed);
    }
  }

  // The next item for `thread`, or -1 when every item is taken.
  int64_t claim(int thread) {
    if (thread < static_cast<int>(shares_.size())) {
      auto& mine = shares_[thread].range;
      for (uint64_t r = mine.load(); front(r) < back(r);)
        if (mine.compare_exchange_weak(r, pack(front(r) + 1, back(r)))) return front(r);
    }
    while (true) {
      int victim = -1;
      int64_t most = 0;
      for (int t = 0; t < static_cast<int>(shares_.size()); ++t) {
        const uint64_t r = shares_[t].range.load();
        const int64_t left = front(r) < back(r) ? cost_before_[back(r)] - cost_before_[front(r)] + 1 : 0;
        if (left > most) most = left, victim = t;
      }
      if (victim < 0) return -1;
      auto& theirs = shares_[victim].range;
      uint64_t r = theirs.load();
      if (front(r) < back(r) && theirs.compare_exchange_weak(r, pack(front(r), back(r) - 1))) return back(r) - 1;
    }
  }

  // Whether `item` is what `thread` takes next from its own share (worth pulling into the cache ahead).
  bool is_next(int thread, int64_t item) const {
    if (thread >= static_cast<int>(shares_.size())) return false;
    const uint64_t r = shares_[thread].range.load(std::memory_order_relaxed);
    return item == front(r) && item < back(r);
  }

 private:
  struct alignas(64) Share {                   // a line each: a claim does not stall the other threads' claims
    std::atomic<uint64_t> range{0};            // front << 32 | back
  };
  static uint64_t pack(int64_t front, int64_t back) { return static_cast<uint64_t>(front) << 32 | back; }
  static int64_t front(uint64_t r) { return static_cast<int64_t>(r >> 32); }
  static int64_t back(uint64_t r) { return static_cast<int64_t>(r & 0xffffffffu); }

  std::vector<int64_t> cost_before_;           // [num_items + 1]: the costs of the items before each
  std::vector<Share> shares_;
};
