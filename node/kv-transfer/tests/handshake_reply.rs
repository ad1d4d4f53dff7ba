//! Handshake replies found by the `handshake` fuzz target (fuzz/, RELIABILITY.md): a reply whose
//! pool fits its registered region but whose lease board does not was accepted, and the puller
//! then maps and reads the board at `region_base + board_offset` (`puller/worker.rs`).

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

/// A compatible producer's reply: 8 blocks of 16 tokens, the region exactly the pool.
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
        region_len: block_bytes * 8 + board_offset.min(1 << 20),
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
fn a_board_inside_the_region_is_accepted() {
    let r = reply(0, 0);
    let len = r.region_len;
    // The board after the pool: the region grows by its bytes.
    let mut with_board = reply(len, 4);
    with_board.region_len = len + pd_kv_pool::board_bytes(4) as u64;
    let info = check_handshake_reply(&local(), false, with_board, "10.0.0.1", 0).unwrap();
    assert_eq!((info.board_offset, info.board_slots), (len, 4));
    assert!(check_handshake_reply(&local(), false, r, "10.0.0.1", 0).is_ok());
}

#[test]
fn a_board_beyond_the_region_is_refused() {
    // The fuzzer's find: slots far past the region's end.
    let r = reply(64, 1 << 20);
    let got = check_handshake_reply(&local(), false, r, "10.0.0.1", 0);
    assert!(
        matches!(got, Err(TransferError::HandshakeRefused(_))),
        "{got:?}"
    );
    // An offset that wraps.
    let got = check_handshake_reply(&local(), false, reply(u64::MAX - 8, 1), "10.0.0.1", 0);
    assert!(
        matches!(got, Err(TransferError::HandshakeRefused(_))),
        "{got:?}"
    );
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
