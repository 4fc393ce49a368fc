// Host memory in whole pages: what Device::pin_host locks (an allocation that shares no page with
// another can be page-locked on its own). The loader's staging buffers and the engine's host copies
// of the optimizer scalars are such.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <new>
#include <vector>

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

}  // namespace dp
