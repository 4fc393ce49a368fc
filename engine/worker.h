// A persistent host thread that runs tasks in order: every device owns one for compute (and a second
// for bucketed communication), alive for the whole run.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace dp {

class Worker {
 public:
  // `init` runs first on the new thread (a CUDA device sets itself current there).
  explicit Worker(std::function<void()> init = {});
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Runs `task` on the worker thread; the future carries its exception, if any.
  std::future<void> submit(std::function<void()> task);

 private:
  void loop(std::function<void()> init);
  std::mutex mu_;
  std::condition_variable cv_;
  struct Task {
    std::function<void()> fn;
    std::promise<void> done;
  };
  std::deque<Task> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dp
