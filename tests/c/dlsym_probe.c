/* Loaded RTLD_LOCAL by dlsym_probe_main: checks that RTLD_NEXT and RTLD_DEFAULT lookups made by a
 * library that is not preloaded resolve relative to *this* library, with or without the hook's
 * dlsym interposer in front of glibc's. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

int probe_local_marker(void) { return 42; }

int probe(void) {
  void *libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
  void *real_getpid = libc ? dlsym(libc, "getpid") : NULL;
  void *next_getpid = dlsym(RTLD_NEXT, "getpid");
  /* Found only through this library's own (local) scope. */
  int (*marker)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "probe_local_marker");
  void *next_marker = dlsym(RTLD_NEXT, "probe_local_marker");
  int ok = next_getpid != NULL && next_getpid == real_getpid && marker && marker() == 42 && next_marker == NULL;
  printf("next_getpid_ok=%d default_local_ok=%d next_marker_null=%d %s\n",
         next_getpid != NULL && next_getpid == real_getpid, marker && marker() == 42, next_marker == NULL,
         ok ? "ok" : "BROKEN");
  return ok ? 0 : 1;
}
