/* Entry point for consumers linked directly (or through dlsym) into the executable. */
int tms_test_main(int argc, char **argv);
int main(int argc, char **argv) { return tms_test_main(argc, argv); }
