//! A component's declaration that it keeps no state between calls: a custom section named
//! [`STATELESS_SECTION`] at the top level of the component (empty payload).
//!
//! Why the component carries it, not the [`PolicySpec`](crate::PolicySpec): whether `decide`
//! depends on anything but its arguments and the host imports is a property of the policy's
//! code, known to its author, and it must travel with the exact bytes the gateway stores,
//! restores after a restart and replays (all keyed by the component's sha256). The contract
//! (`pd:policy@1.0.0`) is unchanged: a custom section is invisible to wasmtime's type checks
//! and to every other host.
//!
//! What it changes: a declared-stateless policy may be called in a warm instance that served
//! earlier calls (`engine/call.rs`), which skips the fresh instance's cold pages and runtime
//! start-up; every other policy keeps a fresh store per call. Any build can be declared after
//! the fact: [`declare_stateless`] here, `pd-gateway policy push --stateless`, or by hand
//! (`printf '\x00\x14\x13pd:policy/stateless' >> policy.wasm`).

/// The custom section's name.
pub const STATELESS_SECTION: &str = "pd:policy/stateless";

/// The 8-byte preamble of a component (magic, version 0x0d, layer 1).
const COMPONENT_PREAMBLE: [u8; 8] = *b"\0asm\x0d\0\x01\0";

/// `component` with the stateless declaration appended (unchanged if it already has one).
/// A custom section may sit anywhere in a component, so appending keeps it valid; its sha256
/// changes, as it should: the declaration is part of what is loaded.
pub fn declare_stateless(component: &[u8]) -> Vec<u8> {
    let mut out = component.to_vec();
    if declares_stateless(component) {
        return out;
    }
    let name = STATELESS_SECTION.as_bytes();
    let mut payload = Vec::with_capacity(name.len() + 5);
    leb128(&mut payload, name.len());
    payload.extend_from_slice(name);
    out.push(0); // custom section id
    leb128(&mut out, payload.len());
    out.extend_from_slice(&payload);
    out
}

/// Whether `component` carries the stateless declaration at its top level. Anything that does
/// not parse as a component's section list reads as "no declaration": the safe answer.
pub fn declares_stateless(component: &[u8]) -> bool {
    let Some(mut rest) = component.strip_prefix(&COMPONENT_PREAMBLE[..]) else {
        return false;
    };
    while let Some((&id, after_id)) = rest.split_first() {
        let Some((size, after_size)) = read_leb128(after_id) else {
            return false;
        };
        let Some((section, next)) = after_size.split_at_checked(size) else {
            return false;
        };
        if id == 0 && custom_name(section) == Some(STATELESS_SECTION.as_bytes()) {
            return true;
        }
        rest = next;
    }
    false
}

/// The name of a custom section whose contents are `section`.
fn custom_name(section: &[u8]) -> Option<&[u8]> {
    let (len, rest) = read_leb128(section)?;
    rest.get(..len)
}

fn leb128(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// An unsigned LEB128 of at most 5 bytes (a u32, as the binary format bounds sizes) and what
/// follows it.
fn read_leb128(bytes: &[u8]) -> Option<(usize, &[u8])> {
    let mut n: u64 = 0;
    for (i, &b) in bytes.iter().enumerate().take(5) {
        n |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((usize::try_from(n).ok()?, &bytes[i + 1..]));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_declared_component_reads_back_as_stateless_and_declaring_twice_adds_nothing() {
        // An empty component: the preamble alone.
        let bare = COMPONENT_PREAMBLE.to_vec();
        assert!(!declares_stateless(&bare));
        let declared = declare_stateless(&bare);
        assert!(declares_stateless(&declared));
        assert_eq!(declare_stateless(&declared), declared);
        // The by-hand recipe of the module docs writes the same bytes.
        let mut by_hand = bare.clone();
        by_hand.extend_from_slice(b"\x00\x14\x13pd:policy/stateless");
        assert_eq!(by_hand, declared);
    }

    #[test]
    fn other_sections_modules_and_garbage_are_not_a_declaration() {
        let mut other = COMPONENT_PREAMBLE.to_vec();
        other.extend_from_slice(b"\x00\x05\x04name");
        assert!(!declares_stateless(&other));
        // A core module is not a component.
        let mut module = b"\0asm\x01\0\0\0".to_vec();
        module.extend_from_slice(b"\x00\x14\x13pd:policy/stateless");
        assert!(!declares_stateless(&module));
        // A section whose size runs past the end.
        let mut cut = COMPONENT_PREAMBLE.to_vec();
        cut.extend_from_slice(b"\x00\x7f\x13pd:policy/stateless");
        assert!(!declares_stateless(&cut));
        assert!(!declares_stateless(b""));
    }
}
