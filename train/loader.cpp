#include "train/loader.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace dp {

BatchLoader::BatchLoader(const Dataset& data, const LoaderPlan& plan, int workers)
    : data_(data), plan_(plan), workers_(workers) {
  if (workers < 0 || workers > kMaxWorkers)  // check_options refuses them with the reason first
    throw std::invalid_argument("BatchLoader: " + std::to_string(workers) + " workers");
  if (plan.held < 1 || plan.held > 3)
    throw std::invalid_argument("BatchLoader: " + std::to_string(plan.held) + " batches held; 1 to 3");
  slots_.resize(size_t(plan.held) + 1);
  const size_t capacity = size_t(std::min<int64_t>(plan.batch, data.count));
  for (HostBatch& b : slots_) {
    b.x.resize(capacity * size_t(data.image_size()));
    b.y.resize(capacity);
  }
  // A device that does not lock (a null handle) is asked once.
  if (plan_.pin)
    for (HostBatch& b : slots_) {
      std::shared_ptr<void> x = plan_.pin(b.x.data(), b.x.size() * sizeof(float));
      if (!x) break;
      pins_.push_back(std::move(x));
      if (std::shared_ptr<void> y = plan_.pin(b.y.data(), b.y.size() * sizeof(int32_t))) pins_.push_back(std::move(y));
    }
  if (workers_ > 0 && plan_.first_step < plan_.end_step) thread_ = std::thread([this] { load(); });
}

BatchLoader::~BatchLoader() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

// The gather itself: the rows of `step` in its epoch's order, the order drawn when the epoch changes.
void BatchLoader::fill(HostBatch& b, int64_t step) {
  const int64_t epoch = step / plan_.per_epoch, first = (step % plan_.per_epoch) * plan_.batch;
  if (epoch != order_epoch_) {
    order_ = epoch_order(data_.count, plan_.seed, epoch, plan_.shuffle);
    order_epoch_ = epoch;
  }
  const int64_t D = data_.image_size();
  b.n = int(std::min<int64_t>(plan_.batch, data_.count - first));
  const auto [lo, hi] = plan_.rows ? plan_.rows(b.n) : std::pair{0, b.n};
  b.first = lo, b.rows = hi - lo;
  for (int i = 0; i < b.rows; ++i) {
    const int64_t s = order_[size_t(first + lo + i)];
    std::copy_n(data_.images.begin() + s * D, D, b.x.begin() + i * D);
    b.y[size_t(i)] = data_.labels[size_t(s)];
  }
  b.step = step;
}

// Fills the plan's k-th batch once the batch that last had its buffer is handed back, until the plan
// ends or the loader is stopped.
void BatchLoader::load() {
  const int64_t slots = int64_t(slots_.size());
  try {
    for (int64_t k = 0; plan_.first_step + k < plan_.end_step; ++k) {
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || k < released_ + slots; });
        if (stop_) return;
      }
      fill(slots_[size_t(k % slots)], plan_.first_step + k);
      {
        std::lock_guard lock(mu_);
        filled_ = k + 1;
      }
      cv_.notify_all();
    }
  } catch (...) {  // epoch_order's allocation under a memory cap: the trainer's next() rethrows it
    std::lock_guard lock(mu_);
    error_ = std::current_exception();
    cv_.notify_all();
  }
}

const HostBatch& BatchLoader::next() {
  if (plan_.first_step + taken_ >= plan_.end_step)
    throw std::logic_error("BatchLoader::next: past the last step (" + std::to_string(plan_.end_step) + ")");
  HostBatch& b = slots_[size_t(taken_ % int64_t(slots_.size()))];
  if (workers_ == 0) {
    fill(b, plan_.first_step + taken_++);
    return b;
  }
  std::unique_lock lock(mu_);
  // The oldest batch held is done with: the loader may refill its buffer.
  released_ = std::max<int64_t>(0, taken_ - (plan_.held - 1));
  cv_.notify_all();
  cv_.wait(lock, [&] { return filled_ > taken_ || error_; });
  if (filled_ <= taken_) std::rethrow_exception(error_);
  ++taken_;
  return b;
}

}  // namespace dp
