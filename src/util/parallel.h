// The one thread pool: OpenMP (the same runtime oneDNN's sgemm uses, so the two never fight;
// a BLAS call made inside our parallel region runs single-threaded).
#ifndef MHA_UTIL_PARALLEL_H_
#define MHA_UTIL_PARALLEL_H_

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>

#include "mha/attention.h"
#include "mha/error.h"

namespace mha {

// The threads a call runs on. 0 means "all available" (OMP_NUM_THREADS or the core count).
// Outside [0, kMaxThreads] is an mha::Error (an OpenMP runtime that cannot create the threads
// ends the process instead of failing). More than 4 per core is clamped: results do not depend on
// the thread count, and oversubscription only slows a call down.
// The range check alone, for the argument checks of an op (`who` prefixes the message).
inline void check_num_threads(int requested, const char* who) {
  if (requested < 0 || requested > kMaxThreads) {
    throw Error(std::string(who) + "num_threads must be in [0, " + std::to_string(kMaxThreads) +
                "] (0: all available); got " + std::to_string(requested));
  }
}

inline int resolve_threads(int requested) {
  check_num_threads(requested, "");
  const int available = omp_get_max_threads();
  static const int procs = omp_get_num_procs();  // a sched_getaffinity system call each time
  return std::min(requested > 0 ? requested : available, std::max(4 * procs, available));
}

// Runs f(t) for t in [0, n) on up to num_threads threads, tasks handed out one at a time in
// index order (so put the costly tasks first). Which thread runs a task never changes its
// result: callers give each task its own outputs. An exception thrown by a task (e.g.
// std::bad_alloc) is rethrown here after the region ends.
template <typename F>
void parallel_for(int64_t n, int num_threads, F&& f) {
  const int threads = static_cast<int>(std::min<int64_t>(resolve_threads(num_threads), n));
  if (threads <= 1) {
    for (int64_t t = 0; t < n; ++t) f(t);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t t = 0; t < n; ++t) {
    try {
      f(t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// parallel_for whose tasks may take their thread's next task before they end, to prefetch its
// inputs while their own last work runs: f(t, claim, claimed), where claim() hands this thread
// the next task in index order now (its index, or n where none is left; the same index again if
// called twice) and that task runs next on this thread, and `claimed` says whether the task
// before t on this thread claimed t. After a task that never calls claim(), its thread takes the
// next task when the task ends, as parallel_for's threads do. Taken at a task's last piece of
// work, a claim leaves the threads as balanced as parallel_for does, within that piece. Which
// thread runs a task still never changes its result. An exception thrown by a task is rethrown
// once every task has run, on any number of threads.
template <typename F>
void parallel_for_ahead(int64_t n, int num_threads, F&& f) {
  const int threads = static_cast<int>(std::min<int64_t>(resolve_threads(num_threads), n));
  std::exception_ptr error;
  if (threads <= 1) {
    bool claimed = false;
    for (int64_t t = 0; t < n; ++t) {
      bool claims = false;
      const auto claim = [&] {
        claims = true;
        return t + 1;
      };
      try {
        f(t, claim, claimed);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
      claimed = claims;
    }
    if (error) std::rethrow_exception(error);
    return;
  }
  std::atomic<int64_t> next{0};
  std::mutex error_mutex;
#pragma omp parallel num_threads(threads)
  {
    bool claimed = false;
    for (int64_t t = next.fetch_add(1); t < n;) {
      int64_t after = -1;  // the task claimed by t, once it claims one
      const auto claim = [&] {
        if (after < 0) after = std::min(next.fetch_add(1), n);
        return after;
      };
      try {
        f(t, claim, claimed);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
      claimed = after >= 0;
      t = claimed ? after : next.fetch_add(1);
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace mha

#endif  // MHA_UTIL_PARALLEL_H_
