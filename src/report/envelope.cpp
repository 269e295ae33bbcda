#include "report/envelope.h"

#include <cmath>

#include "core/check.h"

namespace moe::report {

namespace {

// Merges neighbouring items whose key / 2 agree (width doubles), in place, keeping order.
template <class T, class Combine>
void halve(std::vector<T>& items, Combine combine) {
  size_t out = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    items[i].key /= 2;
    if (out > 0 && items[out - 1].key == items[i].key) combine(items[out - 1], items[i]);
    else if (out++ != i) items[out - 1] = std::move(items[i]);  // never onto itself (a vector would empty)
  }
  items.resize(out);
}

}  // namespace

Envelope::Envelope(int64_t target) : target_(target) { MOE_CHECK(target >= 1, "envelope target ", target); }

void Envelope::add(const Position& at, double y) {
  if (!std::isfinite(y)) {
    ++stats_.nonfinite;
    return;
  }
  SeriesStats& s = stats_;
  if (s.count == 0) s.first = y;
  ++s.count;
  s.sum += y;
  s.last = y;
  s.last_step = at.step;
  if (y < s.min) s.min = y, s.min_step = at.step;
  if (y > s.max) s.max = y, s.max_step = at.step;

  const Point p{at, y};
  const int64_t key = at.step / width_;
  if (buckets_.empty() || buckets_.back().key != key) {
    MOE_CHECK(buckets_.empty() || key > buckets_.back().key, "envelope: step ", at.step, " after step ",
              buckets_.back().last.at.step);
    buckets_.push_back(Bucket{key, p, p, p, y, 1});
    if (static_cast<int64_t>(buckets_.size()) > 2 * target_) merge_pairs();
    return;
  }
  Bucket& b = buckets_.back();
  MOE_CHECK(at.step > b.last.at.step, "envelope: step ", at.step, " after step ", b.last.at.step);
  if (y < b.lo.y) b.lo = p;
  if (y > b.hi.y) b.hi = p;
  b.last = p;
  b.sum += y;
  ++b.count;
}

void Envelope::merge_pairs() {
  width_ *= 2;
  halve(buckets_, [](Bucket& a, const Bucket& b) {
    if (b.lo.y < a.lo.y) a.lo = b.lo;
    if (b.hi.y > a.hi.y) a.hi = b.hi;
    a.last = b.last;
    a.sum += b.sum;
    a.count += b.count;
  });
}

VectorColumns::VectorColumns(int64_t target) : target_(target) { MOE_CHECK(target >= 1, "columns target ", target); }

void VectorColumns::add(int64_t step, const std::vector<double>& f, const std::vector<double>& p) {
  double total = 0;
  for (double v : f) total += v;
  const int64_t key = step / width_;
  if (columns_.empty() || columns_.back().key != key) {
    columns_.push_back(VectorColumn{key, step, step, 0, std::vector<double>(f.size()), std::vector<double>(f.size())});
  }
  VectorColumn& c = columns_.back();
  MOE_CHECK(c.f_sum.size() == f.size() && p.size() == f.size(), "report: expert vectors of ", f.size(), " and ",
            p.size(), " values at step ", step, " (earlier: ", c.f_sum.size(), ")");
  for (size_t e = 0; e < f.size(); ++e) {
    c.f_sum[e] += total > 0 ? f[e] / total : 0;
    c.p_sum[e] += std::isfinite(p[e]) ? p[e] : 0;
  }
  c.last_step = step;
  ++c.count;
  ++records_;
  if (static_cast<int64_t>(columns_.size()) > 2 * target_) {
    width_ *= 2;
    halve(columns_, [](VectorColumn& a, const VectorColumn& b) {
      for (size_t e = 0; e < a.f_sum.size(); ++e) a.f_sum[e] += b.f_sum[e], a.p_sum[e] += b.p_sum[e];
      a.last_step = b.last_step;
      a.count += b.count;
    });
  }
}

MarkBuckets::MarkBuckets(int64_t target) : target_(target) { MOE_CHECK(target >= 1, "marks target ", target); }

void MarkBuckets::add(const Position& at) {
  ++total_;
  const int64_t key = at.step / width_;
  if (!marks_.empty() && marks_.back().key == key) {
    ++marks_.back().count;
    return;
  }
  marks_.push_back(Mark{at, 1, key});
  if (static_cast<int64_t>(marks_.size()) > 2 * target_) {
    width_ *= 2;
    halve(marks_, [](Mark& a, const Mark& b) { a.count += b.count; });
  }
}

}  // namespace moe::report
