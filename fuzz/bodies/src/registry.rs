//! A node's registry messages as the gateway reads them (`gateway/server/src/registry.rs`):
//! protobuf bytes decoded with prost as tonic decodes them, then, for a registration, its
//! addresses (`pd_gateway::registry::reachable`, with feature `gateway`), its role, and its
//! tokenizer bundle rebuilt and fingerprinted (`Tokenizer::from_files`, as `tokenizer_of`
//! does). The gateway's messages to a node are decoded too (`pd-report` reads them).
//!
//! Properties: nothing panics; a registered address the gateway accepts is never a wildcard,
//! nor a loopback address when the registration came from another machine; a tokenizer bundle
//! that builds has one fingerprint however often it is built.

use pd_rpc::registry as pb;
use pd_tokenize::Tokenizer;
use prost::Message;

use crate::input::Input;

/// The target.
pub fn run(data: &[u8]) {
    crate::caught_panics_are_not_crashes();
    let mut input = Input::new(data);
    let observed = match input.byte() % 4 {
        0 => None,
        1 => Some(std::net::IpAddr::from([127, 0, 0, 1])),
        2 => Some(std::net::IpAddr::from([10, 1, 2, 3])),
        _ => Some("fd00::7".parse().expect("an address")),
    };
    let bytes = input.rest();
    let _ = pb::GatewayMessage::decode(bytes);
    let Ok(m) = pb::NodeMessage::decode(bytes) else {
        return;
    };
    // What tonic would send back is what was read.
    let again = pb::NodeMessage::decode(m.encode_to_vec().as_slice()).expect("re-encoded");
    assert_eq!(again, m);
    let Some(pb::node_message::Msg::Register(reg)) = m.msg else {
        return;
    };
    addresses(&reg, observed);
    if let Some(bundle) = &reg.tokenizer {
        let files = bundle
            .files
            .iter()
            .map(|f| (f.name.clone(), f.content.clone()))
            .collect();
        if let Ok(t) = Tokenizer::from_files(&files) {
            let again = Tokenizer::from_files(t.files()).expect("a tokenizer's own files build");
            assert_eq!(t.fingerprint(), again.fingerprint());
            let _ = t.encode("hello", true);
        }
    }
}

#[cfg(feature = "gateway")]
fn addresses(reg: &pb::Register, observed: Option<std::net::IpAddr>) {
    let _ = pd_gateway::cluster::role_of(reg.role());
    for addr in [&reg.http_addr, &reg.kv_side_channel_addr] {
        let Ok(dial) = pd_gateway::registry::reachable(addr, observed) else {
            continue;
        };
        let Ok(sa) = dial.parse::<std::net::SocketAddr>() else {
            continue;
        };
        let ip = sa.ip().to_canonical();
        assert!(!ip.is_unspecified(), "{addr:?} accepted as {dial}");
        if observed.is_some_and(|o| !o.is_loopback()) {
            assert!(
                !ip.is_loopback(),
                "{addr:?} from {observed:?} accepted as {dial}"
            );
        }
    }
}

#[cfg(not(feature = "gateway"))]
fn addresses(_: &pb::Register, _: Option<std::net::IpAddr>) {}
