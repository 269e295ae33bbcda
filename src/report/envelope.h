// Streaming downsampling for the run report: a series of any length is kept as at most 2 x
// `target` buckets of equal width in steps (a power of two that doubles as the run grows). Each
// bucket keeps its lowest and highest point (so a one-step spike in a 10^6-step run is still
// drawn), its mean and count (for smoothing) and where it ends. Memory is bounded by the target,
// not the run, so `moecore train` can feed every step and write the page in microseconds.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

namespace moe::report {

// Where a step lies on the three x-axes the page offers.
struct Position {
  int64_t step = 0;
  double tokens = 0;  // tokens trained through this step (summed over the run's records)
  double wall_s = 0;  // elapsed_s: training seconds stitched across resumes
};

struct Point {
  Position at;
  double y = 0;
};

struct Bucket {
  int64_t key = 0;  // step / width
  Point lo, hi;     // the minimum and the maximum (the earlier point on ties)
  Point last;       // the bucket's latest point (where its mean is drawn)
  double sum = 0;
  int64_t count = 0;
};

// Whole-series statistics over every finite value (the page's tables).
struct SeriesStats {
  int64_t count = 0, nonfinite = 0;
  double min = std::numeric_limits<double>::infinity(), max = -std::numeric_limits<double>::infinity();
  int64_t min_step = 0, max_step = 0;
  double first = 0, last = 0, sum = 0;
  int64_t last_step = 0;
};

class Envelope {
 public:
  explicit Envelope(int64_t target = 500);
  // Points arrive in increasing step order; a non-finite y is counted, not drawn.
  void add(const Position& at, double y);
  const std::vector<Bucket>& buckets() const { return buckets_; }
  int64_t width() const { return width_; }
  const SeriesStats& stats() const { return stats_; }

 private:
  void merge_pairs();
  int64_t target_, width_ = 1;
  std::vector<Bucket> buckets_;
  SeriesStats stats_;
};

// Per-expert vectors of one MoE layer over steps (the heat map and P against f): each column is
// the mean over its bucket's vector records of f_e / sum f (the fraction of routed tokens) and
// of P_e.
struct VectorColumn {
  int64_t key = 0, first_step = 0, last_step = 0, count = 0;
  std::vector<double> f_sum, p_sum;
};

class VectorColumns {
 public:
  explicit VectorColumns(int64_t target = 128);
  void add(int64_t step, const std::vector<double>& f, const std::vector<double>& p);
  const std::vector<VectorColumn>& columns() const { return columns_; }
  int64_t width() const { return width_; }
  int64_t records() const { return records_; }

 private:
  int64_t target_, width_ = 1, records_ = 0;
  std::vector<VectorColumn> columns_;
};

// Steps that carry a mark (clipped, skipped), counted per bucket: at most 2 x target marks drawn.
struct Mark {
  Position at;  // the bucket's first marked step
  int64_t count = 0;
  int64_t key = 0;
};

class MarkBuckets {
 public:
  explicit MarkBuckets(int64_t target = 500);
  void add(const Position& at);
  const std::vector<Mark>& marks() const { return marks_; }
  int64_t total() const { return total_; }
  int64_t width() const { return width_; }

 private:
  int64_t target_, width_ = 1, total_ = 0;
  std::vector<Mark> marks_;
};

}  // namespace moe::report
