// Errors: every failed check throws moe::Error naming the file, line and what was wrong.
// Bad input must produce a message a user can act on, never a silent wrong answer.
//
// Error lines never echo unbounded input: every std::string / std::string_view argument of
// MOE_CHECK / MOE_FAIL is treated as possibly user-given (a key, a value, a path, a flag) and
// is cut to its first kEchoBytes bytes followed by "... (N bytes)" (echo() below: the one
// place that bounds echoed text). Text we compose ourselves and want whole (lists of keys,
// nested error messages) is passed as whole(text). String literals and other const char*
// (e.g. a caught exception's what()) are bounded at kWholeBytes as a backstop against
// third-party messages that quote their input.
#pragma once

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace moe {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

constexpr size_t kEchoBytes = 200;
constexpr size_t kWholeBytes = 16384;

// s itself when at most max_bytes long; else its first max_bytes bytes (not splitting a UTF-8
// sequence) + "... (N bytes)".
std::string echo(std::string_view s, size_t max_bytes = kEchoBytes);

// Marks composed text that an error message should carry whole (up to kWholeBytes).
struct Whole {
  std::string_view text;
};
inline Whole whole(std::string_view text) { return {text}; }

namespace detail {
inline void put(std::ostringstream& out, const std::string& s) { out << echo(s); }
inline void put(std::ostringstream& out, std::string_view s) { out << echo(s); }
inline void put(std::ostringstream& out, const char* s) { out << echo(s ? std::string_view(s) : "(null)", kWholeBytes); }
inline void put(std::ostringstream& out, char* s) { put(out, static_cast<const char*>(s)); }
inline void put(std::ostringstream& out, const Whole& w) { out << echo(w.text, kWholeBytes); }
template <class T> void put(std::ostringstream& out, const T& v) { out << v; }

template <class... Args> std::string concat(const Args&... args) {
  std::ostringstream out;
  (put(out, args), ...);
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
