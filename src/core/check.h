// Errors: every failed check throws moe::Error naming the file, line and what was wrong.
// Bad input must produce a message a user can act on, never a silent wrong answer.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moe {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Args> std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
[[noreturn]] void fail(const char* file, int line, const std::string& message);
}  // namespace detail

}  // namespace moe

#define MOE_CHECK(cond, ...)                                                      \
  do {                                                                            \
    if (!(cond)) ::moe::detail::fail(__FILE__, __LINE__, ::moe::detail::concat(__VA_ARGS__)); \
  } while (0)

#define MOE_FAIL(...) ::moe::detail::fail(__FILE__, __LINE__, ::moe::detail::concat(__VA_ARGS__))
