// A model of the one-exchange path on two processes, without fastxfer: each rank copies its input
// into its slot of a double-buffered shared mapping, bumps its counter, waits for the peer's and
// reduces both contributions into its output. Separates what the machine costs from what the
// engine adds (bench/RESULTS.md, "sixteenth session").
//
//   g++ -O2 -mclflushopt -o eager_model eager_model.cc
//   ./eager_model BYTES ITERS MODE [NBUF]
//
// MODE 0: regular stores into the slot; 1: non-temporal stores (what pack_for_peers does);
// 2: regular stores, and the reader flushes the peer's lines after reading them;
// 3: reduce-scatter + allgather through a shared result buffer (two waits).
// Both ranks read their own part from their input. Prints the median of 5 x ITERS calls.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>
struct alignas(64) Ctr { std::atomic<long> v; char pad[56]; };
__attribute__((target("avx2"))) static void nt_copy(float* d, const float* s, size_t n) {
  for (size_t k = 0; k < n; k += 8) _mm256_stream_ps(d + k, _mm256_loadu_ps(s + k));
  _mm_sfence();
}
int main(int argc, char** argv) {
  size_t bytes = atol(argv[1]); int iters = atoi(argv[2]); int mode = atoi(argv[3]); int nbuf = argc > 4 ? atoi(argv[4]) : 2;
  size_t n = bytes / 4;
  char* mem = static_cast<char*>(mmap(nullptr, 4096 + 2 * nbuf * bytes + 2 * bytes + 8192, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  Ctr* ctr = reinterpret_cast<Ctr*>(mem);
  ctr[0].v = 0; ctr[1].v = 0; ctr[2].v = 0; ctr[3].v = 0;
  auto slot = [&](int r, int buf) { return reinterpret_cast<float*>(mem + 4096 + (nbuf * r + buf) * bytes); };
  auto res = [&](int buf) { return reinterpret_cast<float*>(mem + 4096 + 2 * nbuf * bytes + buf * bytes); };
  pid_t child = fork();
  int me = child == 0 ? 1 : 0;
  cpu_set_t s; CPU_ZERO(&s); CPU_SET(me, &s); sched_setaffinity(0, sizeof s, &s);
  std::vector<float> in(n, 1.0f + me), out(n);
  std::vector<double> per;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) {
      long round = (long)rep * iters + i;
      int buf = round % nbuf;
      if (mode == 3) {  // reduce-scatter + allgather through a shared result buffer
        std::memcpy(slot(me, buf), in.data(), bytes);
        ctr[me].v.store(2 * round + 1, std::memory_order_release);
        while (ctr[1 - me].v.load(std::memory_order_acquire) < 2 * round + 1) __builtin_ia32_pause();
        size_t h = n / 2, lo = me * h;
        const float* a = slot(0, buf); const float* b = slot(1, buf); float* r = res(round & 1);
        for (size_t k = lo; k < lo + h; ++k) r[k] = (a[k] + b[k]) * 0.5f;
        std::memcpy(out.data() + lo, r + lo, h * 4);
        ctr[me].v.store(2 * round + 2, std::memory_order_release);
        while (ctr[1 - me].v.load(std::memory_order_acquire) < 2 * round + 2) __builtin_ia32_pause();
        size_t olo = (1 - me) * h;
        std::memcpy(out.data() + olo, r + olo, h * 4);
        continue;
      }
      if (mode == 1) nt_copy(slot(me, buf), in.data(), n); else std::memcpy(slot(me, buf), in.data(), bytes);
      ctr[me].v.store(round + 1, std::memory_order_release);
      while (ctr[1 - me].v.load(std::memory_order_acquire) < round + 1) __builtin_ia32_pause();
      const float* a = in.data(); const float* b = slot(1 - me, buf);
      for (size_t k = 0; k < n; ++k) out[k] = (a[k] + b[k]) * 0.5f;
      if (mode == 2) { for (size_t k = 0; k < n; k += 16) _mm_clflushopt((void*)(b + k)); }
    }
    per.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  if (child) { waitpid(child, nullptr, 0); std::sort(per.begin(), per.end());
    printf("%6zu B mode=%d nbuf=%d: median %.3f us (min %.3f max %.3f) out[0]=%g\n", bytes, mode, nbuf, per[2], per[0], per[4], out[0]); }
  else _exit(0);
}
