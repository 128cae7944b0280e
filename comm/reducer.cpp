// SPDX-License-Identifier: Apache-2.0
#include "comm/reducer.hpp"

#include "device/expects.hpp"
#include "device/message.hpp"

#include <algorithm>

namespace taskswap::detail {

namespace {
constexpr std::size_t first_bucket_cap = std::size_t{1} << 20;  // as DDP: the first bucket goes early
}

std::uint64_t fnv1a(std::uint64_t h, std::string_view text) noexcept
{
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

reducer::reducer(const device& dev, std::shared_ptr<communicator> comm, const comm_options& options,
                 std::vector<reducer_unit> units)
    : device_(dev),
      comm_(std::move(comm)),
      options_(options),
      units_(std::move(units)),
      stop_slots_(dev, 2 * sizeof(std::int64_t) * static_cast<std::size_t>(comm_ ? comm_->size() : 1)),
      stream_(dev),
      control_stream_(dev),
      stop_stream_(dev),
      control_done_(dev),
      stop_done_{event(dev), event(dev)},
      where_(units_.size(), -1)
{
  TASKSWAP_EXPECTS(comm_ != nullptr, "the reducer needs a communicator");
  control_ = comm_->split();
  for (std::uint32_t i = 0; i < units_.size(); ++i) {
    all_bytes_ += units_[i].grad_bytes;
    if (units_[i].state_bytes != 0) { state_units_.push_back(i); }
  }
  check_digests();
  stop_ = control_->split();  // after the digests: every rank is there, nothing is in flight
}

std::span<std::int64_t> reducer::stop_slot(std::size_t i) noexcept
{
  const auto world = static_cast<std::size_t>(comm_->size());
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast): int64 slots
  return {reinterpret_cast<std::int64_t*>(stop_slots_.data()) + i * world, world};
}

reducer::~reducer()
{
  try {
    if (!comm_->failed()) {
      stream_.synchronize();
      control_stream_.synchronize();
      stop_stream_.synchronize();  // the last vote, which nobody reads
    }
  } catch (const std::exception&) {  // the failure was reported where it happened
  }
}

void reducer::wait_channel(const communicator& channel, stream& s, const event& done, std::string_view what)
{
  // The collective enforces its own timeout; the margin covers the copies around it.
  const auto limit = comm_->timeout() + std::chrono::seconds(10);
  const bool finished = done.synchronize_for(limit);
  if (channel.failed()) { comm_->check(); }  // a gradient collective that failed first is the cause
  channel.check();
  if (finished) { s.synchronize(); }  // rethrows a failure of the host functions on it
  if (!finished) {
    throw timeout_error(message("taskswap: the ranks' ", what, " did not finish within ",
                                std::chrono::duration_cast<std::chrono::milliseconds>(limit).count(), " ms"));
  }
}

// Every rank writes its digest into its own slots; the sum is then everyone's digest everywhere.
void reducer::check_digests()
{
  const int world = comm_->size();
  const int me = comm_->rank();
  std::uint64_t digest = 0xcbf29ce484222325ULL;
  for (const reducer_unit& u : units_) {
    digest = fnv1a(digest, u.name);
    digest ^= u.digest;
    digest *= 0x100000001b3ULL;
  }
  // The settings that shape the collectives must agree too.
  digest = fnv1a(digest, message("bucket_cap=", options_.bucket_cap, " reduce_every_unit=", options_.reduce_every_unit,
                                 " average=", static_cast<int>(options_.average)));
  std::vector<std::int64_t>& slots = counts_;  // a member: a collective that timed out may still write it
  slots.assign(static_cast<std::size_t>(world) * 3, 0);
  const std::size_t at = static_cast<std::size_t>(me) * 3;
  slots[at] = static_cast<std::int64_t>(units_.size());
  slots[at + 1] = static_cast<std::int64_t>(digest >> 32U);
  slots[at + 2] = static_cast<std::int64_t>(digest & 0xffffffffU);
  control_->allreduce_counts(slots, control_stream_, "unit registration digests");
  control_done_.record(control_stream_);
  wait_channel(*control_, control_stream_, control_done_, "comparison of unit registrations");
  std::string differing;
  for (int r = 0; r < world; ++r) {
    const std::size_t i = static_cast<std::size_t>(r) * 3;
    if (slots[i] != slots[at] || slots[i + 1] != slots[at + 1] || slots[i + 2] != slots[at + 2]) {
      differing += message(differing.empty() ? "" : ", ", "rank ", r, " (", slots[i], " units)");
    }
  }
  if (!differing.empty()) {
    throw config_error(message("taskswap: the ranks registered different units or [comm] settings: rank ", me, " has ",
                               units_.size(), " units with digest ", std::hex, digest, std::dec,
                               ", and these ranks differ from it: ", differing,
                               ". Every rank must register the same units (names, tensor shapes, dtypes, "
                               "no_weight_decay flags, lr_scale and weight_decay) in the same order, with the same "
                               "[comm] bucket_cap, average and reduce"));
  }
}

void reducer::sum(std::span<std::int64_t> values, std::string_view what)
{
  // The collective works on a member buffer: after a timeout it may still complete, and must not
  // write into the caller's (by then freed) memory.
  sum_buffer_.assign(values.begin(), values.end());
  control_->allreduce_counts(sum_buffer_, control_stream_, what);
  control_done_.record(control_stream_);
  wait_channel(*control_, control_stream_, control_done_, what);
  std::copy(sum_buffer_.begin(), sum_buffer_.end(), values.begin());
}

int reducer::stop_vote(int local)
{
  const std::uint64_t call = stop_calls_++;
  if (call % stop_period != 0) { return 0; }
  const std::uint64_t vote = call / stop_period;
  int agreed = 0;
  if (vote > 0) {
    const std::size_t previous = (vote - 1) % 2;
    wait_channel(*stop_, stop_stream_, stop_done_[previous], message("stop agreement ", vote - 1));
    for (const std::int64_t code : stop_slot(previous)) {
      if (code != 0) {
        agreed = static_cast<int>(code);
        break;
      }
    }
  }
  const std::span<std::int64_t> slots = stop_slot(vote % 2);
  std::fill(slots.begin(), slots.end(), 0);
  slots[static_cast<std::size_t>(comm_->rank())] = local;
  stop_->allreduce_counts(slots, stop_stream_, message("stop agreement ", vote));
  stop_done_[vote % 2].record(stop_stream_);
  return agreed;
}

std::vector<step_agreement> reducer::agree(std::span<const std::vector<std::uint32_t>> local, std::uint64_t first_step)
{
  const std::size_t n = units_.size();
  std::vector<step_agreement> out(local.size());
  if (local.empty()) { return out; }
  std::vector<std::int64_t>& counts = counts_;
  // Units with state tensors take them from the lowest rank that trained them: after the counts,
  // a bit per rank (62 to a slot) for each such unit and step, summed into a mask.
  const auto world = static_cast<std::size_t>(comm_->size());
  const std::size_t words = (world + 61) / 62;
  const std::size_t masks = local.size() * n;
  const auto mask_slot = [&](std::size_t k, std::size_t s, std::size_t w) {
    return masks + (k * state_units_.size() + s) * words + w;
  };
  if (options_.reduce_every_unit) {
    // Every unit that has gradients (state tensors: rank 0's, as DDP); never a unit that is never
    // trained (a frozen base, an activation block).
    counts.assign(local.size() * n, 0);
    for (std::size_t k = 0; k < local.size(); ++k) {
      for (std::size_t i = 0; i < n; ++i) {
        if (units_[i].grad_bytes > 0) { counts[k * n + i] = comm_->size(); }
      }
    }
  } else {
    counts.assign(local.size() * n + local.size() * state_units_.size() * words, 0);
    const auto me = static_cast<std::size_t>(comm_->rank());
    for (std::size_t k = 0; k < local.size(); ++k) {
      for (const std::uint32_t u : local[k]) {
        counts[k * n + u] = 1;
        const auto s = std::lower_bound(state_units_.begin(), state_units_.end(), u);
        if (s != state_units_.end() && *s == u) {
          counts[mask_slot(k, static_cast<std::size_t>(s - state_units_.begin()), me / 62)] = std::int64_t{1}
                                                                                              << (me % 62);
        }
      }
    }
    control_->allreduce_counts(counts, control_stream_,
                               message("steps ", first_step, "..", first_step + local.size() - 1, " (plan)"));
    control_done_.record(control_stream_);
    wait_channel(*control_, control_stream_, control_done_,
                 message("agreement on the units of steps ", first_step, "..", first_step + local.size() - 1));
  }
  for (std::size_t k = 0; k < local.size(); ++k) {
    step_agreement& a = out[k];
    std::vector<std::size_t> bytes;
    for (std::size_t i = n; i-- > 0;) {
      const std::int64_t c = counts[k * n + i];
      if (c <= 0) { continue; }
      bytes.push_back(units_[i].grad_bytes);
      a.order.push_back(static_cast<std::uint32_t>(i));
      a.counts.push_back(c);
      int root = 0;
      const auto s = std::lower_bound(state_units_.begin(), state_units_.end(), static_cast<std::uint32_t>(i));
      if (!options_.reduce_every_unit && s != state_units_.end() && *s == i) {
        for (std::size_t w = 0; w < words; ++w) {
          const auto mask =
            static_cast<std::uint64_t>(counts[mask_slot(k, static_cast<std::size_t>(s - state_units_.begin()), w)]);
          if (mask != 0) {
            root = static_cast<int>(w * 62) + __builtin_ctzll(mask);
            break;
          }
        }
      }
      a.state_root.push_back(root);
    }
    a.bucket_end = pack_buckets(bytes, options_.bucket_cap);
  }
  return out;
}

std::vector<std::size_t> pack_buckets(std::span<const std::size_t> grad_bytes, std::size_t cap)
{
  std::vector<std::size_t> ends;
  std::size_t bucket_bytes = 0;
  std::size_t bucket_cap = std::min(first_bucket_cap, cap);
  for (std::size_t i = 0; i < grad_bytes.size(); ++i) {
    if (i != 0 && bucket_bytes + grad_bytes[i] > bucket_cap) {
      ends.push_back(i);
      bucket_bytes = 0;
      bucket_cap = cap;
    }
    bucket_bytes += grad_bytes[i];
  }
  if (!grad_bytes.empty()) { ends.push_back(grad_bytes.size()); }
  return ends;
}

std::vector<std::size_t> bucket_reach(std::span<const std::size_t> grad_bytes, std::size_t cap)
{
  std::vector<std::size_t> reach(grad_bytes.size());
  std::size_t end = 0;
  std::size_t bytes = 0;  // grad_bytes[i .. end)
  for (std::size_t i = 0; i < grad_bytes.size(); ++i) {
    if (end == i) {
      bytes = grad_bytes[i];
      end = i + 1;
    }
    while (end < grad_bytes.size() && bytes + grad_bytes[end] <= cap) { bytes += grad_bytes[end++]; }
    reach[i] = end;
    bytes -= grad_bytes[i];
  }
  return reach;
}

void reducer::begin(const step_agreement& step, std::uint64_t step_number)
{
  comm_->check();
  step_ = &step;
  step_number_ = step_number;
  const std::size_t n = step.order.size();
  for (std::size_t i = 0; i < n; ++i) { where_[step.order[i]] = static_cast<std::int32_t>(i); }
  slabs_.assign(n, device_span{});
  states_.assign(n, device_span{});
  ready_events_.assign(n, nullptr);
  ready_.assign(n, false);
  next_bucket_ = 0;
  while (bucket_done_.size() < step.bucket_end.size()) { bucket_done_.emplace_back(device_); }
  step_bytes_ = 0;
  for (const std::uint32_t u : step.order) { step_bytes_ += units_[u].grad_bytes; }
}

bool reducer::is_ready(std::uint32_t u) const noexcept
{
  return active(u) && ready_[static_cast<std::size_t>(where_[u])];
}

std::vector<std::uint32_t> reducer::ready(std::uint32_t u, device_span grads, const event& ready, device_span state)
{
  comm_->check();
  std::vector<std::uint32_t> launched;
  TASKSWAP_EXPECTS(step_ != nullptr && active(u),
                   message("unit '", units_[u].name, "' is not active in step ", step_number_, " on any rank"));
  const auto i = static_cast<std::size_t>(where_[u]);
  if (ready_[i]) { return launched; }
  ready_[i] = true;
  slabs_[i] = grads;
  TASKSWAP_EXPECTS(state.size() == units_[u].state_bytes,
                   message("unit '", units_[u].name, "': ", state.size(), " bytes of state tensors given, ",
                           units_[u].state_bytes, " registered"));
  states_[i] = state;
  ready_events_[i] = &ready;
  launch_ready_buckets(launched);
  return launched;
}

void reducer::launch_ready_buckets(std::vector<std::uint32_t>& launched)
{
  const step_agreement& a = *step_;
  while (next_bucket_ < a.bucket_end.size()) {
    const std::size_t first = next_bucket_ == 0 ? 0 : a.bucket_end[next_bucket_ - 1];
    const std::size_t last = a.bucket_end[next_bucket_];
    for (std::size_t i = first; i < last; ++i) {
      if (!ready_[i]) { return; }
    }
    std::vector<reduce_item> items;
    items.reserve(last - first);
    for (std::size_t i = first; i < last; ++i) {
      if (!ready_events_[i]->query()) { ready_events_[i]->wait(stream_); }
      const std::uint32_t u = a.order[i];
      const double factor =
        options_.average == average_mode::world ? 1.0 / comm_->size() : 1.0 / static_cast<double>(a.counts[i]);
      items.push_back({slabs_[i], units_[u].grad, reduce_op::premul_sum, factor});
    }
    comm_->allreduce_many(items, stream_,
                          message("bucket ", next_bucket_, " (", last - first, " units from '",
                                  units_[a.order[first]].name, "'), step ", step_number_));
    for (std::size_t i = first; i < last; ++i) {  // replicas keep rank 0's state tensors (DDP's broadcast_buffers)
      if (states_[i].size() != 0) {
        comm_->broadcast(states_[i], a.state_root[i], stream_,
                         message("the state tensors of '", units_[a.order[i]].name, "', step ", step_number_));
      }
    }
    bucket_done_[next_bucket_].record(stream_);
    for (std::size_t i = first; i < last; ++i) { launched.push_back(a.order[i]); }
    ++next_bucket_;
  }
}

const event* reducer::reduced(std::uint32_t u) const noexcept
{
  if (!active(u)) { return nullptr; }
  const auto i = static_cast<std::size_t>(where_[u]);
  const auto& ends = step_->bucket_end;
  const std::size_t b = static_cast<std::size_t>(std::upper_bound(ends.begin(), ends.end(), i) - ends.begin());
  return b < next_bucket_ ? &bucket_done_[b] : nullptr;
}

std::vector<std::uint32_t> reducer::not_ready() const
{
  std::vector<std::uint32_t> out;
  if (step_ == nullptr) { return out; }
  for (std::size_t i = 0; i < ready_.size(); ++i) {
    if (!ready_[i]) { out.push_back(step_->order[i]); }
  }
  return out;
}

void reducer::end()
{
  if (step_ == nullptr) { return; }
  TASKSWAP_EXPECTS(next_bucket_ == step_->bucket_end.size(),
                   message("step ", step_number_, " ends with ", step_->bucket_end.size() - next_bucket_,
                           " gradient buckets not launched"));
  for (const std::uint32_t u : step_->order) { where_[u] = -1; }
  step_ = nullptr;
}

}  // namespace taskswap::detail
