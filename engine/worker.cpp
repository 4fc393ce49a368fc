#include "engine/worker.h"

namespace dp {

Worker::Worker(std::function<void()> init) : thread_([this, init] { loop(init); }) {}

Worker::~Worker() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::future<void> Worker::submit(std::function<void()> fn) {
  Task t{std::move(fn), {}};
  auto f = t.done.get_future();
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(t));
  }
  cv_.notify_one();
  return f;
}

void Worker::loop(std::function<void()> init) {
  // An init failure is reported by every task instead of being lost on a thread nobody joins.
  std::exception_ptr init_error;
  if (init) {
    try {
      init();
    } catch (...) {
      init_error = std::current_exception();
    }
  }
  for (;;) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;
    // Moved out, not default-constructed and assigned: a fresh promise allocates its shared state,
    // and a bad_alloc here, outside any task, would end the process (seen under ulimit -v).
    Task t = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    if (init_error) {
      t.done.set_exception(init_error);
      continue;
    }
    try {
      t.fn();
      t.done.set_value();
    } catch (...) {
      t.done.set_exception(std::current_exception());
    }
  }
}

}  // namespace dp
