#include "parallel/padded_transport.h"

namespace moe {

PaddedExpertTransport::PaddedExpertTransport(Communicator& ep, Backend& ops, int64_t num_experts, int64_t slab_rows)
    : comm_(ep), ops_(ops), staging_(ops), slab_rows_(slab_rows) {
  MOE_CHECK(num_experts % ep.size() == 0, "num_experts=", num_experts, " is not divisible by ep=", ep.size());
  MOE_CHECK(slab_rows > 0, "padded expert transport: slab rows ", slab_rows, " must be positive");
}

void PaddedExpertTransport::gather_counts(const Tensor& local_counts, ExchangePlan& plan) {
  BlockedTimer blocked(blocked_s_);
  staging_.all_gather(comm_, local_counts, plan.counts.view({plan.counts.numel()}));
}

void PaddedExpertTransport::move(const ExchangePlan& plan, const Tensor& local, const Tensor& received,
                                 bool to_experts, const Tensor& workspace) {
  const int64_t ep = comm_.size(), D = local.cols(), me = comm_.rank();
  MOE_CHECK(local.dtype == received.dtype && received.cols() == D, "expert exchange: local ", local.shape_str(), " ",
            dtype_name(local.dtype), " and received ", received.shape_str(), " ", dtype_name(received.dtype),
            " do not match");
  // The two slab sets in the rows' dtype, over the workspace's bytes.
  const int64_t slab_elems = ep * slab_rows_ * D;
  MOE_CHECK(workspace.nbytes() >= 2 * static_cast<size_t>(slab_elems) * dtype_size(local.dtype),
            "padded expert transport: workspace of ", workspace.nbytes(), " bytes is smaller than two slab sets of ",
            ep, " x ", slab_rows_, " x ", D, " ", dtype_name(local.dtype));
  char* base = static_cast<char*>(workspace.data);
  const Tensor send(base, local.dtype, {ep, slab_rows_, D}, workspace.device);
  const Tensor recv(base + static_cast<size_t>(slab_elems) * dtype_size(local.dtype), local.dtype,
                    {ep, slab_rows_, D}, workspace.device);
  const Tensor& from = to_experts ? local : received;
  const Tensor& to = to_experts ? received : local;
  // Packing on the sending side, placing on the receiving side; the tokens' side is the local one.
  ops_.ep_slab_copy(plan.counts, plan.kept, plan.local_begin, plan.recv_begin, me, !to_experts, true, from, send);
  {
    BlockedTimer blocked(blocked_s_);
    staging_.all_to_all(comm_, send.view({slab_elems}), recv.view({slab_elems}));
  }
  ops_.ep_slab_copy(plan.counts, plan.kept, plan.local_begin, plan.recv_begin, me, to_experts, false, to, recv);
}

}  // namespace moe
