/* Prints the page size a program sees (sysconf), so a test can show which page size an emulated
 * run had (qemu-aarch64 -p 65536 reports 64 KiB pages, as Kunpeng kernels often use). */
#include <stdio.h>
#include <unistd.h>

int main(void) {
  printf("page_size=%ld\n", sysconf(_SC_PAGESIZE));
  return 0;
}
