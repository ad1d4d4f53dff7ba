//! The binding of leased KV to the exact prompt it holds: a 128-bit MAC of the prompt's token
//! ids under a key every node of a cluster derives from the cluster token.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Domain tag of the key derived from a cluster token ([`BindingKey::from_cluster_token`]).
const KEY_TAG: &[u8] = b"pd-kv-binding-v1\0";
/// Domain tag of the bound message (the token ids follow it).
const PROMPT_TAG: &[u8] = b"pd-kv-prompt-v3\0";

/// The key of a cluster's prompt bindings ([`prompt_binding`]). Built once at a node's start
/// and handed to whatever computes or checks a binding; a prefill node and the decode nodes
/// that pull from it must hold the same key, which they do when they share the cluster token.
///
/// Keyed, a binding cannot be computed without the token, so a client cannot search offline for
/// two prompts that bind alike (a decode node would then decode one on the other's KV, and cache
/// that KV under the other's block hashes). Without a cluster token (loopback-only clusters) the
/// key is derived from the empty token, which anyone can: the binding is then only as strong as
/// an unkeyed 128-bit hash (a collision costs about 2^64 work).
///
/// `Debug` never prints the key.
#[derive(Clone)]
pub struct BindingKey(Keying);

#[derive(Clone)]
enum Keying {
    /// HMAC-SHA-256 under this key.
    Keyed([u8; 32]),
    /// Test builds only: unkeyed SHA-256 cut to its low `bits` bits
    /// ([`BindingKey::insecure_unkeyed`]).
    #[cfg(debug_assertions)]
    Unkeyed { bits: u32 },
}

impl BindingKey {
    /// The key of a cluster whose token is `token` (empty: none; see the type's doc):
    /// SHA-256 of a domain tag and the token.
    pub fn from_cluster_token(token: &str) -> Self {
        let mut h = Sha256::new();
        h.update(KEY_TAG);
        h.update(token.as_bytes());
        Self(Keying::Keyed(h.finalize().into()))
    }

    /// Debug builds only, for tests that show the attack a weak binding allows: no key, and only
    /// the low `bits` bits (1 to 128) of an unkeyed SHA-256 of the prompt, which anyone can
    /// compute offline. `None` for another width.
    #[cfg(debug_assertions)]
    pub fn insecure_unkeyed(bits: u32) -> Option<Self> {
        (1..=128)
            .contains(&bits)
            .then_some(Self(Keying::Unkeyed { bits }))
    }

    /// Bits of a binding under this key that an attacker must match: 128 for a keyed one.
    pub fn bits(&self) -> u32 {
        match self.0 {
            Keying::Keyed(_) => 128,
            #[cfg(debug_assertions)]
            Keying::Unkeyed { bits } => bits,
        }
    }

    /// Whether `claimed` is the binding of `tokens` under this key, compared in constant time
    /// (the comparison's time says nothing of how many bytes matched).
    pub fn verify(&self, tokens: &[u32], claimed: u128) -> bool {
        bindings_equal(prompt_binding(self, tokens), claimed)
    }
}

impl std::fmt::Debug for BindingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Keying::Keyed(_) => f.write_str("BindingKey(keyed)"),
            #[cfg(debug_assertions)]
            Keying::Unkeyed { bits } => write!(f, "BindingKey(insecure: unkeyed, {bits} bits)"),
        }
    }
}

/// The binding of KV to the exact prompt it was computed for: HMAC-SHA-256 under `key` of a
/// domain tag and the token ids (little-endian `u32`s), its first 128 bits. Carried as
/// `remote_prompt_hash` and in a lease's attested contents; a decode node checks it against
/// its own prompt's ([`BindingKey::verify`]) before using pulled blocks. Compare bindings with
/// [`bindings_equal`], never `==`.
///
/// 0 never comes out of a real prompt in practice; it means "not said" where a binding is
/// optional.
pub fn prompt_binding(key: &BindingKey, tokens: &[u32]) -> u128 {
    match key.0 {
        Keying::Keyed(ref k) => {
            let mut mac =
                <Hmac<Sha256> as Mac>::new_from_slice(k).expect("HMAC takes a key of any length");
            mac.update(PROMPT_TAG);
            for t in tokens {
                mac.update(&t.to_le_bytes());
            }
            first_128(&mac.finalize().into_bytes())
        }
        #[cfg(debug_assertions)]
        Keying::Unkeyed { bits } => {
            let mut h = Sha256::new();
            h.update(PROMPT_TAG);
            for t in tokens {
                h.update(t.to_le_bytes());
            }
            let full = first_128(&h.finalize());
            if bits >= 128 {
                full
            } else {
                full & ((1u128 << bits) - 1)
            }
        }
    }
}

/// Whether two bindings are equal, in constant time.
pub fn bindings_equal(a: u128, b: u128) -> bool {
    a.to_le_bytes().ct_eq(&b.to_le_bytes()).into()
}

/// The first 16 bytes of a 32-byte digest, little-endian.
fn first_128(digest: &[u8]) -> u128 {
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    u128::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn different_keys_give_different_bindings() {
        let tokens = [1, 2, 3, 4, 5];
        let a = BindingKey::from_cluster_token("cluster-a");
        let b = BindingKey::from_cluster_token("cluster-b");
        let none = BindingKey::from_cluster_token("");
        let all = [
            prompt_binding(&a, &tokens),
            prompt_binding(&b, &tokens),
            prompt_binding(&none, &tokens),
        ];
        assert_ne!(all[0], all[1]);
        assert_ne!(all[0], all[2]);
        assert_ne!(all[1], all[2]);
        // The same token gives the same key: a prefill node and its decode nodes agree.
        let again = BindingKey::from_cluster_token("cluster-a");
        assert_eq!(prompt_binding(&again, &tokens), all[0]);
        // Another prompt, another binding; order matters.
        assert_ne!(prompt_binding(&a, &[1, 2, 3, 5, 4]), all[0]);
        assert_ne!(prompt_binding(&a, &tokens[..4]), all[0]);
    }

    #[test]
    fn the_binding_is_128_bits_wide() {
        let key = BindingKey::from_cluster_token("t");
        assert_eq!(key.bits(), 128);
        // Over many prompts, every one of the 128 bits is set somewhere and clear somewhere
        // (a value cut to fewer bits would leave the high ones clear).
        let (mut any, mut all) = (0u128, u128::MAX);
        for i in 0..64u32 {
            let b = prompt_binding(&key, &[i, i + 1]);
            any |= b;
            all &= b;
        }
        assert_eq!(any, u128::MAX);
        assert_eq!(all, 0);
        // Exactly the HMAC-SHA-256's first 16 bytes.
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&Sha256::digest([KEY_TAG, b"t"].concat())[..])
                .unwrap();
        mac.update(PROMPT_TAG);
        mac.update(&7u32.to_le_bytes());
        let full = mac.finalize().into_bytes();
        assert_eq!(
            prompt_binding(&key, &[7]).to_le_bytes(),
            full[..16],
            "the first 128 bits of HMAC-SHA-256"
        );
    }

    #[test]
    fn bindings_are_compared_in_constant_time() {
        let key = BindingKey::from_cluster_token("t");
        let b = prompt_binding(&key, &[1, 2, 3]);
        assert!(key.verify(&[1, 2, 3], b));
        assert!(!key.verify(&[1, 2, 4], b));
        // Every single-bit difference is a mismatch, wherever it is.
        for bit in 0..128 {
            assert!(!key.verify(&[1, 2, 3], b ^ (1u128 << bit)), "bit {bit}");
        }
        // The comparison is subtle's `ct_eq` (no early exit), the one `verify` uses.
        assert_eq!(
            bool::from(b.to_le_bytes().ct_eq(&b.to_le_bytes())),
            bindings_equal(b, b)
        );
        assert!(!bindings_equal(b, b ^ 1));
    }

    #[test]
    fn the_key_is_never_printed() {
        let key = BindingKey::from_cluster_token("secret-token");
        let shown = format!("{key:?} {key:#?}");
        assert_eq!(format!("{key:?}"), "BindingKey(keyed)");
        assert!(!shown.contains("secret"), "{shown}");
        let derived = Sha256::digest([KEY_TAG, b"secret-token"].concat());
        let hex: String = derived[..4].iter().map(|b| format!("{b:02x}")).collect();
        assert!(!shown.contains(&hex) && !shown.contains('['), "{shown}");
    }

    #[cfg(debug_assertions)]
    #[test]
    fn the_insecure_binding_is_unkeyed_and_narrow() {
        assert!(BindingKey::insecure_unkeyed(0).is_none());
        assert!(BindingKey::insecure_unkeyed(129).is_none());
        let weak = BindingKey::insecure_unkeyed(16).unwrap();
        assert_eq!(weak.bits(), 16);
        assert_eq!(
            format!("{weak:?}"),
            "BindingKey(insecure: unkeyed, 16 bits)"
        );
        let tokens = [9, 8, 7];
        let b = prompt_binding(&weak, &tokens);
        assert!(b <= 0xffff);
        // Unkeyed: the low bits of the full-width unkeyed value, whatever the token.
        let full = prompt_binding(&BindingKey::insecure_unkeyed(128).unwrap(), &tokens);
        assert_eq!(b, full & 0xffff);
        assert_ne!(
            b,
            prompt_binding(&BindingKey::from_cluster_token(""), &tokens) & 0xffff
        );
    }
}
