// A persistent team of threads for a chain of kernel calls: one OpenMP region around the
// whole chain instead of one per call.
//
// Why: a one-row decode step of the default model makes ~150 parallel kernel calls (four
// linear layers and attention per layer), each reading a few hundred KB of weights in a
// few microseconds. Every at::parallel_for forks and joins an OpenMP team and sets up
// torch's thread-local state on each thread, which costs about what the call's own work
// does. Team::run forks once: the calling thread (the master) runs the chain, and each
// parallel_for it makes hands the other threads their share through one shared word
// they spin on, and waits for them on another (llama.cpp's threads likewise spin between
// the ops of a graph); a wait that outlasts a short spin yields the core (wait_until).
//
// The split is at::parallel_for's own (OpenMP backend: min(threads, ceil(range / grain))
// threads, contiguous chunks of ceil(range / threads)), so a kernel runs the same units on
// the same threads with the same arithmetic inside a team or outside one: the bits are
// the same either way. Outside a team, sluice::parallel_for is at::parallel_for.
#pragma once

#include "aten.h"

#include <omp.h>
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>

namespace sluice {

// Waits until done(): spins (a wait inside a chain is normally a few microseconds, one
// call's imbalance), then yields the core at each further check. Where more threads are
// runnable than there are cores (the server's event loop beside the engine, a load tester
// or another process on the same cores), a waiter that only spun would keep the core for
// its whole time slice while the thread it waits for sat descheduled. kSpins pauses are
// ~0.1-0.25 ms (a pause is ~65 cycles on Zen, ~140 on recent Intel cores).
constexpr int kSpins = 4096;

template <typename Done>
inline void wait_until(const Done& done) {
  for (int i = 0; !done(); ++i) {
    if (i < kSpins) {
      _mm_pause();
    } else {
      sched_yield();
    }
  }
}

class Team;
// The team whose master is this thread, while it runs a chain (Team::run).
inline thread_local Team* tl_team = nullptr;
// Whether this thread is running a share of a team's call (a nested parallel_for then
// runs inline, as at::parallel_for does inside a parallel region).
inline thread_local bool tl_in_share = false;

class Team {
 public:
  // Runs chain() on this thread with `threads` threads (this one included) in one
  // OpenMP region; the sluice::parallel_for calls chain() makes run on all of them.
  // An exception from chain() or from any thread's share is rethrown here, after the
  // region has ended.
  template <typename Chain>
  static void run(int threads, const Chain& chain) {
    if (threads <= 1 || tl_team != nullptr || omp_in_parallel()) {
      chain();
      return;
    }
    Team team;
    std::exception_ptr error;
#pragma omp parallel num_threads(threads)
    {
      if (omp_get_thread_num() == 0) {
        team.size_ = omp_get_num_threads();
        tl_team = &team;
        try {
          chain();
        } catch (...) {
          error = std::current_exception();
        }
        tl_team = nullptr;
        team.stop_ = true;
        team.seq_.fetch_add(1, std::memory_order_release);
      } else {
        team.serve(omp_get_thread_num());
      }
    }
    if (error) std::rethrow_exception(error);
  }

  int size() const { return size_; }

  // f(b, e) over [begin, end) in at::parallel_for's chunks, chunk 0 on this thread (the
  // master), the others on the threads that wait in serve().
  template <typename F>
  void dispatch(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t range = end - begin;
    int64_t nt = size_;
    if (grain > 0) nt = std::min<int64_t>(nt, (range + grain - 1) / grain);
    if (nt <= 1 || range <= 1) {
      Share share;
      f(begin, end);
      return;
    }
    fn_ = &f;
    call_ = [](const void* p, int64_t b, int64_t e) { (*static_cast<const F*>(p))(b, e); };
    begin_ = begin, end_ = end, chunk_ = (range + nt - 1) / nt;
    pending_.store(size_ - 1, std::memory_order_relaxed);
    seq_.fetch_add(1, std::memory_order_release);
    std::exception_ptr mine;
    {
      Share share;
      try {
        f(begin, std::min(end, begin + chunk_));
      } catch (...) {
        mine = std::current_exception();
      }
    }
    wait_until([this] { return pending_.load(std::memory_order_acquire) == 0; });
    if (mine) std::rethrow_exception(mine);
    if (error_) {
      std::exception_ptr e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  struct Share {
    bool was = tl_in_share;
    Share() { tl_in_share = true; }
    ~Share() { tl_in_share = was; }
  };

  // A waiting thread: runs its chunk of each call the master publishes, until stopped.
  void serve(int tid) {
    Share share;
    uint64_t seen = 0;
    for (;;) {
      uint64_t s = seen;
      wait_until([&] { return (s = seq_.load(std::memory_order_acquire)) != seen; });
      seen = s;
      if (stop_) return;
      const int64_t b = begin_ + tid * chunk_;
      if (b < end_) {
        try {
          call_(fn_, b, std::min(end_, b + chunk_));
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex_);
          if (!error_) error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  // The call being run: written by the master before seq_ is bumped (release), read by
  // the others after they see the bump (acquire).
  const void* fn_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  bool stop_ = false;
  int size_ = 1;
  alignas(64) std::atomic<uint64_t> seq_{0};
  alignas(64) std::atomic<int> pending_{0};
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

// at::parallel_for, or inside a team's chain its threads without a fork.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (Team* team = tl_team; team != nullptr && !tl_in_share) {
    team->dispatch(begin, end, grain, f);
    return;
  }
  at::parallel_for(begin, end, grain, f);
}

// The threads a kernel may split its work over: the team's inside a chain.
inline int64_t num_threads() { return tl_team != nullptr ? tl_team->size() : at::get_num_threads(); }

// Whether a parallel_for here would run inline (a nested call).
inline bool in_parallel_region() { return tl_team != nullptr ? tl_in_share : at::in_parallel_region(); }

}  // namespace sluice
