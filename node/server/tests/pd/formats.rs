//! KV in every form a node keeps it: other block sizes and layouts (converted on pull), f16 and
//! bf16 KV, KV staged through a transfer pool as on a GPU, and a model served from a GGUF file.
//! Every answer equals one node's, token for token.

use super::*;

/// Issue 13, heterogeneous peers on CPU: producers and consumers whose block sizes (16 ↔ 32)
/// and block layouts (`hnd`, the CPU order, ↔ `nhd`, the GPU order) differ still hand KV over
/// — the consumer converts what it pulls — through the mapped copy and through UCX gets into a
/// staging buffer, in both directions. Every answer equals one node's, token for token, with KV
/// pulled, counted as converted where the layouts differ. A second prompt extending the first
/// makes the consumer pull from the middle of the producer's blocks (its own prefix cache holds
/// the start).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_other_block_sizes_and_layouts_hand_over_kv_token_exact() {
    let dir = model("hetero");
    let solo = start(&dir, &["--block-size", "16"]);
    let nhd = ["--kv-layout", "nhd"];
    let prod = |id: &'static str, bs: &'static str, extra: &[&'static str]| {
        let mut a = vec!["--engine-id", id, "--block-size", bs];
        a.extend_from_slice(extra);
        producer(&dir, &a)
    };
    let cons = |id: &'static str, bs: &'static str, extra: &[&'static str]| {
        let mut a = vec!["--engine-id", id, "--block-size", bs];
        a.extend_from_slice(extra);
        consumer_with(&dir, "fail", &a)
    };
    let p16 = prod("p16", "16", &[]);
    let p32n = prod("p32n", "32", &nhd);
    let d32 = cons("d32", "32", &[]);
    let d16n = cons("d16n", "16", &nhd);
    let d32n_get = cons(
        "d32ng",
        "32",
        &["--kv-layout", "nhd", "--kv-pull-via", "get"],
    );
    let d16_get = cons("d16g", "16", &["--kv-pull-via", "get"]);
    // (producer, consumer, whether the layouts differ)
    let pairs = [
        (&p16, &d32, "16 hnd → 32 hnd", true),
        (&p32n, &d16n, "32 nhd → 16 nhd", true),
        (&p16, &d16n, "16 hnd → 16 nhd", true),
        (&p32n, &d32, "32 nhd → 32 hnd", true),
        (&p16, &d32n_get, "16 hnd → 32 nhd, gets", true),
        (&p32n, &d16_get, "32 nhd → 16 hnd, gets", true),
        (&p32n, &d32n_get, "32 nhd → 32 nhd, gets", false),
    ];
    let body = |ids: &[u32]| {
        json!({"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0,
               "ignore_eos": true, "return_token_ids": true})
    };
    let api = Api::Completions;
    for (i, (p, d, what, differ)) in pairs.into_iter().enumerate() {
        let before = metric(d, "pd_kv_rechunked_pulls_total").await;
        // 57 tokens: three and a half blocks of 16, one and three quarters of 32.
        let first: Vec<u32> = (0..57)
            .map(|j| 3 + ((i * 131 + j * 37) % 500) as u32)
            .collect();
        // The same 57 and 19 more: the consumer holds the first blocks of its own size (48 or
        // 32 tokens) and pulls from there, in the middle of a producer's block of 32.
        let mut second = first.clone();
        second.extend((0..19).map(|j| 3 + ((i * 17 + j * 53) % 500) as u32));
        for (k, ids) in [&first, &second].into_iter().enumerate() {
            let b = body(ids);
            let want = seen(api, post(&solo.http, api.path(), &b).await).await;
            let got = through_pd(p, d, api, &b).await;
            assert_eq!(got.tokens, want.tokens, "{what}, prompt {k}");
            let pulled = got.pulled.unwrap_or(0);
            assert!(pulled > 0, "{what}, prompt {k}: pulled {pulled}");
            if k == 1 {
                // Pulled only what the consumer's cache lacked.
                assert!(
                    got.cached.unwrap_or(0) > pulled,
                    "{what}: cached {:?}, pulled {pulled}",
                    got.cached
                );
            }
        }
        let converted = metric(d, "pd_kv_rechunked_pulls_total").await - before;
        assert_eq!(converted, if differ { 2.0 } else { 0.0 }, "{what}");
    }
    // Params that lie about the producer's block size (15 fits the 57 tokens in 4 blocks as
    // well as 16 does, so the request is admitted): the handshake's word decides, the pull
    // fails as a params mismatch (D's policy here is `fail`), nothing is read.
    let ids: Vec<u32> = (0..57).map(|j| 5 + (j * 41) % 500).collect();
    let b = body(&ids);
    let mut params = prefill(&p16, api, &b).await;
    assert_eq!(params["remote_block_size"], 16, "{params}");
    params["remote_block_size"] = json!(15);
    let mut db = b.clone();
    db["kv_transfer_params"] = params;
    let before = metric(
        &d32,
        "pd_kv_transfer_failures_total{reason=\"params_mismatch\"}",
    )
    .await;
    let r = post(&d32.http, api.path(), &db).await;
    assert_eq!(r.status(), 500);
    assert!(r.text().await.unwrap().contains("blocks of 15"));
    assert_eq!(
        metric(
            &d32,
            "pd_kv_transfer_failures_total{reason=\"params_mismatch\"}"
        )
        .await,
        before + 1.0
    );
    for (d, via) in [(&d32, "mapped"), (&d32n_get, "get"), (&d16_get, "get")] {
        assert!(metric(d, &format!("pd_kv_pulls_total{{via=\"{via}\"}}")).await >= 2.0);
    }
}

/// Half-precision KV end to end: P and D with `--kv-cache-dtype f16` answer token for token as
/// one node with f16 KV, pull all of the prompt, and move exactly half the
/// bytes f32 nodes move for the same prompts; an f32 consumer refuses an f16 producer's KV,
/// naming `kv_cache_dtype`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_precision_kv_through_p_and_d_equals_one_node_and_moves_half_the_bytes() {
    let dir = model("f16");
    let f16 = ["--kv-cache-dtype", "f16"];
    let solo = start(&dir, &f16);
    let p = producer(&dir, &f16);
    let d = consumer_with(
        &dir,
        "fail",
        &["--engine-id", "d1", "--kv-cache-dtype", "f16"],
    );
    let p32 = start(
        &dir,
        &[
            "--kv-role",
            "kv_producer",
            "--kv-port",
            "0",
            "--engine-id",
            "p2",
        ],
    );
    let d32 = consumer_with(&dir, "fail", &["--engine-id", "d2"]);
    let api = Api::Completions;
    for (i, stream) in [false, true].into_iter().enumerate() {
        let body = api.body(&format!("{i}{LONG}"), 12);
        let body = if stream { streaming(api, &body) } else { body };
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let got = through_pd(&p, &d, api, &body).await;
        assert_eq!(got.texts, want.texts, "{body}");
        assert_eq!(got.tokens, want.tokens, "{body}");
        let prompt = got.prompt.expect("usage");
        assert_eq!(got.pulled, Some(prompt), "{body}");
        let got32 = through_pd(&p32, &d32, api, &body).await;
        assert_eq!(got32.pulled, Some(prompt), "{body}");
    }
    let bytes16 = metric(&d, "pd_kv_transfer_bytes_total").await;
    let bytes32 = metric(&d32, "pd_kv_transfer_bytes_total").await;
    assert!(bytes16 > 0.0);
    assert_eq!(bytes16 * 2.0, bytes32, "f16 KV moves half the bytes");

    // An f32 consumer and an f16 producer: refused by the handshake's compatibility check.
    refused_for_kv_dtype(&p, &d32).await;
}

/// A prompt prefilled on `p` and sent to `d`, whose KV dtype differs: D answers 500, naming
/// `kv_cache_dtype` (the handshake's compatibility check).
async fn refused_for_kv_dtype(p: &Node, d: &Node) {
    let api = Api::Completions;
    let body = api.body(&format!("mixed{LONG}"), 4);
    let mut db = body.clone();
    db["kv_transfer_params"] = prefill(p, api, &body).await;
    let r = post(&d.http, api.path(), &db).await;
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 500, "{text}");
    assert!(text.contains("kv_cache_dtype"), "{text}");
}

/// The GPU path's staging (`pd_model::kv_store`), run on CPU with `--kv-staged`: the model
/// computes on a second pool; P copies a prompt's blocks into its transfer pool before it
/// leases them, D copies pulled blocks into its compute pool before it reads them. Every
/// pairing of staged and in-place nodes answers token for token as one in-place node: greedy
/// on the chat API (D's cache holds the template's head, computed on its compute pool), a
/// prompt extending an earlier one (D's cached blocks plus pulled ones; P's cached ones
/// leased again), and seeded `n = 3` children (their forks copy partial blocks on the compute
/// pool). Without the copies a staged node would hand over or read zeros. D uploads each pulled
/// block as it lands, from the pull (`--kv-upload-while-pulling`, the default), so its engine
/// copies nothing after a pull; a D started with it off has the engine upload instead, as
/// exactly; so does a D reading with UCX gets (its uploads follow each part's flush). The
/// counters show which copies ran where, and on staged nodes only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_kv_as_on_a_gpu_hands_over_kv_token_exact_on_cpu() {
    let dir = model("staged");
    let solo = start(&dir, &[]);
    let p_staged = producer(&dir, &["--engine-id", "ps", "--kv-staged"]);
    let p_plain = producer(&dir, &["--engine-id", "pp"]);
    let d_staged = consumer_with(&dir, "fail", &["--engine-id", "ds", "--kv-staged"]);
    let d_plain = consumer_with(&dir, "fail", &["--engine-id", "dp"]);
    let d_after = consumer_with(
        &dir,
        "fail",
        &[
            "--engine-id",
            "de",
            "--kv-staged",
            "--kv-upload-while-pulling",
            "false",
        ],
    );
    let pairs = [
        (&p_staged, &d_staged, "staged → staged"),
        (&p_staged, &d_plain, "staged → in place"),
        (&p_plain, &d_staged, "in place → staged"),
        (
            &p_plain,
            &d_after,
            "in place → staged, the engine uploading",
        ),
    ];
    for (i, (p, d, what)) in pairs.into_iter().enumerate() {
        let body = Api::Chat.body(&format!("{i}{LONG}"), 10);
        let want = seen(Api::Chat, post(&solo.http, Api::Chat.path(), &body).await).await;
        let got = through_pd(p, d, Api::Chat, &body).await;
        assert_eq!(got.tokens, want.tokens, "{what}, chat");
        assert!(got.pulled.unwrap_or(0) > 0, "{what}, chat");

        let first = format!("{i} {LONG}");
        let second = format!("{first} Then a few more words, for blocks nobody holds yet.");
        for (k, text) in [first, second].iter().enumerate() {
            let body = Api::Completions.body(text, 10);
            let want = seen(
                Api::Completions,
                post(&solo.http, Api::Completions.path(), &body).await,
            )
            .await;
            let got = through_pd(p, d, Api::Completions, &body).await;
            assert_eq!(got.tokens, want.tokens, "{what}, prompt {k}");
            let pulled = got.pulled.unwrap_or(0);
            assert!(pulled > 0, "{what}, prompt {k}");
            if k == 1 {
                assert!(
                    got.cached.unwrap_or(0) > pulled,
                    "{what}: D's cache held the first prompt ({:?} cached, {pulled} pulled)",
                    got.cached
                );
            }
        }

        seeded_children_equal_one_node(&solo, p, d, &format!("{i}"), what).await;
    }
    let down = "pd_node_kv_staged_blocks_down_total";
    let up = "pd_node_kv_staged_blocks_up_total";
    let landed = "pd_kv_landed_blocks_total";
    assert!(metric(&p_staged, down).await > 0.0);
    // Each copy is timed: one per lease on P; on D one per pull, where the engine uploads.
    assert_eq!(
        metric(&p_staged, "pd_node_kv_staging_down_seconds_count").await,
        metric(&p_staged, "pd_kv_leases_total{event=\"granted\"}").await
    );
    // D's pulls uploaded every block they pulled (token-exact above, with nothing uploaded
    // after them); with the flag off, the engine did.
    assert!(metric(&d_staged, landed).await > 0.0);
    assert_eq!(
        metric(&d_staged, up).await,
        0.0,
        "the engine uploaded nothing"
    );
    assert_eq!(
        metric(&d_staged, "pd_node_kv_staging_up_seconds_count").await,
        0.0
    );
    assert!(metric(&d_after, up).await > 0.0);
    assert!(metric(&d_after, "pd_node_kv_staging_up_seconds_count").await > 0.0);
    assert_eq!(metric(&d_after, landed).await, 0.0);
    for plain in [&p_plain, &d_plain] {
        assert_eq!(metric(plain, down).await, 0.0);
        assert_eq!(metric(plain, up).await, 0.0);
        assert_eq!(metric(plain, landed).await, 0.0);
    }
    assert_eq!(metric(&d_staged, down).await, 0.0, "D leases nothing");
    for p in [&p_staged, &p_plain] {
        eventually("P's leases released", async || {
            metric(p, "pd_kv_leases_live").await == 0.0
        })
        .await;
    }
}

/// A cluster computing in bf16 (`--dtype bf16`, a GPU node's usual choice; here on CPU), with
/// P staging its KV as a GPU node does: greedy chat and completions and seeded `n = 3` through
/// P and D equal one bf16 node token for token, every prompt token pulled. The KV follows the
/// model's dtype by default: a bf16 pull moves half the bytes of the same prompt's f32 pull,
/// and an f32 consumer is refused by the handshake's `kv_cache_dtype` check, by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bf16_cluster_hands_over_kv_token_exact_against_one_bf16_node() {
    let dir = model("bf16");
    let bf16 = ["--dtype", "bf16"];
    let solo = start(&dir, &bf16);
    let p = producer(&dir, &["--dtype", "bf16", "--kv-staged"]);
    let d = consumer_with(&dir, "fail", &["--engine-id", "d1", "--dtype", "bf16"]);
    let d32 = consumer_with(&dir, "fail", &["--engine-id", "d2"]);
    let p32 = producer(&dir, &["--engine-id", "p2"]);
    for (i, api) in [Api::Chat, Api::Completions].into_iter().enumerate() {
        let body = api.body(&format!("{i}{LONG}"), 12);
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let got = through_pd(&p, &d, api, &body).await;
        assert_eq!(got.tokens, want.tokens, "{api:?}");
        assert_eq!(got.pulled, got.prompt, "{api:?}: every prompt token pulled");
        assert!(got.pulled.unwrap_or(0) > 0, "{api:?}");
    }
    seeded_children_equal_one_node(&solo, &p, &d, "n", "bf16").await;

    // The same prompt through an f32 pair: twice the bytes.
    let api = Api::Completions;
    let body = api.body(&format!("bytes{LONG}"), 4);
    let (b16, b32) = (
        metric(&d, "pd_kv_transfer_bytes_total").await,
        metric(&d32, "pd_kv_transfer_bytes_total").await,
    );
    let got16 = through_pd(&p, &d, api, &body).await;
    let got32 = through_pd(&p32, &d32, api, &body).await;
    assert_eq!(got16.pulled, got32.pulled);
    let moved16 = metric(&d, "pd_kv_transfer_bytes_total").await - b16;
    let moved32 = metric(&d32, "pd_kv_transfer_bytes_total").await - b32;
    assert!(moved16 > 0.0);
    assert_eq!(moved16 * 2.0, moved32, "bf16 KV moves half the bytes");

    // A bf16 producer and an f32 consumer: refused, naming the field.
    refused_for_kv_dtype(&p, &d32).await;
}

/// `pd-node gen-tiny-model --gguf q8_0` writes one GGUF file (what a GPU session serves to try
/// candle's quantized CUDA kernels); served by P, D and one node, its greedy output through P
/// and D equals the one node's, every prompt token pulled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generated_gguf_file_hands_over_kv_token_exact() {
    let file = std::env::temp_dir().join(format!("pd-pd-gguf-{}.gguf", std::process::id()));
    let status = Command::new(env!("CARGO_BIN_EXE_pd-node"))
        .args(["gen-tiny-model", "--seed", "5", "--gguf", "q8_0", "--out"])
        .arg(&file)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let magic = std::fs::read(&file).unwrap();
    assert_eq!(&magic[..4], b"GGUF", "a GGUF file, not a directory");
    let solo = start(&file, &[]);
    let p = producer(&file, &[]);
    let d = consumer(&file, "fail");
    let api = Api::Completions;
    let body = api.body(&format!("gguf{LONG}"), 12);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let got = through_pd(&p, &d, api, &body).await;
    assert_eq!(got.tokens, want.tokens);
    assert!(got.pulled.unwrap_or(0) > 0);
    assert_eq!(got.pulled, got.prompt);
    let _ = std::fs::remove_file(&file);
}

/// Seeded `n = 3` sampling (children forked copy-on-write on D) through `p` and `d` equals
/// `solo`, child for child; the children differ from each other.
async fn seeded_children_equal_one_node(solo: &Node, p: &Node, d: &Node, salt: &str, what: &str) {
    let body = json!({"model": "tiny", "prompt": format!("{salt}{SHORT} {LONG}"),
        "max_tokens": 9, "n": 3, "seed": 7, "temperature": 0.9, "ignore_eos": true,
        "return_token_ids": true});
    let api = Api::Completions;
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    assert_ne!(want.tokens[0], want.tokens[1], "seeded children differ");
    let got = through_pd(p, d, api, &body).await;
    assert_eq!(got.tokens, want.tokens, "{what}, n = 3");
}
