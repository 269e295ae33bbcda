// The run report's data side: the streaming envelopes against brute force, read_run on broken
// input (its exact notices), labels of differing runs, and the size and write time of a page for
// a 10^6-step run with 64-expert vectors. The page itself is tested in Chromium
// (tools/report_browser_test.py, label browser).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "report/envelope.h"
#include "report/live_report.h"
#include "report/report_html.h"
#include "report/run_report.h"

namespace moe::report {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("moecore_report_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(Envelope, BucketsHoldEachRangesTrueMinimumAndMaximum) {
  std::mt19937 rng(7);
  std::normal_distribution<double> noise(0, 1);
  Envelope e(50);
  std::vector<double> y;
  const int64_t n = 100000, spike = 61234;
  for (int64_t s = 1; s <= n; ++s) {
    y.push_back(s == spike ? 1e3 : noise(rng));
    e.add({s, 4096.0 * static_cast<double>(s), 0.5 * static_cast<double>(s)}, y.back());
  }
  EXPECT_LE(e.buckets().size(), 100u);
  EXPECT_GE(e.buckets().size(), 50u);
  const int64_t w = e.width();
  for (const Bucket& b : e.buckets()) {
    double lo = INFINITY, hi = -INFINITY, sum = 0;
    int64_t count = 0;
    for (int64_t s = std::max<int64_t>(1, b.key * w); s < (b.key + 1) * w && s <= n; ++s) {
      lo = std::min(lo, y[static_cast<size_t>(s - 1)]);
      hi = std::max(hi, y[static_cast<size_t>(s - 1)]);
      sum += y[static_cast<size_t>(s - 1)];
      ++count;
    }
    EXPECT_EQ(b.lo.y, lo);
    EXPECT_EQ(b.hi.y, hi);
    EXPECT_EQ(b.count, count);
    EXPECT_NEAR(b.sum, sum, 1e-9 * count);
    EXPECT_EQ(b.lo.at.tokens, 4096.0 * static_cast<double>(b.lo.at.step));
    EXPECT_EQ(y[static_cast<size_t>(b.hi.at.step - 1)], b.hi.y);
  }
  EXPECT_EQ(e.stats().max, 1e3);
  EXPECT_EQ(e.stats().max_step, spike);
  EXPECT_EQ(e.stats().count, n);
}

TEST(Envelope, CountsNonFiniteValuesWithoutDrawingThem) {
  Envelope e(10);
  e.add({1, 1, 1}, 2.0);
  e.add({2, 2, 2}, std::nan(""));
  e.add({3, 3, 3}, INFINITY);
  e.add({4, 4, 4}, 1.0);
  EXPECT_EQ(e.stats().count, 2);
  EXPECT_EQ(e.stats().nonfinite, 2);
  ASSERT_EQ(e.buckets().size(), 2u);
  EXPECT_EQ(e.buckets()[1].lo.at.step, 4);
  EXPECT_THROW(e.add({4, 4, 4}, 3.0), std::exception);  // steps must increase
}

TEST(VectorColumns, ColumnsAverageTheTokenFractions) {
  VectorColumns v(2);
  for (int64_t s = 1; s <= 40; ++s) v.add(s, {static_cast<double>(s), 0, 0, 100.0 - static_cast<double>(s)}, {0.25, 0.25, 0.25, 0.25});
  ASSERT_LE(v.columns().size(), 4u);
  int64_t records = 0;
  for (const VectorColumn& c : v.columns()) {
    double f0 = 0;
    for (int64_t s = c.first_step; s <= c.last_step; ++s) f0 += static_cast<double>(s) / 100.0;
    EXPECT_NEAR(c.f_sum[0], f0, 1e-12);
    EXPECT_NEAR(c.p_sum[3], 0.25 * static_cast<double>(c.count), 1e-12);
    records += c.count;
  }
  EXPECT_EQ(records, 40);
}

std::string record(int64_t step, const std::string& loss, bool moe = true) {
  std::string r = "{\"ce\":" + loss + ",\"elapsed_s\":" + std::to_string(step) + ",\"grad_norm\":1.5,\"loss\":" + loss +
                  ",\"lr\":0.001,\"step\":" + std::to_string(step) + ",\"tokens\":100";
  if (moe) r += ",\"lbl\":[1.0,1.1],\"max_load\":[1.5,2.5],\"f\":[[1,3],[2,2]],\"P\":[[0.4,0.6],[0.5,0.5]]";
  return r + "}";
}

bool has_notice(const RunReport& r, const std::string& text) {
  for (const auto& n : r.notices())
    if (n.find(text) != std::string::npos) return true;
  return false;
}

TEST(ReadRun, BrokenInputIsSkippedAndStatedExactly) {
  const fs::path d = fresh_dir("broken");
  {
    std::ofstream m(d / "metrics.jsonl");
    m << record(1, "2.5") << "\n" << record(2, "\"nan\"") << "\n" << "{not json, \"step\":3}\n"
      << record(3, "2.25") << "\n" << record(2, "2.4") << "\n" << "\n" << "{\"no\":\"step\"}\n"
      << record(4, "\"inf\"") << "\n" << record(5, "2.0");  // no newline: truncated
  }
  const RunReport r = read_run(d.string());
  for (const auto& n : r.notices()) std::cout << "notice: " << n << "\n";
  EXPECT_TRUE(has_notice(r, "truncated line 9"));
  EXPECT_TRUE(has_notice(r, "2 repeated steps replaced"));  // step 2 twice, step 3 twice (first not JSON)
  EXPECT_TRUE(has_notice(r, "line 7 skipped (no \"step\")"));
  EXPECT_TRUE(has_notice(r, "config.toml: not found"));
  EXPECT_EQ(r.records(), 4);  // steps 1-4; the truncated step 5 is not one
  const std::string ce_key = "ce";
  const SeriesStats& ce = r.series().at(ce_key).stats();
  EXPECT_EQ(ce.count, 3);      // 2.5, 2.4 (step 2's later record), 2.25
  EXPECT_EQ(ce.nonfinite, 1);  // step 4: "inf"
  EXPECT_EQ(ce.min, 2.25);
  EXPECT_EQ(r.series().at("ce").buckets()[1].lo.y, 2.4);
  EXPECT_EQ(r.moe_layers(), 2);
  EXPECT_EQ(r.vectors().size(), 2u);
  fs::remove_all(d);
}

TEST(ReadRun, ANotJsonLineStatedWhenNoLaterRecordReplacesIt) {
  const fs::path d = fresh_dir("notjson");
  {
    std::ofstream m(d / "metrics.jsonl");
    m << record(1, "2.5", false) << "\n{\"step\":2, broken\n" << record(3, "2.0", false) << "\n";
  }
  const RunReport r = read_run(d.string());
  EXPECT_TRUE(has_notice(r, "line 2 skipped (not a JSON record)"));
  EXPECT_TRUE(has_notice(r, "no MoE layers: the load-balance plots are not drawn"));
  EXPECT_EQ(r.records(), 2);
  EXPECT_EQ(r.moe_layers(), 0);
  fs::remove_all(d);
}

TEST(ReadRun, ADirectoryWithoutRunFilesIsAnErrorNamingIt) {
  const fs::path d = fresh_dir("empty");
  try {
    read_run(d.string());
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(d.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_run((d / "missing").string()), std::exception);
  fs::remove_all(d);
}

TEST(RunLabels, NameTheConfigKeysThatDiffer) {
  RunReport a("runs/a"), b("runs/b/");
  a.set_config({{"optim.lr", "0.001"}, {"train.out_dir", "runs/a"}, {"model.d_model", "64"}});
  b.set_config({{"optim.lr", "0.002"}, {"train.out_dir", "runs/b"}, {"model.d_model", "64"}, {"parallel.ep", "2"}});
  const auto labels = run_labels({&a, &b});
  EXPECT_EQ(labels[0], "a (optim.lr=0.001, parallel.ep=(unset))");
  EXPECT_EQ(labels[1], "b (optim.lr=0.002, parallel.ep=2)");
  EXPECT_EQ(run_labels({&a})[0], "a");
}

TEST(ReportPage, AMillionStepsWith64ExpertVectorsStayUnderFiveMegabytes) {
  // Four MoE layers, vectors every 100 steps, a spike at one step: fed as the trainer feeds it.
  const fs::path d = fresh_dir("million");
  std::ofstream(d / "events.jsonl") << "{\"event\":\"start\",\"version\":\"test\"}\n";
  LiveReport live(d.string(), true);
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> u(0, 1);
  const int64_t n = 1000000, layers = 4, experts = 64;
  nlohmann::json rec = {{"tokens", 4096}, {"lr", 1e-3}, {"clipped", false}};
  std::vector<double> lbl(layers), load(layers), cv(layers);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 1; s <= n; ++s) {
    rec["step"] = s;
    rec["ce"] = s == 777777 ? 50.0 : 3.0 - 1e-6 * static_cast<double>(s) + 0.01 * u(rng);
    rec["loss"] = rec["ce"].get<double>() + 0.01;
    rec["grad_norm"] = 0.5 + 0.1 * u(rng);
    rec["tokens_per_s"] = 1e5 * (1 + 0.05 * u(rng));
    rec["elapsed_s"] = 0.04 * static_cast<double>(s);
    for (int64_t l = 0; l < layers; ++l) lbl[l] = 1 + 0.01 * u(rng), load[l] = 1.2 + u(rng), cv[l] = 0.1 * u(rng);
    rec["lbl"] = lbl;
    rec["max_load"] = load;
    rec["load_cv"] = cv;
    if (s % 100 == 0) {
      std::vector<std::vector<int64_t>> f(layers, std::vector<int64_t>(experts));
      std::vector<std::vector<double>> p(layers, std::vector<double>(experts));
      for (auto& row : f) for (auto& x : row) x = static_cast<int64_t>(1000 * u(rng));
      for (auto& row : p) for (auto& x : row) x = u(rng) / experts;
      rec["f"] = f;
      rec["P"] = p;
    } else if (rec.contains("f")) {
      rec.erase("f");
      rec.erase("P");
    }
    live.record(rec);
  }
  const double feed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto t1 = std::chrono::steady_clock::now();
  const std::string line = live.write();
  const double write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const auto bytes = fs::file_size(d / "report.html");
  std::cout << line << "\n" << n << " records fed in " << feed_s << " s; page " << bytes << " bytes written in " << write_s << " s\n";
  EXPECT_LE(bytes, 5u * 1000 * 1000);
  EXPECT_LT(write_s, 1.0);  // train writes it at every checkpoint
  const std::string page = [&] {
    std::ifstream in(d / "report.html");
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }();
  EXPECT_NE(page.find("downsampled for drawing: 1000000 steps"), std::string::npos);
  EXPECT_EQ(page.find("/*MOECORE_REPORT"), std::string::npos);  // every marker replaced
  fs::remove_all(d);
}

}  // namespace
}  // namespace moe::report
