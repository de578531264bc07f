/* drive_probe: the drive's own random 4 KiB read rate, for benchmarks/guard.py.

   usage: drive_probe THREADS SECONDS [--write WFILE MB_PER_S] FILE...

   THREADS threads (the queue depth: one read in flight each) read random 4 KiB pages of
   FILE... (every whole page of every file equally likely, so the reads spread over the
   files as a uniform step's misses do) with pread on O_DIRECT descriptors into page-aligned
   buffers, for SECONDS seconds, then print one line:

       threads 256 seconds 4.000 reads 361234 reads_per_s 90308 direct 1

   "direct 0" where the filesystem refuses O_DIRECT (tmpfs): the reads then went through the
   page cache and the rate says nothing about the drive.

   --write WFILE MB_PER_S: meanwhile one more thread writes WFILE (which must exist; its size
   is the span written, from offset 0 round again) sequentially in 1 MiB O_DIRECT writes, at
   MB_PER_S megabytes (1e6 bytes) a second at most: the reads' rate beside the writes of a run
   that writes too (a log store seals every updated row into a segment). The line then ends
   with "written_mb_per_s W". Python's threads cannot stand in for
   this: 32 of them doing os.pread saturated at ~55k reads/s on a drive that does 91k.
   Built by the guard at run time: cc -O2 -pthread -o drive_probe drive_probe.c */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096

static int nfiles;
static int *fds;
static uint64_t *ends; /* cumulative whole pages: file k holds pages [ends[k-1], ends[k]) */
static uint64_t total_pages;
static atomic_int stop;
static pthread_barrier_t ready;

struct worker {
  pthread_t thread;
  uint64_t state; /* xorshift64 */
  uint64_t reads;
  int err;
};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

static void *run(void *arg) {
  struct worker *w = arg;
  void *buf;
  if (posix_memalign(&buf, PAGE, PAGE) != 0) {
    w->err = ENOMEM;
    pthread_barrier_wait(&ready);
    return NULL;
  }
  pthread_barrier_wait(&ready);
  uint64_t x = w->state;
  while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    uint64_t page = x % total_pages;
    int lo = 0, hi = nfiles - 1; /* the file holding that page */
    while (lo < hi) {
      int mid = (lo + hi) / 2;
      if (page < ends[mid])
        hi = mid;
      else
        lo = mid + 1;
    }
    uint64_t first = lo ? ends[lo - 1] : 0;
    if (pread(fds[lo], buf, PAGE, (off_t)((page - first) * PAGE)) < 0) {
      w->err = errno;
      break;
    }
    w->reads++;
  }
  free(buf);
  return NULL;
}

#define WCHUNK (1 << 20)

struct writer {
  pthread_t thread;
  int fd;
  uint64_t span;     /* bytes of the file written round */
  double rate;       /* bytes per second at most */
  uint64_t written;
  int err;
};

static void *write_run(void *arg) {
  struct writer *w = arg;
  void *buf;
  if (posix_memalign(&buf, PAGE, WCHUNK) != 0) {
    w->err = ENOMEM;
    pthread_barrier_wait(&ready);
    return NULL;
  }
  memset(buf, 0x5a, WCHUNK);
  pthread_barrier_wait(&ready);
  double t0 = now();
  uint64_t off = 0;
  while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
    double due = t0 + (double)w->written / w->rate; /* paced: never ahead of the rate */
    double t = now();
    if (due > t) {
      double d = due - t;
      struct timespec nap = {(time_t)d, (long)((d - (time_t)d) * 1e9)};
      nanosleep(&nap, NULL);
      continue;
    }
    if (off + WCHUNK > w->span)
      off = 0;
    if (pwrite(w->fd, buf, WCHUNK, (off_t)off) < 0) {
      w->err = errno;
      break;
    }
    off += WCHUNK;
    w->written += WCHUNK;
  }
  free(buf);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: drive_probe THREADS SECONDS [--write WFILE MB_PER_S] FILE...\n");
    return 2;
  }
  int threads = atoi(argv[1]);
  double seconds = atof(argv[2]);
  if (threads < 1 || seconds <= 0) {
    fprintf(stderr, "drive_probe: THREADS must be >= 1 and SECONDS > 0\n");
    return 2;
  }
  int first_file = 3;
  struct writer wr = {0};
  int writing = 0;
  if (strcmp(argv[3], "--write") == 0) {
    if (argc < 7 || atof(argv[5]) <= 0) {
      fprintf(stderr, "drive_probe: --write takes a file and a rate in MB/s > 0, then the "
                      "files to read\n");
      return 2;
    }
    wr.fd = open(argv[4], O_WRONLY | O_DIRECT);
    if (wr.fd < 0 && errno == EINVAL)
      wr.fd = open(argv[4], O_WRONLY);
    struct stat st;
    if (wr.fd < 0 || fstat(wr.fd, &st) != 0 || st.st_size < WCHUNK) {
      fprintf(stderr, "drive_probe: %s: %s\n", argv[4],
              wr.fd < 0 ? strerror(errno) : "must exist and hold at least 1 MiB");
      return 1;
    }
    wr.span = (uint64_t)st.st_size / WCHUNK * WCHUNK;
    wr.rate = atof(argv[5]) * 1e6;
    writing = 1;
    first_file = 6;
  }
  nfiles = argc - first_file;
  fds = calloc(nfiles, sizeof *fds);
  ends = calloc(nfiles, sizeof *ends);
  int direct = 1;
  for (int k = 0; k < nfiles; k++) {
    const char *f = argv[first_file + k];
    int fd = open(f, O_RDONLY | O_DIRECT);
    if (fd < 0 && errno == EINVAL) { /* no O_DIRECT on this filesystem: say so */
      direct = 0;
      fd = open(f, O_RDONLY);
    }
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
      fprintf(stderr, "drive_probe: %s: %s\n", f, strerror(errno));
      return 1;
    }
    fds[k] = fd;
    total_pages += (uint64_t)st.st_size / PAGE;
    ends[k] = total_pages;
  }
  if (total_pages == 0) {
    fprintf(stderr, "drive_probe: no whole 4 KiB page in the files\n");
    return 1;
  }
  struct worker *ws = calloc(threads, sizeof *ws);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 1 << 16);
  pthread_barrier_init(&ready, NULL, threads + 1 + writing);
  uint64_t seed = splitmix((uint64_t)getpid() ^ (uint64_t)(now() * 1e9));
  for (int k = 0; k < threads; k++) {
    ws[k].state = splitmix(seed + k) | 1;
    if (pthread_create(&ws[k].thread, &attr, run, &ws[k]) != 0) {
      fprintf(stderr, "drive_probe: cannot start thread %d\n", k);
      return 1;
    }
  }
  if (writing && pthread_create(&wr.thread, &attr, write_run, &wr) != 0) {
    fprintf(stderr, "drive_probe: cannot start the writing thread\n");
    return 1;
  }
  pthread_barrier_wait(&ready); /* every thread started: the clock runs from here */
  double t0 = now();
  struct timespec nap = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
  while (nanosleep(&nap, &nap) != 0 && errno == EINTR) {
  }
  atomic_store(&stop, 1);
  double dt = now() - t0;
  uint64_t reads = 0;
  int err = 0;
  for (int k = 0; k < threads; k++) {
    pthread_join(ws[k].thread, NULL);
    reads += ws[k].reads;
    if (ws[k].err)
      err = ws[k].err;
  }
  if (err) {
    fprintf(stderr, "drive_probe: read failed: %s\n", strerror(err));
    return 1;
  }
  if (writing) {
    pthread_join(wr.thread, NULL);
    if (wr.err) {
      fprintf(stderr, "drive_probe: write failed: %s\n", strerror(wr.err));
      return 1;
    }
  }
  printf("threads %d seconds %.3f reads %llu reads_per_s %.0f direct %d", threads, dt,
         (unsigned long long)reads, reads / dt, direct);
  if (writing)
    printf(" written_mb_per_s %.1f", wr.written / dt / 1e6);
  printf("\n");
  return 0;
}
