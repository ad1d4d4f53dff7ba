//! Each target's body on a few thousand seeded random inputs: the seeds below, and mutations of
//! them (bytes flipped, inserted, removed; cut short; spliced), the same every run. With
//! `PD_FUZZ_SEEDS=<dir>` set, `seeds_for_the_fuzzer` writes the seeds to `<dir>/<target>/`, the
//! fuzzer's starting corpus (`scripts/fuzz.sh`).

use std::path::Path;

use prost::Message;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A retained turn's pull, as a gateway asks a decode node.
const PARAMS: &str = r#"{"kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p1", "remote_block_ids": [4, 5, 6], "remote_host": "10.0.0.1", "remote_port": 7100, "remote_request_id": "gw-1", "remote_lease_id": "0000000000000000000000000000002a", "remote_lease_generation": 3, "remote_num_tokens": 40, "remote_block_size": 16, "remote_engine_epoch": "0x00000000000000ff", "remote_lease_slot": 2, "remote_blocks_expiry_time": 1700000000.5, "tp_size": 1}}"#;

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

fn with_tail(head: &[u8], rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut v = head.to_vec();
    v.push(0xFF);
    v.extend((0..rng.random_range(0..256)).map(|_| rng.random::<u8>()));
    v
}

fn tiny_gguf() -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("pd-fuzz-seed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tiny.gguf");
    let spec = pd_model::tiny::TinySpec {
        layers: 1,
        hidden: 16,
        heads: 2,
        kv_heads: 1,
        vocab: 300,
        intermediate: 16,
        ..Default::default()
    };
    pd_model::tiny::generate_gguf(&spec, &file, candle_core::quantized::GgmlDType::F32).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    bytes
}

fn registration() -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("pd-fuzz-reg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    pd_tokenize::write_byte_level_tokenizer(&dir, 300).unwrap();
    let t = pd_tokenize::Tokenizer::from_dir(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    use pd_rpc::registry as pb;
    let reg = pb::Register {
        protocol_version: 1,
        engine_id: "d1".into(),
        model: "m".into(),
        http_addr: "0.0.0.0:8000".into(),
        kv_side_channel_addr: "127.0.0.1:7100".into(),
        block_size: 16,
        num_blocks: 64,
        tokenizer: Some(pb::TokenizerBundle {
            fingerprint: t.fingerprint(),
            files: t
                .files()
                .iter()
                .map(|(name, content)| pb::TokenizerFile {
                    name: name.clone(),
                    content: content.clone(),
                })
                .collect(),
        }),
        ..Default::default()
    };
    let mut out = vec![2u8];
    out.extend(
        pb::NodeMessage {
            msg: Some(pb::node_message::Msg::Register(reg)),
        }
        .encode_to_vec(),
    );
    out
}

/// Each target's seeds.
fn seeds(target: &str, rng: &mut ChaCha8Rng) -> Vec<Vec<u8>> {
    let random = |rng: &mut ChaCha8Rng, n: usize| -> Vec<u8> {
        (0..rng.random_range(0..n)).map(|_| rng.random()).collect()
    };
    match target {
        "kv_params" => vec![
            with_tail(PARAMS.as_bytes(), rng),
            with_tail(
                format!("[{}]", &PARAMS[23..PARAMS.len() - 1]).as_bytes(),
                rng,
            ),
            with_tail(br#"{"do_remote_decode": true, "num_consumers": 2}"#, rng),
        ],
        "handshake" => (0..4).map(|_| random(rng, 512)).collect(),
        "gguf" => {
            let mut file = vec![0u8];
            file.extend(tiny_gguf());
            vec![file, random(rng, 512)]
        }
        "chat_template" => vec![
            with_tail(CHATML.as_bytes(), rng),
            with_tail(b"{{ raise_exception('no') }}", rng),
            with_tail(
                b"{% for m in messages %}{{ m.content | tojson }}{% endfor %}",
                rng,
            ),
            with_tail(
                b"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                rng,
            ),
        ],
        "registry" => vec![registration(), random(rng, 256)],
        _ => (0..4).map(|_| random(rng, 1024)).collect(),
    }
}

fn mutate(seed: &[u8], rng: &mut ChaCha8Rng, other: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..rng.random_range(1..8) {
        match rng.random_range(0..6) {
            0 if !v.is_empty() => {
                let i = rng.random_range(0..v.len());
                v[i] ^= 1 << rng.random_range(0..8);
            }
            1 if !v.is_empty() => {
                let i = rng.random_range(0..v.len());
                v[i] = rng.random();
            }
            2 => {
                let i = rng.random_range(0..=v.len());
                v.insert(i, rng.random());
            }
            3 if !v.is_empty() => {
                let i = rng.random_range(0..v.len());
                v.remove(i);
            }
            4 if !v.is_empty() => {
                let i = rng.random_range(0..v.len());
                v.truncate(i);
            }
            _ if !other.is_empty() => {
                let i = rng.random_range(0..=v.len());
                let a = rng.random_range(0..other.len());
                let b = rng.random_range(a..=other.len().min(a + 64));
                v.splice(i..i, other[a..b].iter().copied());
            }
            _ => {}
        }
    }
    v
}

/// Runs `body` on the target's seeds and `n` mutations of them.
fn drive(target: &str, n: usize, body: fn(&[u8])) {
    let mut rng = ChaCha8Rng::seed_from_u64(45);
    let seeds = seeds(target, &mut rng);
    for s in &seeds {
        body(s);
    }
    for _ in 0..n {
        let s = &seeds[rng.random_range(0..seeds.len())];
        let o = &seeds[rng.random_range(0..seeds.len())];
        body(&mutate(s, &mut rng, o));
    }
    // Random bytes too.
    for _ in 0..n / 4 {
        let v: Vec<u8> = (0..rng.random_range(0..512))
            .map(|_| rng.random())
            .collect();
        body(&v);
    }
}

#[test]
fn kv_params() {
    drive("kv_params", 4000, crate::kv_params::run);
}

#[test]
fn handshake() {
    drive("handshake", 4000, crate::handshake::run);
}

#[test]
fn gguf() {
    drive("gguf", 1000, crate::gguf::run);
}

#[test]
fn chat_template() {
    drive("chat_template", 1000, crate::chat_template::run);
}

#[test]
fn registry() {
    drive("registry", 1000, crate::registry::run);
}

#[cfg(feature = "gateway")]
#[test]
fn sse_capture() {
    drive("sse_capture", 4000, crate::sse_capture::run);
}

#[cfg(feature = "gateway")]
#[test]
fn sse_merge() {
    drive("sse_merge", 4000, crate::sse_merge::run);
}

/// With `PD_FUZZ_SEEDS=<dir>`: writes every target's seeds to `<dir>/<target>/` (nothing
/// otherwise).
#[test]
fn seeds_for_the_fuzzer() {
    let Some(dir) = std::env::var_os("PD_FUZZ_SEEDS") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(45);
    for target in [
        "kv_params",
        "handshake",
        "gguf",
        "chat_template",
        "registry",
        "sse_capture",
        "sse_merge",
    ] {
        let d = Path::new(&dir).join(target);
        std::fs::create_dir_all(&d).unwrap();
        for (i, s) in seeds(target, &mut rng).iter().enumerate() {
            std::fs::write(d.join(format!("seed-{i}")), s).unwrap();
        }
    }
}
