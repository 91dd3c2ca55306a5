#include <dlfcn.h>
#include <stdio.h>
int main(int argc, char **argv) {
  if (argc != 2) return 2;
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "%s\n", dlerror()); return 90; }
  int (*probe)(void) = (int (*)(void))dlsym(h, "probe");
  return probe ? probe() : 91;
}
