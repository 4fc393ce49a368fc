// Host buffers of staged batches as the loader keeps them (train/loader.h): page-locked, several
// reused in turn, a finished step's spoiled at once. On CUDA an upload from pageable memory is copied
// out before the call returns, so an upload ordered wrongly could only be caught reading from
// page-locked memory; a step that read its batch after its finish shows the NaN spoil() writes.
#pragma once

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "engine/host_pages.h"
#include "tests/util.h"

namespace dp::test {

struct PinnedBatches {
  // `count` buffers of `batch` images (make_batches' 784 floats each) and labels.
  PinnedBatches(Engine& e, int count, int batch)
      : x(size_t(count), PageVector<float>(size_t(batch) * 784)), y(size_t(count), PageVector<int32_t>(size_t(batch))) {
    for (size_t i = 0; i < x.size(); ++i) {
      locks.push_back(e.pin_host(x[i].data(), x[i].size() * sizeof(float)));
      locks.push_back(e.pin_host(y[i].data(), y[i].size() * sizeof(int32_t)));
    }
  }
  // Step s's batch of `n` from `data`, copied into buffer s % count and staged.
  void stage(Engine& e, const Batches& data, int s, int n) {
    const size_t i = size_t(s) % x.size();
    std::copy(data.x[size_t(s)].begin(), data.x[size_t(s)].end(), x[i].begin());
    std::copy(data.y[size_t(s)].begin(), data.y[size_t(s)].end(), y[i].begin());
    e.stage(x[i].data(), y[i].data(), n);
  }
  // Step s's buffer overwritten: NaN images, labels -1.
  void spoil(int s) {
    const size_t i = size_t(s) % x.size();
    std::fill(x[i].begin(), x[i].end(), std::numeric_limits<float>::quiet_NaN());
    std::fill(y[i].begin(), y[i].end(), -1);
  }

  std::vector<PageVector<float>> x;
  std::vector<PageVector<int32_t>> y;
  std::vector<std::shared_ptr<void>> locks;  // after the buffers: unlocked before they go
};

}  // namespace dp::test
