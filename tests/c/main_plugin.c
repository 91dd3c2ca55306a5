/* Loads a consumer built as a shared library with dlopen(RTLD_LOCAL), the way Python loads
 * extension modules, so the vendor runtime is only in that library's local scope.
 * Usage: loader PLUGIN.so MODE [ARGS] */
#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
  if (argc < 2) { fprintf(stderr, "usage: loader PLUGIN MODE...\n"); return 2; }
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror()); return 90; }
  int (*entry)(int, char **) = (int (*)(int, char **))dlsym(h, "tms_test_main");
  if (!entry) { fprintf(stderr, "no tms_test_main in %s\n", argv[1]); return 91; }
  return entry(argc - 1, argv + 1);
}
