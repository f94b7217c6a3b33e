// A second thread for short engine steps: the pair kernel's columns (small_linear.cpp) and the decode attention
// kernel's items (decode_attention.cpp); see replica/cpu_kernels.arm_step_helper and replica/config.py.
//
// A short step (a decode batch, a short prompt) runs on one torch thread. OpenMP's second thread made such steps
// slower over HTTP (BENCHMARKS.md 0ze, 0zf): each parallel region splits its work evenly and waits at its end for
// the other thread, which may be off its core while the ingress and Ray's threads run there, and after the step the
// worker spins on, on the core the response needs next. The helper instead takes chunks of work from a counter
// shared with the calling thread, so the caller never waits for more than the chunk the helper holds, and it sleeps
// once the engine disarms it at the end of the step (or after kIdleLimit without work). Every chunk is computed as
// the one-thread kernel computes it, so the result is the same bit for bit.
//
// Jobs: one 64-bit word holds the job's generation, its chunk count and the next chunk to claim; the caller writes
// the job's function and context, then publishes the word (release order), and each side claims a chunk by advancing
// the word. The helper claims with a compare-and-swap of the word it read, whose count it checked, so a claim
// succeeds only while that job is current and has that chunk left; the caller then waits for the helper's chunks to
// be counted done. (With the count read apart from the word, a helper could pair the last job's word with the next
// job's count and function, and take a chunk of a job that the caller finished without it: tests/test_cpu_linear.py
// runs such jobs back to back.) A forked child starts a helper of its own (pthread_atfork handlers reset the state).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>

namespace prefixserve {

class StepHelper {
 public:
  using Chunk = void (*)(const void* context, int64_t chunk);

  // The process's helper (never destroyed: its thread is detached and may outlive static destructors).
  static StepHelper& instance() {
    static StepHelper* helper = new StepHelper();
    return *helper;
  }

  // Armed, the helper takes chunks of run()'s jobs; disarmed, it sleeps and the caller takes them all. Arming does
  // nothing where the process may run on one CPU only, or no thread could be started.
  void arm(bool on) {
    if (!on) {
      armed_.store(false, std::memory_order_relaxed);
      return;
    }
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!has_thread_) {
        try {
          std::thread thread([this] { loop(); });
          handle_ = thread.native_handle();
          thread.detach();
          has_thread_ = true;
          pinned_away_from_ = -1;
        } catch (const std::system_error&) {
          return;  // (no thread: the callers compute every chunk)
        }
      }
      if (!keep_off(sched_getcpu())) return;
      armed_.store(true, std::memory_order_relaxed);
      arm_seq_.fetch_add(1, std::memory_order_relaxed);
      wake = sleeping_;
    }
    if (wake) wake_.notify_one();
  }

  bool armed() const { return armed_.load(std::memory_order_relaxed); }

  // Chunks the helper has computed since the process started (tests: whether it took part).
  int64_t chunks_taken() const { return taken_.load(std::memory_order_relaxed); }

  // f(i) for every i in [0, chunks), on the calling thread and the helper; returns when all are done.
  // Jobs come from one thread at a time; a second caller meanwhile computes its chunks alone.
  // (More chunks than the claim word counts run alone too: 2^18 - 2 chunks of 32-64 columns suffice.)
  template <typename F>
  void run(int64_t chunks, const F& f) {
    if (chunks > kMaxChunks || busy_.exchange(true, std::memory_order_acquire)) {
      for (int64_t i = 0; i < chunks; ++i) f(i);
      return;
    }
    run_job(chunks, [](const void* context, int64_t i) { (*static_cast<const F*>(context))(i); }, &f);
    busy_.store(false, std::memory_order_release);
  }

 private:
  // Armed but without work for this long, the helper sleeps until the next arm (the engine disarms it after each
  // step's forward; a step's prompt imports or a layer's attention may keep it waiting a while).
  static constexpr auto kIdleLimit = std::chrono::microseconds(5000);
  static constexpr uint32_t kWaitSpins = 4096;  // ~0.1 ms of pause instructions
  static constexpr uint32_t kCsrFlags = 0x3f;   // MXCSR's sticky exception flags: not part of the rounding mode
  // the claim word: generation (28 bits) | chunk count (18 bits) | next chunk (18 bits)
  static constexpr int kFieldBits = 18;
  static constexpr uint64_t kFieldMask = (uint64_t{1} << kFieldBits) - 1;
  static constexpr uint64_t kGenerationMask = (uint64_t{1} << (64 - 2 * kFieldBits)) - 1;
  static constexpr int64_t kMaxChunks = static_cast<int64_t>(kFieldMask) - 2;  // the caller's last claim stays below
  static int64_t next_of(uint64_t word) { return static_cast<int64_t>(word & kFieldMask); }
  static int64_t count_of(uint64_t word) { return static_cast<int64_t>((word >> kFieldBits) & kFieldMask); }
  static uint64_t generation_of(uint64_t word) { return word >> (2 * kFieldBits); }

  StepHelper() {
    pthread_atfork(&StepHelper::before_fork, &StepHelper::after_fork_parent, &StepHelper::after_fork_child);
  }

  // A forked child has no helper thread: it starts one of its own on its first arm, from a clean state (a job of the
  // parent's in flight, its mutex or condition variable's waiters would otherwise come along).
  static void before_fork() { instance().mutex_.lock(); }
  static void after_fork_parent() { instance().mutex_.unlock(); }
  static void after_fork_child() {
    StepHelper& helper = instance();
    helper.claim_.store(0, std::memory_order_relaxed);
    helper.busy_.store(false, std::memory_order_relaxed);
    helper.armed_.store(false, std::memory_order_relaxed);
    helper.has_thread_ = false;
    helper.sleeping_ = false;
    new (&helper.wake_) std::condition_variable();  // (the parent's waiter does not exist here)
    helper.mutex_.unlock();
  }

  // Keeps the helper off the caller's CPU (guarded by mutex_): woken by a caller that keeps running, the scheduler
  // may queue it on the caller's own core, where it only takes turns with it. False where the process has no other
  // CPU to give it (the process's CPUs: its first thread's mask).
  bool keep_off(int cpu) {
    if (cpu < 0) return false;
    if (cpu == pinned_away_from_) return true;
    cpu_set_t allowed;
    if (sched_getaffinity(getpid(), sizeof(allowed), &allowed) != 0 || CPU_COUNT(&allowed) < 2) return false;
    CPU_CLR(cpu, &allowed);
    if (CPU_COUNT(&allowed) < 1 || pthread_setaffinity_np(handle_, sizeof(allowed), &allowed) != 0) return false;
    pinned_away_from_ = cpu;
    return true;
  }

  void run_job(int64_t chunks, Chunk fn, const void* context) {
    fn_.store(fn, std::memory_order_relaxed);
    context_.store(context, std::memory_order_relaxed);
    csr_.store(_mm_getcsr(), std::memory_order_relaxed);  // the helper rounds and flushes as the caller does
    done_.store(0, std::memory_order_relaxed);
    uint64_t generation = (generation_of(claim_.load(std::memory_order_relaxed)) + 1) & kGenerationMask;
    if (generation == 0) generation = 1;  // (0: no job yet)
    claim_.store((generation << (2 * kFieldBits)) | (static_cast<uint64_t>(chunks) << kFieldBits),
                 std::memory_order_release);
    int64_t mine = 0;
    for (;;) {
      const int64_t i = next_of(claim_.fetch_add(1, std::memory_order_acq_rel));
      if (i >= chunks) break;
      fn(context, i);
      ++mine;
    }
    // the helper's last chunk: spin a little, then let this CPU's other threads run meanwhile
    for (uint32_t spins = 0; mine + done_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < kWaitSpins)
        _mm_pause();
      else
        sched_yield();
    }
  }

  // Claim and compute one chunk of the current job; false when there is none left.
  bool take_one() {
    uint64_t word = claim_.load(std::memory_order_acquire);
    if (generation_of(word) == 0 || next_of(word) >= count_of(word)) return false;
    const Chunk fn = fn_.load(std::memory_order_relaxed);
    const void* context = context_.load(std::memory_order_relaxed);
    const uint32_t csr = csr_.load(std::memory_order_relaxed);
    // fails if anyone claimed meanwhile or another job was published: the fields read above may be another job's.
    // Succeeding, the job of this word still had this chunk left, so the caller was still in it and its fields are
    // the ones read.
    if (!claim_.compare_exchange_strong(word, word + 1, std::memory_order_acq_rel)) return true;
    if ((_mm_getcsr() & ~kCsrFlags) != (csr & ~kCsrFlags)) _mm_setcsr(csr);
    fn(context, next_of(word));
    taken_.fetch_add(1, std::memory_order_relaxed);
    done_.fetch_add(1, std::memory_order_release);
    return true;
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_ = true;
        wake_.wait(lock, [&] {
          return armed_.load(std::memory_order_relaxed) && arm_seq_.load(std::memory_order_relaxed) != seen;
        });
        sleeping_ = false;
        seen = arm_seq_.load(std::memory_order_relaxed);
      }
      auto idle_since = std::chrono::steady_clock::now();
      for (uint32_t spins = 1; armed_.load(std::memory_order_relaxed); ++spins) {
        if (take_one()) {
          idle_since = std::chrono::steady_clock::now();
          continue;
        }
        _mm_pause();
        if (spins % 512 == 0) {
          if (arm_seq_.load(std::memory_order_relaxed) != seen) {  // armed again: a new step, a new idle limit
            seen = arm_seq_.load(std::memory_order_relaxed);
            idle_since = std::chrono::steady_clock::now();
          } else if (std::chrono::steady_clock::now() - idle_since > kIdleLimit) {
            break;  // never disarmed (a step that failed): sleep until the next arm
          }
        }
      }
    }
  }

  std::atomic<bool> armed_{false};
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> arm_seq_{0};
  std::atomic<Chunk> fn_{nullptr};  // the job: written by the caller before it publishes the claim word
  std::atomic<const void*> context_{nullptr};
  std::atomic<uint32_t> csr_{0};
  alignas(64) std::atomic<uint64_t> claim_{0};  // written by both sides on every claim: a cache line of its own
  alignas(64) std::atomic<int64_t> done_{0};    // the helper's finished chunks of the current job
  std::atomic<int64_t> taken_{0};
  alignas(64) std::mutex mutex_;
  std::condition_variable wake_;
  bool sleeping_ = false;     // guarded by mutex_
  bool has_thread_ = false;   // guarded by mutex_: this process's helper thread runs
  pthread_t handle_{};        // guarded by mutex_
  int pinned_away_from_ = -1;  // guarded by mutex_: the CPU the helper was last kept off
};

// Whether a kernel called now shares its work with the helper: armed, and the step runs on one torch thread (a step
// on more leaves its work to OpenMP).
inline bool helper_shares_step() { return StepHelper::instance().armed() && at::get_num_threads() == 1; }

// items(begin, end) over [0, count): in chunks of `per` taken by the caller and the helper when it shares this step,
// else split by at::parallel_for with `grain`.
template <typename F>
void share_or_parallel_for(int64_t count, int64_t per, int64_t grain, const F& items) {
  if (count > per && helper_shares_step()) {
    StepHelper::instance().run((count + per - 1) / per,
                               [&](int64_t chunk) { items(chunk * per, std::min(count, (chunk + 1) * per)); });
  } else {
    at::parallel_for(0, count, grain, items);
  }
}

}  // namespace prefixserve
