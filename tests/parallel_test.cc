// parallel_for_ahead (util/parallel.h): the decode kernel's task loop, whose tasks may take their
// thread's next task early to prefetch its first block. These check the hand-out: every task runs
// once, a claimed task runs next on the claiming thread and is told so, and a task that throws
// does not stop the others.
#include "util/parallel.h"

#include <gtest/gtest.h>

#include <omp.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace mha {
namespace {

struct TaskRun {
  int64_t task;
  bool claimed;     // what the loop said: the task before it on this thread claimed it
  int64_t claim;    // what this task's claim() returned (-1: it did not claim)
};

// Runs n tasks on `threads`; task t claims unless t % 3 == 0, and claims twice when t % 5 == 0.
std::vector<std::vector<TaskRun>> RunTasks(int64_t n, int threads) {
  std::vector<std::vector<TaskRun>> by_thread(static_cast<size_t>(threads));
  parallel_for_ahead(n, threads, [&](int64_t t, const auto& claim, bool claimed) {
    TaskRun r{t, claimed, -1};
    if (t % 3 != 0) {
      r.claim = claim();
      if (t % 5 == 0) EXPECT_EQ(claim(), r.claim) << "task " << t << ": a second claim must give the same task";
    }
    by_thread[static_cast<size_t>(omp_get_thread_num())].push_back(r);
  });
  return by_thread;
}

TEST(ParallelForAhead, RunsEveryTaskOnceAndAClaimedTaskNextOnItsThread) {
  for (int threads : {1, 2, 3, 8}) {
    for (int64_t n : {0, 1, 2, 5, 37, 200}) {
      SCOPED_TRACE("threads " + std::to_string(threads) + ", tasks " + std::to_string(n));
      const auto by_thread = RunTasks(n, threads);
      std::vector<int> runs(static_cast<size_t>(n), 0);
      for (const auto& seq : by_thread) {
        for (size_t i = 0; i < seq.size(); ++i) {
          const TaskRun& r = seq[i];
          ASSERT_GE(r.task, 0);
          ASSERT_LT(r.task, n);
          ++runs[static_cast<size_t>(r.task)];
          // Told claimed exactly when the run before it on this thread claimed it.
          const bool expected = i > 0 && seq[i - 1].claim == r.task;
          EXPECT_EQ(r.claimed, expected) << "task " << r.task;
          if (r.claim >= 0) {
            EXPECT_GT(r.claim, r.task) << "claims hand out tasks in index order";
            EXPECT_LE(r.claim, n);
            if (r.claim < n) {
              ASSERT_LT(i + 1, seq.size()) << "task " << r.task << " claimed " << r.claim << ", which never ran";
              EXPECT_EQ(seq[i + 1].task, r.claim) << "a claimed task runs next on the claiming thread";
            }
          }
        }
      }
      for (int64_t t = 0; t < n; ++t) EXPECT_EQ(runs[static_cast<size_t>(t)], 1) << "task " << t;
    }
  }
}

TEST(ParallelForAhead, ATaskThatThrowsLeavesTheOthersToRunAndIsRethrown) {
  for (int threads : {1, 2}) {
    std::mutex mu;
    std::vector<int> runs(50, 0);
    EXPECT_THROW(parallel_for_ahead(50, threads,
                                    [&](int64_t t, const auto& claim, bool) {
                                      if (t % 2 == 1) claim();
                                      {
                                        std::lock_guard<std::mutex> lock(mu);
                                        ++runs[static_cast<size_t>(t)];
                                      }
                                      if (t == 7) throw std::runtime_error("task 7");
                                    }),
                 std::runtime_error);
    for (int t = 0; t < 50; ++t) EXPECT_EQ(runs[static_cast<size_t>(t)], 1) << "threads " << threads << ", task " << t;
  }
}

}  // namespace
}  // namespace mha
