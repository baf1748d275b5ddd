// The one thread pool: OpenMP (the same runtime oneDNN's sgemm uses, so the two never fight;
// a BLAS call made inside our parallel region runs single-threaded).
#ifndef MHA_UTIL_PARALLEL_H_
#define MHA_UTIL_PARALLEL_H_

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>

namespace mha {

// 0 means "all available" (OMP_NUM_THREADS or the core count).
inline int resolve_threads(int requested) {
  return requested > 0 ? requested : omp_get_max_threads();
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

}  // namespace mha

#endif  // MHA_UTIL_PARALLEL_H_
