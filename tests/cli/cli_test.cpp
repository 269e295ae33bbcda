// The command line: every command's --help / -h prints its usage and options and exits 0;
// unknown options, missing values and bad numbers are errors naming the option; --version; and
// no error line echoes more than ~200 bytes of what the user typed.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/cli_util.h"

namespace moe {
namespace {
using test::run_cli;

struct CommandHelp {
  std::string command;
  std::vector<std::string> options;  // each must appear in the command's help
};

const std::vector<CommandHelp>& commands() {
  static const std::vector<CommandHelp> all = {
      {"train", {"--config", "--set", "--resume"}},
      {"config", {"--config", "--set", "--reference"}},
      {"prepare", {"--input", "--out"}},
      {"eval", {"--checkpoint", "--batches", "--set"}},
      {"generate", {"--checkpoint", "--prompt", "--max-tokens", "--temperature", "--top-k", "--seed"}},
      {"export-hf", {"--from", "--checkpoint", "--out", "--dtype", "--config", "--set"}},
      {"import-hf", {"--from", "--out"}},
      {"bench", {"--config", "--set", "--warmup", "--steps"}},
  };
  return all;
}

TEST(Cli, EveryCommandPrintsItsHelpAndExitsZero) {
  for (const CommandHelp& c : commands())
    for (const char* flag : {"--help", "-h"}) {
      SCOPED_TRACE(c.command + " " + flag);
      const test::CliResult r = run_cli(c.command + " " + flag);
      EXPECT_EQ(r.status, 0) << r.output;
      EXPECT_NE(r.output.find("Usage:"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find(c.command), std::string::npos) << r.output;
      for (const std::string& o : c.options) EXPECT_NE(r.output.find(o), std::string::npos) << o << " in " << r.output;
      EXPECT_EQ(r.output.find("error"), std::string::npos) << r.output;
    }
  // --help after other options still helps (and does not run the command).
  const test::CliResult late = run_cli("train --set train.steps=1000000 --help");
  EXPECT_EQ(late.status, 0) << late.output;
  EXPECT_NE(late.output.find("--resume"), std::string::npos) << late.output;
}

TEST(Cli, TopLevelHelpListsEveryCommand) {
  for (const char* args : {"--help", "-h", "help"}) {
    SCOPED_TRACE(args);
    const test::CliResult r = run_cli(args);
    EXPECT_EQ(r.status, 0) << r.output;
    for (const CommandHelp& c : commands()) EXPECT_NE(r.output.find(c.command), std::string::npos) << c.command;
  }
  const test::CliResult none = run_cli("");
  EXPECT_EQ(none.status, 1) << "no command is a usage error: " << none.output;
  EXPECT_NE(none.output.find("Usage:"), std::string::npos) << none.output;
}

TEST(Cli, VersionNamesTheReleaseAndCommit) {
  const test::CliResult r = run_cli("--version");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.rfind("moecore 0.", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("(git "), std::string::npos) << r.output;
}

TEST(Cli, BadOptionsAreErrorsNamingTheOption) {
  struct Case {
    std::string args, must_say;
  };
  const std::vector<Case> cases = {
      {"train --bogus", "--bogus"},
      {"eval --checkpoint x --batches abc", "--batches"},
      {"eval --checkpoint x --batches -3", "--batches"},
      {"generate --checkpoint x --prompt hi --temperature hot", "--temperature"},
      {"generate --checkpoint x --prompt hi --max-tokens 0", "--max-tokens"},
      {"bench --steps 0", "--steps"},
      {"export-hf --from a --checkpoint b --out c", "--checkpoint"},
      {"export-hf --from a --out c --dtype f16", "--dtype"},
      {"prepare --input x", "--out"},
      {"eval", "--checkpoint"},
      {"train --config", "--config"},
      {"frobnicate", "unknown command 'frobnicate'"},
      {"train extra_word", "extra_word"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const test::CliResult r = run_cli(c.args);
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("moecore: error:"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(c.must_say), std::string::npos) << r.output;
  }
}

TEST(Cli, ErrorLinesEchoAtMostAboutTwoHundredBytesOfInput) {
  // 100 KB (command-line arguments are limited to 128 KiB each): unknown option, unknown
  // command, unknown key, a bad value, a path.
  const std::string big(100000, 'k');
  const std::vector<std::string> cases = {
      "train --" + big,
      big,
      "config --set model." + big + "=1",
      "config --set train.precision=" + big,
      "config --set model.d_model=" + big,
      "config --config /nonexistent/" + big,
  };
  for (const std::string& args : cases) {
    SCOPED_TRACE(args.substr(0, 40));
    const test::CliResult r = run_cli(args);
    EXPECT_EQ(r.status, 1) << r.output.substr(0, 400);
    EXPECT_LT(r.output.size(), 1200u) << r.output.substr(0, 400);
    EXPECT_NE(r.output.find("... ("), std::string::npos) << r.output.substr(0, 400);
    EXPECT_NE(r.output.find(" bytes)"), std::string::npos) << r.output.substr(0, 400);
  }
}

}  // namespace
}  // namespace moe
