// Borrowed cores: a GEMM's output groups split between the calling thread and helper threads
// on cores the model does not own, where the helpers may be preempted at any time.
//
// On a 2-core node the CPU split (worker/cpu_affinity.py) gives the model one core and the
// serving path (Ray's proxy, the ingress, the engine replica) the other, which the serving
// path leaves about half idle at one stream. torch's intra-op threads cannot use that half:
// at::parallel_for splits a GEMM evenly and waits for every part, so a thread the serving
// path preempts stalls the whole step (two threads across both cores did worse than one).
// Here the work is handed out in chunks from a shared counter, and the calling thread never
// waits for a helper that does not run:
//
//   chunk state   kFree ──helper commits──▶ kCommitting ──▶ kDone
//                   └────caller steals────▶ kStolen (the caller computes it itself)
//
// The caller computes its own chunks into y. A helper computes a chunk into scratch of its
// own and copies it into y only if it wins the chunk's state (kFree -> kCommitting); once
// the counter is spent, the caller gives a helper's chunk a short wait (twice its own mean
// chunk time), then steals it. Every chunk is computed by the same code whoever runs it, so
// the result is bit-identical to one thread's. A late helper may still read the job after
// the call returned: a Job owns copies of its inputs (shared_ptr), and a helper writes y
// only from kCommitting, which no chunk can reach after the caller returned.
//
// Helpers spin (pause) for a while after a job, then sleep on a condition variable; the
// caller wakes them when it posts a job. They run at SCHED_IDLE (or a nice value): the
// serving path preempts them the moment it wakes.
#ifndef PAGEDSERVE_CPU_BORROWED_CORES_H
#define PAGEDSERVE_CPU_BORROWED_CORES_H

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace borrowed {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

enum : uint8_t { kFree = 0, kCommitting = 1, kDone = 2, kStolen = 3 };

// Units [0, units) of `width` output columns each (the last may be partial: `cols` columns
// in all), M rows `ldy` apart in y. compute() writes units [u0, u1) into out, unit u at
// out + u * width, rows ldo apart.
struct Job {
  int64_t units = 0, width = 0, cols = 0, M = 0, ldy = 0, chunk = 1, chunks = 0;
  float* y = nullptr;
  std::atomic<int64_t> next{0};
  std::unique_ptr<std::atomic<uint8_t>[]> state;
  virtual ~Job() = default;
  virtual void compute(int64_t u0, int64_t u1, float* out, int64_t ldo) = 0;

  void plan(int64_t chunk_units) {
    chunk = std::max<int64_t>(1, chunk_units);
    chunks = (units + chunk - 1) / chunk;
    state.reset(new std::atomic<uint8_t>[chunks]);
    for (int64_t c = 0; c < chunks; ++c) state[c].store(kFree, std::memory_order_relaxed);
  }
  int64_t begin(int64_t c) const { return c * chunk; }
  int64_t end(int64_t c) const { return std::min(units, (c + 1) * chunk); }
};

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: its threads may outlive static destructors
    return *pool;
  }

  // Helpers on `cores` (one thread each); policy "idle" (SCHED_IDLE) or a nice value.
  // An empty list stops them. Returns how many run, once each has placed itself (its core
  // and policy set: a caller that looks at them next sees them placed).
  int64_t configure(const std::vector<int64_t>& cores, bool idle, int64_t nice, int64_t spin_us) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    stop_all();
    stop_.store(false);
    spin_us_ = spin_us;
    placed_.store(0);
    for (int64_t core : cores) threads_.emplace_back([this, core, idle, nice] { loop(core, idle, nice); });
    while (placed_.load() < static_cast<int64_t>(threads_.size())) std::this_thread::yield();
    cores_ = cores;
    return static_cast<int64_t>(threads_.size());
  }
  std::vector<int64_t> cores() const { return cores_; }
  int64_t helpers() const { return static_cast<int64_t>(threads_.size()); }
  int64_t stolen() const { return stolen_.load(std::memory_order_relaxed); }
  int64_t helped() const { return helped_.load(std::memory_order_relaxed); }

  // Runs `job` with the helpers; false (nothing done) when there are none or another call
  // is running (the caller then runs it its own way).
  bool run(const std::shared_ptr<Job>& job) {
    if (threads_.empty() || job->chunks == 0) return false;
    std::unique_lock<std::mutex> run_lock(run_mu_, std::try_to_lock);
    if (!run_lock.owns_lock() || threads_.empty()) return false;
    publish(job);
    std::vector<uint8_t> mine(static_cast<size_t>(job->chunks), 0);
    using clock = std::chrono::steady_clock;
    int64_t own = 0;
    clock::duration own_time{0};
    for (;;) {
      const int64_t c = job->next.fetch_add(1, std::memory_order_relaxed);
      if (c >= job->chunks) break;
      mine[c] = 1;
      const auto t0 = clock::now();
      job->compute(job->begin(c), job->end(c), job->y, job->ldy);
      own_time += clock::now() - t0;
      ++own;
    }
    const clock::duration patience =
        own ? 2 * own_time / own + std::chrono::microseconds(2) : clock::duration(std::chrono::microseconds(20));
    for (int64_t c = 0; c < job->chunks; ++c) {
      if (mine[c]) continue;
      std::atomic<uint8_t>& s = job->state[c];
      const auto deadline = clock::now() + patience;
      while (s.load(std::memory_order_acquire) == kFree && clock::now() < deadline) cpu_relax();
      uint8_t expect = kFree;
      if (s.compare_exchange_strong(expect, kStolen, std::memory_order_acq_rel)) {
        job->compute(job->begin(c), job->end(c), job->y, job->ldy);
        stolen_.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      while (s.load(std::memory_order_acquire) != kDone) cpu_relax();  // a copy under way
      helped_.fetch_add(1, std::memory_order_relaxed);
    }
    return true;  // job_ keeps the spent job until the next one: no helper can write y now
  }

 private:
  Pool() = default;

  void publish(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard<std::mutex> lock(job_mu_);
      job_ = job;
    }
    gen_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      sleep_cv_.notify_all();
    }
  }

  void stop_all() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      sleep_cv_.notify_all();
    }
    for (auto& t : threads_) t.join();
    threads_.clear();
    cores_.clear();
  }

  static void place(int64_t core, bool idle, int64_t nice) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(core), &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    if (idle) {
      sched_param p{};
      p.sched_priority = 0;
      if (sched_setscheduler(0, SCHED_IDLE, &p) == 0) return;  // Linux: the calling thread
    }
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), static_cast<int>(idle ? 19 : nice));
  }

  void loop(int64_t core, bool idle, int64_t nice) {
    place(core, idle, nice);
    placed_.fetch_add(1);
    std::vector<float> scratch;
    uint64_t seen = gen_.load();
    using clock = std::chrono::steady_clock;
    while (!stop_.load(std::memory_order_relaxed)) {
      const uint64_t g = gen_.load(std::memory_order_acquire);
      if (g == seen) {
        const auto until = clock::now() + std::chrono::microseconds(spin_us_);
        while (gen_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed) &&
               clock::now() < until)
          for (int i = 0; i < 32; ++i) cpu_relax();
        if (gen_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed)) {
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          std::unique_lock<std::mutex> lock(sleep_mu_);
          sleep_cv_.wait(lock, [&] { return gen_.load(std::memory_order_seq_cst) != seen || stop_.load(); });
          sleeping_.fetch_sub(1, std::memory_order_seq_cst);
        }
        continue;
      }
      seen = g;
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(job_mu_);
        job = job_;
      }
      if (job) work(*job, scratch);
    }
  }

  static void work(Job& job, std::vector<float>& scratch) {
    for (;;) {
      const int64_t c = job.next.fetch_add(1, std::memory_order_relaxed);
      if (c >= job.chunks) return;
      const int64_t u0 = job.begin(c), u1 = job.end(c);
      const int64_t ldo = (u1 - u0) * job.width;
      if (scratch.size() < static_cast<size_t>(job.M * ldo)) scratch.resize(static_cast<size_t>(job.M * ldo));
      // unit u at scratch + (u - u0) * width: the base pointer the compute call offsets by u * width
      float* base = reinterpret_cast<float*>(reinterpret_cast<uintptr_t>(scratch.data()) -
                                             static_cast<uintptr_t>(u0 * job.width) * sizeof(float));
      job.compute(u0, u1, base, ldo);
      uint8_t expect = kFree;
      if (!job.state[c].compare_exchange_strong(expect, kCommitting, std::memory_order_acq_rel)) continue;
      const int64_t n = std::min(job.cols, u1 * job.width) - u0 * job.width;
      for (int64_t m = 0; m < job.M; ++m)
        std::memcpy(job.y + m * job.ldy + u0 * job.width, scratch.data() + m * ldo, static_cast<size_t>(n) * sizeof(float));
      job.state[c].store(kDone, std::memory_order_release);
    }
  }

  std::vector<std::thread> threads_;
  std::vector<int64_t> cores_;
  int64_t spin_us_ = 200;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<int64_t> stolen_{0}, helped_{0}, placed_{0};
  std::mutex run_mu_, job_mu_, sleep_mu_;
  std::condition_variable sleep_cv_;
  std::shared_ptr<Job> job_;
};

}  // namespace borrowed

#endif  // PAGEDSERVE_CPU_BORROWED_CORES_H
