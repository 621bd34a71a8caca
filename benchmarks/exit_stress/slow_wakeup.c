// LD_PRELOAD shim for benchmarks/exit_stress/stress.py --slow-gloo. Every thread but the main one sleeps 2 ms
// before it takes a mutex: a gloo worker that has finished a collective then takes 2 ms more before it
// releases the work object (its tensors), while the main thread, not slowed, returns from the collective and
// may already be leaving the interpreter: the window of the exit race, made wide.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int (*real_lock)(pthread_mutex_t *) = 0;

int pthread_mutex_lock(pthread_mutex_t *mutex) {
    if (!real_lock) real_lock = dlsym(RTLD_NEXT, "pthread_mutex_lock");
    if (syscall(SYS_gettid) != getpid()) {
        struct timespec pause = {0, 2000000};
        nanosleep(&pause, 0);
    }
    return real_lock(mutex);
}
