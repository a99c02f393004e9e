// Shared by the device tests of kvpolicy::cuda (tests/cuda/test_cuda_*.cpp):
// CUDA / Status assertions, an owning device buffer, a non-blocking stream,
// and the "no device: skip with exit code 77" check their mains start with.
#pragma once

#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kvpolicy/backends/cuda.hpp"

#define CUDA_REQUIRE(expr)                         \
  do {                                             \
    const cudaError_t e_ = (expr);                 \
    INFO(#expr << ": " << cudaGetErrorString(e_)); \
    REQUIRE(e_ == cudaSuccess);                    \
  } while (0)

#define KVP_REQUIRE_OK(expr)              \
  do {                                    \
    const ::kvpolicy::Status s_ = (expr); \
    INFO(s_.message());                   \
    REQUIRE(s_.is_ok());                  \
  } while (0)

namespace kvp_cuda_test {

/// Device allocation owned by the test.
class DeviceBuffer {
 public:
  /// Uninitialised, as cudaMalloc leaves it; with KVP_CUDA_TEST_POISON set, every byte 0xFF (NaN as floats,
  /// -1 as integers), so that a kernel or a test that reads memory nobody wrote fails the same way each run
  /// (tools/gpu_check.sh runs every test once more so).
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) CUDA_REQUIRE(cudaMalloc(&ptr_, bytes_));
    if (bytes_ > 0 && std::getenv("KVP_CUDA_TEST_POISON") != nullptr) CUDA_REQUIRE(cudaMemset(ptr_, 0xFF, bytes_));
  }
  template <class T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    upload(host);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  template <class T>
  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() * sizeof(T) <= bytes_);
    if (!host.empty()) CUDA_REQUIRE(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t bytes() const { return bytes_; }
  ::kvpolicy::Workspace workspace() const { return ::kvpolicy::Workspace{ptr_, bytes_}; }
  template <class T>
  std::vector<T> download(std::size_t n) const {
    REQUIRE(n * sizeof(T) <= bytes_);
    std::vector<T> host(n);
    if (n > 0) CUDA_REQUIRE(cudaMemcpy(host.data(), ptr_, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

/// A non-blocking stream owned by the test.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { CUDA_REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
  void sync() const { CUDA_REQUIRE(cudaStreamSynchronize(s)); }
};

/// Runs `f` as a policy call would: inside a CallScope on `st`, then checks the recorded status.
template <class F>
void run_ops(const Stream& st, F&& f) {
  const ::kvpolicy::backend::Cuda::CallScope scope(st.s, 1);
  f();
  KVP_REQUIRE_OK(scope.end());
  st.sync();
}

/// True when a CUDA device is usable; otherwise prints "SKIPPED: no CUDA device (<why>)" for the caller to
/// return 77 (ctest's SKIP_RETURN_CODE).
inline bool have_device() {
  int count = 0;
  const ::kvpolicy::Status st = ::kvpolicy::backend::Cuda::device_count(&count);
  if (st.is_ok() && count > 0) return true;
  std::printf("SKIPPED: no CUDA device (%s)\n", st.is_ok() ? "cudaGetDeviceCount: 0 devices" : st.message());
  return false;
}

}  // namespace kvp_cuda_test
