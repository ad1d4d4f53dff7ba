//! A faster lowering of the view's `list<node>` into the guest.
//!
//! wasmtime's derived lowering stores a record list field by field, and every field store
//! looks the guest's memory up again through the store and instance: about 50 ns per node,
//! 3 µs for a 64-node view, more than the rest of a call. [`FastNode`] is a `Node` with the
//! same component type whose list store writes the canonical-ABI bytes of all nodes into
//! one borrowed slice of guest memory.
//!
//! This implements wasmtime's `ComponentType`/`Lower` traits by hand, which wasmtime calls an
//! implementation detail (their items are `#[doc(hidden)]`); the workspace pins wasmtime to
//! an exact version, and the unit tests below check the layout against wasmtime's own ABI
//! arithmetic. The `echo` guest test (`tests/limits.rs`) checks every field end to end.

#![allow(unreachable_pub, missing_docs, missing_debug_implementations)]

use std::mem::MaybeUninit;

use wasmtime::component::__internal::{
    CanonicalAbiInfo, InstanceType, InterfaceType, LowerContext,
};
use wasmtime::component::{ComponentType, Lower};

use crate::{Node, Role, View};

/// Canonical-ABI size of a `node` record in a 32-bit memory.
const NODE_SIZE: usize = 40;

// Field offsets of `node` (WIT field order; `role` is an enum stored as one byte, `draining`
// a bool byte, everything else `u32`).
const ROLE: usize = 0;
const FREE_BLOCKS: usize = 4;
const TOTAL_BLOCKS: usize = 8;
const LEASED_BLOCKS: usize = 12;
const WAITING: usize = 16;
const RUNNING: usize = 20;
const WAITING_REMOTE_KV: usize = 24;
const DRAINING: usize = 28;
const CONVERSATION_TOKENS: usize = 32;
const CONVERSATION_EXPIRY_MS: usize = 36;

const _: () = assert!(<Node as ComponentType>::ABI.size32 as usize == NODE_SIZE);
const _: () = assert!(<Node as ComponentType>::ABI.align32 == 4);

/// The enum's case index: its order in the WIT (checked by `Role`'s typecheck).
fn role_byte(role: Role) -> u8 {
    match role {
        Role::Prefill => 0,
        Role::Decode => 1,
        Role::Standalone => 2,
    }
}

/// A `Node` whose lists lower in one pass.
#[repr(transparent)]
pub(crate) struct FastNode(Node);

impl FastNode {
    /// Views `nodes` as `FastNode`s, without copying.
    pub(crate) fn slice(nodes: &[Node]) -> &[FastNode] {
        // SAFETY: `FastNode` is `repr(transparent)` over `Node`: same size, alignment and
        // validity, so a slice of one is a slice of the other.
        unsafe { &*(nodes as *const [Node] as *const [FastNode]) }
    }

    fn store(&self, out: &mut [u8]) {
        let n = &self.0;
        let mut put = |at: usize, v: u32| out[at..at + 4].copy_from_slice(&v.to_le_bytes());
        put(ROLE, u32::from(role_byte(n.role))); // role byte, then zeroed padding
        put(FREE_BLOCKS, n.free_blocks);
        put(TOTAL_BLOCKS, n.total_blocks);
        put(LEASED_BLOCKS, n.leased_blocks);
        put(WAITING, n.waiting);
        put(RUNNING, n.running);
        put(WAITING_REMOTE_KV, n.waiting_remote_kv);
        put(DRAINING, u32::from(n.draining)); // bool byte, then zeroed padding
        put(CONVERSATION_TOKENS, n.conversation_tokens);
        put(CONVERSATION_EXPIRY_MS, n.conversation_expiry_ms);
    }
}

// SAFETY: the same component type as `Node` in every respect (forwarded), and `Lower` below
// writes exactly `Node`'s canonical-ABI representation.
unsafe impl ComponentType for FastNode {
    type Lower = <Node as ComponentType>::Lower;

    const ABI: CanonicalAbiInfo = <Node as ComponentType>::ABI;
    const MAY_REQUIRE_REALLOC: bool = <Node as ComponentType>::MAY_REQUIRE_REALLOC;

    fn typecheck(ty: &InterfaceType, types: &InstanceType<'_>) -> wasmtime::Result<()> {
        <Node as ComponentType>::typecheck(ty, types)
    }
}

// SAFETY: single values lower through `Node`'s derived code; lists write the same bytes.
unsafe impl Lower for FastNode {
    fn linear_lower_to_flat<T>(
        &self,
        cx: &mut LowerContext<'_, T>,
        ty: InterfaceType,
        dst: &mut MaybeUninit<Self::Lower>,
    ) -> wasmtime::Result<()> {
        self.0.linear_lower_to_flat(cx, ty, dst)
    }

    fn linear_lower_to_memory<T>(
        &self,
        cx: &mut LowerContext<'_, T>,
        ty: InterfaceType,
        offset: usize,
    ) -> wasmtime::Result<()> {
        self.0.linear_lower_to_memory(cx, ty, offset)
    }

    fn linear_store_list_to_memory<T>(
        cx: &mut LowerContext<'_, T>,
        _ty: InterfaceType,
        offset: usize,
        items: &[Self],
    ) -> wasmtime::Result<()> {
        let len = items.len() * NODE_SIZE; // no overflow: wasmtime sized this allocation
        let Some(out) = cx
            .as_slice_mut()
            .get_mut(offset..)
            .and_then(|m| m.get_mut(..len))
        else {
            wasmtime::bail!("node list at {offset} (+{len} bytes) is outside guest memory");
        };
        for (out, node) in out.chunks_exact_mut(NODE_SIZE).zip(items) {
            node.store(out);
        }
        Ok(())
    }
}

/// `View` with its nodes as [`FastNode`]s: the same component type (`record view`).
#[derive(wasmtime::component::ComponentType, wasmtime::component::Lower)]
#[component(record)]
pub(crate) struct FastView<'a> {
    nodes: &'a [FastNode],
}

impl<'a> FastView<'a> {
    pub(crate) fn new(view: &'a View) -> Self {
        FastView {
            nodes: FastNode::slice(&view.nodes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_wasmtime_abi_arithmetic() {
        const U8: CanonicalAbiInfo = <u8 as ComponentType>::ABI;
        const ROLE_ABI: CanonicalAbiInfo = <Role as ComponentType>::ABI;
        const BOOL: CanonicalAbiInfo = <bool as ComponentType>::ABI;
        const U32: CanonicalAbiInfo = <u32 as ComponentType>::ABI;
        assert_eq!((ROLE_ABI.size32, ROLE_ABI.align32), (U8.size32, U8.align32));
        let fields = [
            (ROLE_ABI, ROLE),
            (U32, FREE_BLOCKS),
            (U32, TOTAL_BLOCKS),
            (U32, LEASED_BLOCKS),
            (U32, WAITING),
            (U32, RUNNING),
            (U32, WAITING_REMOTE_KV),
            (BOOL, DRAINING),
            (U32, CONVERSATION_TOKENS),
            (U32, CONVERSATION_EXPIRY_MS),
        ];
        let mut offset = 0usize;
        for (abi, want) in &fields {
            assert_eq!(abi.next_field32_size(&mut offset), *want);
        }
        let record = CanonicalAbiInfo::record_static(&fields.map(|(abi, _)| abi));
        assert_eq!(record.size32 as usize, NODE_SIZE);
    }

    #[test]
    fn stores_little_endian_fields() {
        let node = Node {
            role: Role::Standalone,
            free_blocks: 0x0102_0304,
            total_blocks: 5,
            leased_blocks: 6,
            waiting: 7,
            running: 8,
            waiting_remote_kv: 9,
            draining: true,
            conversation_tokens: 10,
            conversation_expiry_ms: u32::MAX,
        };
        let mut out = [0xAAu8; NODE_SIZE];
        FastNode(node).store(&mut out);
        assert_eq!(&out[0..8], &[2, 0, 0, 0, 4, 3, 2, 1]);
        assert_eq!(&out[24..32], &[9, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(&out[36..40], &[0xFF; 4]);
    }
}
