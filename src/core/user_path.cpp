#include "core/user_path.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/check.h"

namespace moe {
namespace {

const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISREG(m)) return "a regular file";
  return "not a regular file";
}

// stat(path), or a line naming what is wrong when it fails (missing, dangling link, ...).
struct stat stat_or_fail(const std::string& path, std::string_view what) {
  MOE_CHECK(!path.empty(), what, ": the path is empty");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return st;
  const int err = errno;
  struct stat lst {};
  if (::lstat(path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode)) {
    std::vector<char> target(4096, '\0');
    const ssize_t n = ::readlink(path.c_str(), target.data(), target.size() - 1);
    MOE_FAIL(what, " '", path, "' is a dangling symbolic link (to '", std::string(target.data(), n > 0 ? static_cast<size_t>(n) : 0),
             "': ", std::strerror(err), ")");
  }
  if (err == ENOENT) MOE_FAIL(what, " '", path, "' does not exist");
  MOE_FAIL(what, " '", path, "': ", std::strerror(err));
}

}  // namespace

void check_input_file(const std::string& path, std::string_view what, bool allow_empty) {
  const struct stat st = stat_or_fail(path, what);
  MOE_CHECK(S_ISREG(st.st_mode), what, " '", path, "' is ", kind_of(st.st_mode), ", not a regular file");
  MOE_CHECK(::access(path.c_str(), R_OK) == 0, what, " '", path, "' is not readable: ", std::strerror(errno));
  MOE_CHECK(allow_empty || st.st_size > 0, what, " '", path, "' is empty");
}

void check_input_dir(const std::string& path, std::string_view what) {
  const struct stat st = stat_or_fail(path, what);
  MOE_CHECK(S_ISDIR(st.st_mode), what, " '", path, "' is ", kind_of(st.st_mode), ", not a directory");
}

bool path_entry_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

std::string read_input_file(const std::string& path, std::string_view what, bool allow_empty) {
  check_input_file(path, what, allow_empty);
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), what, " '", path, "': cannot open: ", std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  MOE_CHECK(!in.bad(), what, " '", path, "': read failed");
  return ss.str();
}

}  // namespace moe
