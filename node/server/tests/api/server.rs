//! The server as operators and load balancers see it: health (failing while draining, serving
//! still), the model list, the node's and vLLM's metrics following the live engine, and the
//! blocks of streams a client leaves freed.

use super::*;

#[tokio::test]
async fn a_draining_node_fails_its_health_check_and_still_serves() {
    let server = Server::start().await;
    assert_eq!(server.get("/health").await.0, 200);
    server.drain.begin();
    assert_eq!(server.get("/health").await.0, 503);
    let body =
        json!({"model": "tiny", "prompt": "still served", "max_tokens": 2, "temperature": 0});
    let (status, answer) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    server.stop().await;
}

#[tokio::test]
async fn health_models_and_metrics() {
    let server = Server::start().await;
    assert_eq!(server.get("/health").await.0, 200);

    let (status, body) = server.get("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["object"], "list");
    let card = &models["data"][0];
    assert_eq!(card["id"], "tiny");
    assert_eq!(card["object"], "model");
    assert_eq!(card["max_model_len"], MAX_MODEL_LEN);
    assert!(card["created"].as_u64().unwrap() > 0);
    assert!(card["owned_by"].is_string());
    // `models.retrieve`: the same card, or 404 for any other id (slashes included).
    let (status, one) = server.get("/v1/models/tiny").await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(serde_json::from_str::<Value>(&one).unwrap(), *card);
    for other in ["/v1/models/other", "/v1/models/org/tiny"] {
        let (status, body) = server.get(other).await;
        assert_eq!(status, 404, "{other}: {body}");
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["code"], "model_not_found", "{body}");
    }

    let (status, text) = server.get("/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "pd_node_kv_blocks_free",
        "pd_node_kv_blocks_capacity",
        "pd_node_requests_running",
        "pd_node_requests_waiting",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}:\n{text}");
    }
    server.stop().await;
}

#[tokio::test]
async fn disconnected_streams_free_their_blocks() {
    let server = Server::start().await;
    let total = server.engine.info().num_blocks;
    assert_eq!(server.engine.free_blocks(), total);
    let max_tokens = MAX_MODEL_LEN - 64;

    drop(open_streams(&server, 4, "stream number").await);

    let generated = wait_all_blocks_free(&server).await;
    // Freed because the requests were aborted, not because they ran to the end.
    assert!(
        generated < (4 * max_tokens) as f64,
        "requests ran to completion ({generated} tokens)"
    );

    // A non-streaming client that gives up: dropping the request future closes the connection,
    // hyper drops the handler, and the handler's request stream aborts the request.
    let request = server
        .client
        .post(server.url("/v1/completions"))
        .json(&json!({"prompt": "patience", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}))
        .send();
    let client = tokio::spawn(request);
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.engine.metrics().running.get() == 0 {
        assert!(Instant::now() < deadline, "request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    client.abort();
    let after = wait_all_blocks_free(&server).await;
    assert!(
        after - generated < max_tokens as f64,
        "request ran to completion ({} tokens)",
        after - generated
    );
    server.stop().await;
}

/// The sample of `name` with vLLM's labels for the test model (`engine="0",model_name="tiny"`),
/// and `extra` labels after them.
fn vllm_metric(text: &str, name: &str, extra: &str) -> Option<f64> {
    let head = format!(r#"{name}{{engine="0",model_name="tiny"{extra}}} "#);
    text.lines()
        .find_map(|l| l.strip_prefix(&head)?.trim().parse().ok())
}

/// What reads a vLLM server's `/metrics` (Kubernetes' inference gateway, llm-d's endpoint
/// picker, autoscalers on the queue) reads a live node: `vllm:` samples move with the engine and
/// equal the node's own in the same scrape.
#[tokio::test]
async fn vllm_metric_names_follow_the_live_engine() {
    let server = Server::start().await;
    let info = server.engine.info();
    let idle_gauges = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ];
    let (_, idle) = server.get("/metrics").await;
    for name in idle_gauges {
        assert_eq!(vllm_metric(&idle, name, ""), Some(0.0), "{name}");
    }
    let config = format!(
        r#",block_size="{}",cache_dtype="{}",num_gpu_blocks="{}""#,
        info.block_size,
        info.kv_layout.dtype.as_str(),
        info.num_blocks
    );
    assert_eq!(
        vllm_metric(&idle, "vllm:cache_config_info", &config),
        Some(1.0),
        "{idle}"
    );

    // One answer run to its length: vLLM's per-request histograms hold it once.
    let (status, done) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "count to five", "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{done}");
    let (_, one) = server.get("/metrics").await;
    let reason = |text: &str, r: &str| {
        vllm_metric(
            text,
            "vllm:request_success_total",
            &format!(r#",finished_reason="{r}""#),
        )
    };
    assert_eq!(reason(&one, "length"), Some(1.0), "{one}");
    assert_eq!(reason(&one, "abort"), Some(0.0));
    assert_eq!(
        vllm_metric(&one, "vllm:request_generation_tokens_sum", ""),
        Some(5.0)
    );
    assert_eq!(
        vllm_metric(&one, "vllm:request_prompt_tokens_sum", ""),
        done["usage"]["prompt_tokens"].as_f64()
    );
    for name in [
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
    ] {
        assert_eq!(vllm_metric(&one, name, ""), Some(1.0), "{name}");
    }

    // Three streams held open mid-generation.
    let open = open_streams(&server, 3, "a long story about the sea, number").await;
    let (_, busy) = server.get("/metrics").await;
    let running = vllm_metric(&busy, "vllm:num_requests_running", "").expect("running");
    let waiting = vllm_metric(&busy, "vllm:num_requests_waiting", "").expect("waiting");
    assert_eq!(running + waiting, 3.0, "{busy}");
    assert_eq!(Some(running), metric(&busy, "pd_node_requests_running"));
    let free = metric(&busy, "pd_node_kv_blocks_free").expect("free");
    let usage = vllm_metric(&busy, "vllm:kv_cache_usage_perc", "").expect("usage");
    assert!(usage > 0.0, "three sequences hold blocks: {usage}");
    assert_eq!(usage, 1.0 - free / info.num_blocks as f64);
    assert_eq!(
        vllm_metric(&busy, "vllm:gpu_cache_usage_perc", ""),
        Some(usage)
    );
    assert_eq!(
        vllm_metric(&busy, "vllm:prompt_tokens_total", ""),
        metric(&busy, "pd_node_prompt_tokens_total")
    );
    assert!(vllm_metric(&busy, "vllm:prompt_tokens_total", "").unwrap() > 0.0);
    assert_eq!(
        vllm_metric(&busy, "vllm:time_to_first_token_seconds_count", ""),
        Some(4.0),
        "{busy}"
    );

    drop(open);
    wait_all_blocks_free(&server).await;
    let (_, after) = server.get("/metrics").await;
    for name in idle_gauges {
        assert_eq!(vllm_metric(&after, name, ""), Some(0.0), "{name}");
    }
    // The clients that left ended their requests as aborts.
    assert_eq!(reason(&after, "abort"), Some(3.0), "{after}");
    assert_eq!(reason(&after, "length"), Some(1.0));
    assert_eq!(
        vllm_metric(&after, "vllm:generation_tokens_total", ""),
        metric(&after, "pd_node_generation_tokens_total")
    );
    server.stop().await;
}
