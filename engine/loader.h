// The input pipeline of a training run, as PyTorch's DataLoader with its workers: the host side of
// each batch (the epoch order's gather of image rows and labels) assembled by a loader thread while
// the step before it trains (--workers 1), or by the trainer itself between steps (--workers 0).
// Either way the batches are the same, in the same order: which rows a step gets depends only on its
// global step, never on timing.
#pragma once

#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "engine/data.h"

namespace dp {

// Whole pages: an allocation starts on a page and owns its last one, so it can be page-locked
// (Device::pin_host) without sharing a page with any other allocation.
template <class T>
struct PageAllocator {
  using value_type = T;
  PageAllocator() = default;
  template <class U>
  PageAllocator(const PageAllocator<U>&) {}
  static size_t page() { return size_t(sysconf(_SC_PAGESIZE)); }
  static size_t rounded(size_t n) { return (n * sizeof(T) + page() - 1) / page() * page(); }
  T* allocate(size_t n) { return static_cast<T*>(::operator new(rounded(n), std::align_val_t(page()))); }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, std::align_val_t(page())); }
  bool operator==(const PageAllocator&) const = default;
};
template <class T>
using PageVector = std::vector<T, PageAllocator<T>>;

// The host side of one batch, in a buffer allocated once for the largest batch.
struct HostBatch {
  PageVector<float> x;      // (capacity, D): rows [first, first + rows) of the batch, from row 0 on
  PageVector<int32_t> y;    // (capacity)
  int n = 0;                // the batch's size (the global batch, across processes)
  int first = 0, rows = 0;  // which of its rows this process holds: all n of them unless LoaderPlan::rows
  int64_t step = -1;        // the global step (0-based) it is for
};

// Which batches a run takes: those of global steps [first_step, end_step), step s being rows
// (s % per_epoch) * batch onward of epoch s / per_epoch's order (epoch_order(count, seed, epoch,
// shuffle)); an epoch's last batch holds what is left.
struct LoaderPlan {
  int batch = 0;
  int64_t per_epoch = 0, first_step = 0, end_step = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  // Across processes (Engine::slice): the rows [first, second) of a batch of n that this process's
  // devices train on, the only ones it assembles. Unset: all of them.
  std::function<std::pair<int, int>(int n)> rows;
  // Page-locks a staging buffer for the devices' uploads (Engine::pin_host), the lock held as long
  // as the handle. Unset, or a null handle (simulated devices): the buffers stay pageable.
  std::function<std::shared_ptr<void>(void* p, size_t bytes)> pin;
};

// More than one loader thread would not pay: a batch is a gather from a data set already in memory,
// a fraction of a millisecond against a step's tens (README.md, dp_train's --workers).
inline constexpr int kMaxWorkers = 1;

// The batches of a plan, one next() per step. With one worker, two staging buffers: while the trainer
// holds step k's, the loader thread fills step k+1's; next() hands k's back and takes k+1's. Nothing
// is allocated per step (an epoch's order is drawn once per epoch).
// On CUDA the staging buffers are page-locked (LoaderPlan::pin), so Engine::step's upload from them
// is one DMA. A buffer goes back to the loader at the next next(), after Engine::step returned,
// which is after its upload completed. (Copying step k+1's batch on a copy stream while step k
// computes would need the engine to take the next batch before it waits for this one: not done.)
class BatchLoader {
 public:
  // `data` must outlive the loader; workers is 0 (fill in next()) or 1 (a loader thread).
  BatchLoader(const Dataset& data, const LoaderPlan& plan, int workers);
  // Stops the loader thread and joins it, whatever it was doing: an exception or a signal unwinding
  // the run waits at most for the one batch being filled.
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // The next step's batch, waiting for it if the loader thread is behind; valid until the next call,
  // which hands its buffer back. Rethrows what the loader thread threw; throws std::logic_error past
  // the plan's last step.
  const HostBatch& next();

 private:
  void fill(HostBatch& b, int64_t step);
  void load();  // the loader thread

  const Dataset& data_;
  const LoaderPlan plan_;
  const int workers_;
  HostBatch slots_[2];                       // step k's batch is in slots_[k % 2]
  std::vector<std::shared_ptr<void>> pins_;  // after slots_: unlocked before the buffers are freed
  std::vector<int64_t> order_;               // (count): the epoch order of order_epoch_, the filler's own
  int64_t order_epoch_ = -1;
  int64_t taken_ = 0;  // batches next() has returned; the last of them is the trainer's
  // Shared with the loader thread, under mu_: batches filled, batches handed back, stop, its failure.
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t filled_ = 0, released_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started once everything above is in place
};

}  // namespace dp
