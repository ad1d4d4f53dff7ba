//! Handshake replies found by the `handshake` fuzz target (fuzz/, RELIABILITY.md): a reply
//! whose lease board lay anywhere, of any size, was accepted, and the puller then maps and reads
//! the board at `region_base + board_offset` (`puller/worker.rs`). Owners register the board
//! right after the pool (`region_len` counts the pool), at most 4096 records.

use pd_kv_pool::{KvDtype, KvLayout, KvOrder};
use pd_kv_transfer::compat::{CompatInfo, TRANSFER_PROTOCOL_VERSION};
use pd_kv_transfer::peer::{TransferError, check_handshake_reply};
use pd_kv_transfer::service::compat_to_proto;
use pd_rpc::kv::{HandshakeReply, Layout};

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

/// A compatible producer's reply: 8 blocks of 16 tokens, the region exactly the pool, the board
/// as given.
fn reply(board_offset: u64, board_slots: u32) -> HandshakeReply {
    let local = local();
    let layout = KvLayout {
        num_blocks: 8,
        block_size: 16,
        num_layers: 4,
        num_kv_heads: 2,
        head_dim: 64,
        dtype: KvDtype::F16,
        order: KvOrder::Hnd,
    };
    let block_bytes = layout.block_bytes() as u64;
    HandshakeReply {
        engine_id: "p1".into(),
        epoch: 7,
        compat: Some(compat_to_proto(&local)),
        region_base: 0x7f00_0000_0000,
        region_len: block_bytes * 8,
        layout: Some(Layout {
            num_blocks: 8,
            block_size: 16,
            num_layers: 4,
            num_kv_heads: 2,
            head_dim: 64,
            dtype: "f16".into(),
            dim_order: KvOrder::Hnd.dim_order().into(),
            block_bytes,
        }),
        board_offset,
        board_slots,
        ..HandshakeReply::default()
    }
}

#[test]
fn a_board_right_after_the_pool_is_accepted() {
    let r = reply(0, 0);
    let len = r.region_len;
    // As every owner registers it (`kv_side_channel.rs`): at the pool's end, 4096 records.
    let info = check_handshake_reply(&local(), false, reply(len, 4096), "10.0.0.1", 0).unwrap();
    assert_eq!((info.board_offset, info.board_slots), (len, 4096));
    assert!(check_handshake_reply(&local(), false, r, "10.0.0.1", 0).is_ok());
}

#[test]
fn a_board_anywhere_else_or_larger_is_refused() {
    let len = reply(0, 0).region_len;
    for (offset, slots) in [
        // The fuzzer's find: far more slots than an owner makes.
        (len, 1 << 20),
        // Over the pool, or past its end.
        (64, 4),
        (len + 4096, 4),
        // An offset that wraps.
        (u64::MAX - 8, 1),
    ] {
        let got = check_handshake_reply(&local(), false, reply(offset, slots), "10.0.0.1", 0);
        assert!(
            matches!(got, Err(TransferError::HandshakeRefused(_))),
            "{offset} {slots}: {got:?}"
        );
    }
}

#[test]
fn a_region_that_wraps_the_address_space_is_refused() {
    let mut r = reply(0, 0);
    r.region_base = u64::MAX - 16;
    let got = check_handshake_reply(&local(), false, r, "10.0.0.1", 0);
    assert!(
        matches!(got, Err(TransferError::HandshakeRefused(_))),
        "{got:?}"
    );
}
