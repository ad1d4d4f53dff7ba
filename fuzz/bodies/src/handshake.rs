//! A producer's handshake reply as a consumer reads it
//! (`pd_kv_transfer::peer::check_handshake_reply`, what `PeerClient::handshake` does with the
//! reply): protobuf bytes from the fuzzer, or a reply built from them around a compatible one
//! (so the checks after the compatibility check are reached).
//!
//! Properties: nothing panics; an accepted reply's pool layout has the shape its compatibility
//! info states, a block size a request may name, the block bytes it says, and a pool and a lease
//! board that lie inside the registered region (the puller maps and reads both).

use pd_kv_pool::{BOARD_HEADER_BYTES, BOARD_SLOT_BYTES, KvOrder};
use pd_kv_transfer::compat::{CompatInfo, TRANSFER_PROTOCOL_VERSION};
use pd_kv_transfer::peer::{MAX_PEER_BLOCK_SIZE, check_handshake_reply};
use pd_kv_transfer::service::compat_to_proto;
use pd_rpc::kv::{HandshakeReply, Layout};
use prost::Message;

use crate::input::Input;

fn local() -> CompatInfo {
    CompatInfo {
        project_version: "0.1.0".into(),
        protocol_version: TRANSFER_PROTOCOL_VERSION,
        model: "m".into(),
        fingerprint: "0123456789abcdef".into(),
        dtype: "f16".into(),
        num_kv_heads: 2,
        num_layers: 4,
        head_dim: 64,
    }
}

/// A reply a compatible producer could send, its numbers from `input`.
fn built(input: &mut Input<'_>, local: &CompatInfo) -> HandshakeReply {
    let mut compat = compat_to_proto(local);
    if input.byte() == 0 {
        compat.num_layers = input.u32();
    }
    let n = |input: &mut Input<'_>, v: u32| if input.byte() == 0 { input.u32() } else { v };
    let num_layers = n(input, compat.num_layers);
    let num_kv_heads = n(input, compat.num_kv_heads);
    let head_dim = n(input, compat.head_dim);
    let block_size = if input.bool() {
        input.u32()
    } else {
        input.pick(&[1, 16, 4096, 4097])
    };
    let dtype = input.pick(&["f16", "f32", "bf16", ""]).to_string();
    let block_bytes = u64::from(num_layers)
        .wrapping_mul(2 * u64::from(num_kv_heads))
        .wrapping_mul(u64::from(block_size))
        .wrapping_mul(u64::from(head_dim))
        .wrapping_mul(2);
    let num_blocks = input.u64() >> input.below(64);
    HandshakeReply {
        engine_id: input.string(16),
        epoch: input.u64(),
        compat: Some(compat),
        worker_address: input.bytes(8).to_vec(),
        region_base: input.u64(),
        region_len: if input.bool() {
            block_bytes.wrapping_mul(num_blocks)
        } else {
            input.u64()
        },
        rkey: input.bytes(8).to_vec(),
        layout: Some(Layout {
            num_blocks,
            block_size,
            num_layers,
            num_kv_heads,
            head_dim,
            dtype,
            dim_order: input
                .pick(&[KvOrder::Hnd.dim_order(), KvOrder::Nhd.dim_order(), "hnd"])
                .to_string(),
            block_bytes: if input.bool() {
                block_bytes
            } else {
                input.u64()
            },
        }),
        transports: vec![input.string(8)],
        board_offset: input.u64() >> input.below(64),
        board_slots: input.u32() >> input.below(32),
        owner_clock_ns: input.u64(),
        kv_path: input.string(8),
        data_port: input.u32(),
    }
}

/// The target.
pub fn run(data: &[u8]) {
    crate::caught_panics_are_not_crashes();
    let mut input = Input::new(data);
    let local = local();
    let skip = input.bool();
    let reply = if input.bool() {
        built(&mut input, &local)
    } else {
        match HandshakeReply::decode(input.rest()) {
            Ok(r) => r,
            Err(_) => return,
        }
    };
    let said = reply.clone();
    let sent_ns = input.u64();
    let Ok(info) = check_handshake_reply(&local, skip, reply, "10.0.0.1", sent_ns) else {
        return;
    };
    let l = info.layout;
    let c = &info.compat;
    if !skip {
        assert!(local.check(c).is_ok(), "accepted an incompatible peer");
    }
    assert_eq!(
        (l.num_layers, l.num_kv_heads, l.head_dim),
        (
            c.num_layers as usize,
            c.num_kv_heads as usize,
            c.head_dim as usize
        ),
        "the layout's shape is not the one the compatibility info states"
    );
    assert!((1..=MAX_PEER_BLOCK_SIZE).contains(&l.block_size));
    let said_layout = said.layout.as_ref().expect("accepted without a layout");
    assert_eq!(l.block_bytes() as u64, said_layout.block_bytes);
    let pool = l.block_bytes() as u128 * l.num_blocks as u128;
    assert!(
        pool <= u128::from(info.region_len),
        "pool beyond the region"
    );
    if info.board_slots > 0 {
        let board_end = u128::from(info.board_offset)
            + BOARD_HEADER_BYTES as u128
            + u128::from(info.board_slots) * BOARD_SLOT_BYTES as u128;
        // The board lies right after the pool in the same registration (`region_len` counts
        // the pool only), no larger than an owner makes it, and does not wrap.
        assert!(
            info.board_offset == info.region_len
                && info.board_slots <= pd_kv_transfer::peer::MAX_PEER_BOARD_SLOTS
                && u128::from(info.region_base) + board_end <= u128::from(u64::MAX),
            "lease board (offset {}, {} slots) not right after the pool of {} bytes, or wraps",
            info.board_offset,
            info.board_slots,
            info.region_len
        );
    }
    assert!(
        info.region_base.checked_add(info.region_len).is_some(),
        "region {:#x} + {} overflows the address space",
        info.region_base,
        info.region_len
    );
}
