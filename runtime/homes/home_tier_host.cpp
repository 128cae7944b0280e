// SPDX-License-Identifier: Apache-2.0
// The host home tier: every home copy in the pinned, NUMA-local arena (Note [Home tiers]).

#include "runtime/homes/home_tier.hpp"

#include "runtime/units/unit_layout.hpp"

namespace taskswap::detail {

namespace {

std::size_t host_store_bytes(const storage_options& /*storage*/) { return 0; }  // the arena is the store

void host_open_store(home_store& /*store*/, const device& /*dev*/, const storage_options& /*storage*/) {}

std::size_t host_pinned_bytes(std::size_t bytes) { return bytes; }

void host_place(home_store& store, unit_home& home, const home_request& request)
{
  home.block = store.arena->allocate(request.bytes, slab_alignment).data();
  home.bytes = request.bytes;
}

void host_stage_in(const unit_home& home, std::size_t offset, device_span dst, stream_view s)
{
  copy_async(dst, std::span<const std::byte>(home.block + offset, dst.size()), s);
}

void host_write_back(const unit_home& home, std::size_t offset, const_device_span src, stream_view s)
{
  copy_async(std::span<std::byte>(home.block + offset, src.size()), src, s);
}

std::span<std::byte> host_block(const unit_home& home) { return {home.block, home.bytes}; }

bool host_ready(const unit_home& /*home*/) { return true; }

void host_used(const unit_home& /*home*/, const stream_view* /*s*/, bool /*wrote*/) {}  // the arena is the home

}  // namespace

extern const home_tier host_home_tier;
const home_tier host_home_tier{.name = "host",
                               .cached = false,
                               .store_bytes = host_store_bytes,
                               .open_store = host_open_store,
                               .pinned_bytes = host_pinned_bytes,
                               .place = host_place,
                               .stage_in = host_stage_in,
                               .write_back = host_write_back,
                               .host_block = host_block,
                               .ready = host_ready,
                               .used = host_used};

}  // namespace taskswap::detail
