#include "parallel/p2p_transport.h"

#include <cstring>

namespace moe {

namespace {

// One move's blocks: the plan's host words (ExchangePlan's layout) and where each side's rows
// are (the tensors, or their host copies when staged).
struct MoveBlocks {
  int64_t ep, E, El, me, D;
  size_t elem;  // bytes per element
  const int32_t* counts;       // (ep, E) routed rows of each rank's tokens per expert
  const int32_t* kept;         // (ep, E) of which kept by the capacity
  const int32_t* local_begin;  // (E) first of my local rows for each expert
  const int32_t* recv_begin;   // (El, ep) first received row of each (local expert, source rank)
  char* local_base;
  char* received_base;
  int64_t kept_rows(int64_t s, int64_t e) const { return static_cast<int64_t>(kept[s * E + e]); }
  int64_t block(int64_t e, int64_t s) const { return static_cast<int64_t>(recv_begin[e * ep + s]); }
  char* local_row(int64_t row) const { return local_base + static_cast<size_t>(row * D) * elem; }
  char* received_row(int64_t row) const { return received_base + static_cast<size_t>(row * D) * elem; }
  size_t n(int64_t rows) const { return static_cast<size_t>(rows * D); }  // elements of that many rows
};

// Receives first, then sends, in the same (peer, local expert) order on both ends. The tag names
// the local expert and the direction (e toward the experts, El + e back), so a mismatched pair
// cannot match silently (and tests can tell the directions apart).
void post_block_messages(Communicator& comm, std::vector<Request>& requests, const MoveBlocks& b, DType dtype,
                         bool to_experts) {
  const int64_t ep = b.ep, El = b.El, me = b.me;
  const auto tag = [&](int64_t e) { return static_cast<int>(to_experts ? e : El + e); };
  comm.group_start();  // NCCL: the sends and receives of one exchange progress together
  for (int64_t peer = 0; peer < ep; ++peer) {
    if (peer == me) continue;
    for (int64_t e = 0; e < El; ++e) {
      if (to_experts) {  // block (local expert e, source peer) of my received rows
        const int64_t rows = b.kept_rows(peer, me * El + e);
        if (rows > 0)
          requests.push_back(comm.irecv(b.received_row(b.block(e, peer)), b.n(rows), dtype, static_cast<int>(peer), tag(e)));
      } else {  // my rows that peer's local expert e computed
        const int64_t g = peer * El + e, rows = b.kept_rows(me, g);
        if (rows > 0)
          requests.push_back(comm.irecv(b.local_row(b.local_begin[g]), b.n(rows), dtype, static_cast<int>(peer), tag(e)));
      }
    }
  }
  for (int64_t peer = 0; peer < ep; ++peer) {
    if (peer == me) continue;
    for (int64_t e = 0; e < El; ++e) {
      if (to_experts) {
        const int64_t g = peer * El + e, rows = b.kept_rows(me, g);
        if (rows > 0)
          requests.push_back(comm.isend(b.local_row(b.local_begin[g]), b.n(rows), dtype, static_cast<int>(peer), tag(e)));
      } else {
        const int64_t rows = b.kept_rows(peer, me * El + e);
        if (rows > 0)
          requests.push_back(comm.isend(b.received_row(b.block(e, peer)), b.n(rows), dtype, static_cast<int>(peer), tag(e)));
      }
    }
  }
  comm.group_end();
}

// Rows to self: a copy while the messages are in flight.
void copy_own_blocks(Backend& ops, const MoveBlocks& b, const Tensor& local, const Tensor& received, bool to_experts,
                     bool staged) {
  for (int64_t e = 0; e < b.El; ++e) {
    const int64_t g = b.me * b.El + e, rows = b.kept_rows(b.me, g);
    if (rows == 0) continue;
    const int64_t l0 = b.local_begin[g], r0 = b.block(e, b.me);
    if (staged) {
      char* l = b.local_row(l0);
      char* r = b.received_row(r0);
      std::memcpy(to_experts ? r : l, to_experts ? l : r, b.n(rows) * b.elem);
    } else if (to_experts) {  // a device copy: any dtype (MXFP8 codes and scales too)
      ops.copy(local.slice(l0, l0 + rows), received.slice(r0, r0 + rows));
    } else {
      ops.copy(received.slice(r0, r0 + rows), local.slice(l0, l0 + rows));
    }
  }
}

// Dropped rows of my tokens (on their way back): zero output / zero gradient.
void zero_dropped_rows(Backend& ops, const MoveBlocks& b, const Tensor& local, bool staged) {
  for (int64_t g = 0; g < b.E; ++g) {
    const int64_t keep = b.kept_rows(b.me, g), all = b.counts[b.me * b.E + g], l0 = b.local_begin[g];
    if (all <= keep) continue;
    if (staged) std::memset(b.local_row(l0 + keep), 0, b.n(all - keep) * b.elem);
    else ops.fill(local.slice(l0 + keep, l0 + all), 0.0);
  }
}

}  // namespace

P2pExpertTransport::P2pExpertTransport(Communicator& ep, Backend& ops, int64_t num_experts)
    : comm_(ep), ops_(ops), host_ops_(make_backend("ref")), staging_(ops), num_experts_(num_experts) {
  MOE_CHECK(num_experts % ep.size() == 0, "num_experts=", num_experts, " is not divisible by ep=", ep.size());
  local_counts_.resize(static_cast<size_t>(num_experts));
  requests_.reserve(static_cast<size_t>(2 * num_experts));
}

void P2pExpertTransport::gather_counts(const Tensor& local_counts, ExchangePlan& plan) {
  const int64_t ep = comm_.size(), E = num_experts_;
  plan.host.resize(static_cast<size_t>(ExchangePlan::words(ep, E)));
  if (staging_.direct(comm_) && comm_.buffer_device() != Device::kCpu) {
    // A device communicator (NCCL): the matrix is gathered on the device, then read once.
    comm_.all_gather(local_counts.data, plan.counts.data, static_cast<size_t>(E), DType::kI32);
    ops_.download(plan.counts, plan.host.data());  // the one host read of routing, per plan
    BlockedTimer blocked(blocked_s_);
    ops_.wait(ops_.record());
    return;
  }
  ops_.download(local_counts, local_counts_.data());  // the one host read of routing, per plan
  {
    BlockedTimer blocked(blocked_s_);
    ops_.wait(ops_.record());
    comm_.all_gather(local_counts_.data(), plan.host.data(), static_cast<size_t>(E), DType::kI32);
  }
  ops_.upload(plan.host.data(), plan.counts);
}

void P2pExpertTransport::plan_ready(ExchangePlan& plan, int64_t capacity) {
  const int64_t ep = comm_.size(), E = num_experts_;
  const ExchangePlan h =
      ExchangePlan::over(Tensor(plan.host.data(), DType::kI32, {static_cast<int64_t>(plan.host.size())}), ep, E);
  host_ops_->ep_plan(h.counts, comm_.rank(), capacity, h.kept, h.local_begin, h.recv_begin, h.recv_offsets, h.totals);
}

void P2pExpertTransport::move(const ExchangePlan& plan, const Tensor& local, const Tensor& received, bool to_experts,
                              const Tensor& /*workspace: none needed*/) {
  const int64_t ep = comm_.size(), E = num_experts_, El = E / ep, me = comm_.rank(), D = local.cols();
  MOE_CHECK(plan.host.size() == static_cast<size_t>(ExchangePlan::words(ep, E)),
            "expert exchange: the plan was not made by this transport");
  MOE_CHECK(local.dtype == received.dtype && received.cols() == D, "expert exchange: local ", local.shape_str(), " ",
            dtype_name(local.dtype), " and received ", received.shape_str(), " ", dtype_name(received.dtype),
            " do not match");
  // Host words of the plan, in ExchangePlan's layout.
  MoveBlocks b{ep, E, El, me, D, dtype_size(local.dtype), plan.host.data(), nullptr, nullptr, nullptr,
               static_cast<char*>(local.data), static_cast<char*>(received.data)};
  b.kept = b.counts + ep * E;
  b.local_begin = b.kept + ep * E;
  b.recv_begin = b.local_begin + E;
  const int32_t* totals = b.recv_begin + El * ep + (El + 1);
  MOE_CHECK(received.rows() >= totals[kRowsReceived], "expert exchange: received buffer has ", received.rows(),
            " rows, the plan needs ", totals[kRowsReceived]);
  // Where messages go: the tensors themselves, or (backend memory the host cannot address) host
  // copies: the source side downloaded first, the destination side uploaded after the wait.
  const bool staged = !staging_.direct(comm_);
  const int64_t received_rows = totals[kRowsReceived];
  const Tensor received_used = received.slice(0, received_rows);
  if (staged) {
    if (to_experts) {
      b.local_base = static_cast<char*>(staging_.to_host(local, local_host_));
      received_host_.resize(received_used.nbytes());
      b.received_base = reinterpret_cast<char*>(received_host_.data());
    } else {
      b.received_base = static_cast<char*>(staging_.to_host(received_used, received_host_));
      local_host_.resize(local.nbytes());
      b.local_base = reinterpret_cast<char*>(local_host_.data());
    }
  }
  requests_.clear();
  post_block_messages(comm_, requests_, b, local.dtype, to_experts);
  copy_own_blocks(ops_, b, local, received, to_experts, staged);
  if (!to_experts) zero_dropped_rows(ops_, b, local, staged);
  {
    BlockedTimer blocked(blocked_s_);
    wait_all(requests_);
  }
  if (staged) {
    if (to_experts) staging_.to_device(received_host_.data(), received_used);
    else staging_.to_device(local_host_.data(), local);
  }
}

}  // namespace moe
