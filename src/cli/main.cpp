// moecore command-line entry point.
#include <cstdio>

int main() {
  std::puts("moecore: commands are being built");
  return 0;
}
