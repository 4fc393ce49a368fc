// The input pipeline of a training run, as PyTorch's DataLoader with its workers: the host side of
// each batch (the epoch order's gather of image rows and labels) assembled by a loader thread while
// the step before it trains (--workers 1), or by the trainer itself between steps (--workers 0).
// Either way the batches are the same, in the same order: which rows a step gets depends only on its
// global step, never on timing.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "engine/host_pages.h"
#include "train/data.h"

namespace dp {

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
  // How many of the batches next() returned the trainer holds at once: 1, one more when it stages the
  // next step's batch before this step trains (Engine::stage, prefetch), and one more when a step stays
  // in flight while the next one trains (--run-ahead: its batch is held until it is finished).
  int held = 1;
};

// More than one loader thread would not pay: a batch is a gather from a data set already in memory,
// a fraction of a millisecond against a step's tens (README.md, dp_train's --workers).
inline constexpr int kMaxWorkers = 1;

// The batches of a plan, one next() per step, in held + 1 staging buffers: while the trainer holds
// the last `held` batches next() returned, the loader thread (one worker) fills the one after; next()
// hands the oldest held batch back and takes the new one. With held 1: the trainer trains on step
// k's batch while step k+1's is filled. With held 2 (prefetch): step k trains while step k+1's batch,
// also held, uploads on the copy stream and step k+2's is filled. With held 3 (prefetch and
// --run-ahead) step k-1's batch is held too, until that step is finished. Nothing is allocated per step (an
// epoch's order is drawn once per epoch).
// On CUDA the staging buffers are page-locked (LoaderPlan::pin), so an upload from them is one DMA
// the host does not wait for. A buffer goes back to the loader at a later next(), after the step that
// trained on it returned, which is after its upload completed.
class BatchLoader {
 public:
  // `data` must outlive the loader; workers is 0 (fill in next()) or 1 (a loader thread).
  BatchLoader(const Dataset& data, const LoaderPlan& plan, int workers);
  // Stops the loader thread and joins it, whatever it was doing: an exception or a signal unwinding
  // the run waits at most for the one batch being filled.
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // The next step's batch, waiting for it if the loader thread is behind; valid until `held` more
  // calls, the last of which hands its buffer back. Rethrows what the loader thread threw; throws
  // std::logic_error past the plan's last step.
  const HostBatch& next();

 private:
  void fill(HostBatch& b, int64_t step);
  void load();  // the loader thread

  const Dataset& data_;
  const LoaderPlan plan_;
  const int workers_;
  std::vector<HostBatch> slots_;             // (held + 1): the k-th batch of the plan is in slots_[k % size]
  std::vector<std::shared_ptr<void>> pins_;  // after slots_: unlocked before the buffers are freed
  std::vector<int64_t> order_;               // (count): the epoch order of order_epoch_, the filler's own
  int64_t order_epoch_ = -1;
  int64_t taken_ = 0;  // batches next() has returned; the last `held` of them are the trainer's
  // Shared with the loader thread, under mu_: batches filled, batches handed back, stop, its failure.
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t filled_ = 0, released_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started once everything above is in place
};

}  // namespace dp
