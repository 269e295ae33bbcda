#include "parallel/p2p_transport.h"

#include <cstring>


namespace moe {

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
  const int32_t* counts = plan.host.data();
  const int32_t* kept = counts + ep * E;
  const int32_t* local_begin = kept + ep * E;
  const int32_t* recv_begin = local_begin + E;
  const int32_t* totals = recv_begin + El * ep + (El + 1);
  MOE_CHECK(received.rows() >= totals[kRowsReceived], "expert exchange: received buffer has ", received.rows(),
            " rows, the plan needs ", totals[kRowsReceived]);
  const size_t elem = dtype_size(local.dtype);
  // Where messages go: the tensors themselves, or (backend memory the host cannot address) host
  // copies: the source side downloaded first, the destination side uploaded after the wait.
  const bool staged = !staging_.direct(comm_);
  const int64_t received_rows = totals[kRowsReceived];
  char* local_base = static_cast<char*>(local.data);
  char* received_base = static_cast<char*>(received.data);
  const Tensor received_used = received.slice(0, received_rows);
  if (staged) {
    if (to_experts) {
      local_base = static_cast<char*>(staging_.to_host(local, local_host_));
      received_host_.resize(received_used.nbytes());
      received_base = reinterpret_cast<char*>(received_host_.data());
    } else {
      received_base = static_cast<char*>(staging_.to_host(received_used, received_host_));
      local_host_.resize(local.nbytes());
      local_base = reinterpret_cast<char*>(local_host_.data());
    }
  }
  auto rows_ptr = [&](const Tensor& t, int64_t row) {
    return (&t == &local ? local_base : received_base) + static_cast<size_t>(row * D) * elem;
  };
  const auto n = [&](int64_t rows) { return static_cast<size_t>(rows * D); };
  const auto kept_rows = [&](int64_t s, int64_t e) { return static_cast<int64_t>(kept[s * E + e]); };
  const auto block = [&](int64_t e, int64_t s) { return static_cast<int64_t>(recv_begin[e * ep + s]); };
  requests_.clear();
  // Receives first, then sends, in the same (peer, local expert) order on both ends. The tag
  // names the local expert and the direction (e toward the experts, El + e back), so a
  // mismatched pair cannot match silently (and tests can tell the directions apart).
  const auto tag = [&](int64_t e) { return static_cast<int>(to_experts ? e : El + e); };
  comm_.group_start();  // NCCL: the sends and receives of one exchange progress together
  for (int64_t peer = 0; peer < ep; ++peer) {
    if (peer == me) continue;
    for (int64_t e = 0; e < El; ++e) {
      if (to_experts) {  // block (local expert e, source peer) of my received rows
        const int64_t rows = kept_rows(peer, me * El + e);
        if (rows > 0)
          requests_.push_back(comm_.irecv(rows_ptr(received, block(e, peer)), n(rows), local.dtype,
                                          static_cast<int>(peer), tag(e)));
      } else {  // my rows that peer's local expert e computed
        const int64_t g = peer * El + e, rows = kept_rows(me, g);
        if (rows > 0)
          requests_.push_back(comm_.irecv(rows_ptr(local, local_begin[g]), n(rows), local.dtype,
                                          static_cast<int>(peer), tag(e)));
      }
    }
  }
  for (int64_t peer = 0; peer < ep; ++peer) {
    if (peer == me) continue;
    for (int64_t e = 0; e < El; ++e) {
      if (to_experts) {
        const int64_t g = peer * El + e, rows = kept_rows(me, g);
        if (rows > 0)
          requests_.push_back(comm_.isend(rows_ptr(local, local_begin[g]), n(rows), local.dtype,
                                          static_cast<int>(peer), tag(e)));
      } else {
        const int64_t rows = kept_rows(peer, me * El + e);
        if (rows > 0)
          requests_.push_back(comm_.isend(rows_ptr(received, block(e, peer)), n(rows), local.dtype,
                                          static_cast<int>(peer), tag(e)));
      }
    }
  }
  comm_.group_end();
  // Rows to self: a copy while the messages are in flight.
  for (int64_t e = 0; e < El; ++e) {
    const int64_t g = me * El + e, rows = kept_rows(me, g);
    if (rows == 0) continue;
    const int64_t l0 = local_begin[g], r0 = block(e, me);
    if (staged) {
      char* l = rows_ptr(local, l0);
      char* r = rows_ptr(received, r0);
      std::memcpy(to_experts ? r : l, to_experts ? l : r, n(rows) * elem);
    } else if (to_experts) {  // a device copy: any dtype (MXFP8 codes and scales too)
      ops_.copy(local.slice(l0, l0 + rows), received.slice(r0, r0 + rows));
    } else {
      ops_.copy(received.slice(r0, r0 + rows), local.slice(l0, l0 + rows));
    }
  }
  // Dropped rows of my tokens: zero output / zero gradient.
  if (!to_experts)
    for (int64_t g = 0; g < E; ++g) {
      const int64_t keep = kept_rows(me, g), all = counts[me * E + g], l0 = local_begin[g];
      if (all <= keep) continue;
      if (staged) std::memset(rows_ptr(local, l0 + keep), 0, n(all - keep) * elem);
      else ops_.fill(local.slice(l0 + keep, l0 + all), 0.0);
    }
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
