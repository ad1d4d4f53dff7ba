//! Client API keys at the front door (`pd-gateway serve --api-key K`, repeatable): `/v1/` needs
//! one of them (or the trusted client token) as the bearer key, which is what the OpenAI SDKs
//! send as their `api_key`; anything else is a 401 OpenAI error object (`invalid_api_key`) that
//! never reaches a node. `/health` and `/metrics` stay open, as on vLLM. The nodes require a key
//! of their own (`pd-node serve --api-key`) that no client here has: the gateway reaches them
//! with the cluster token it minted and handed them at registration.

use pd_cluster_tests::cluster::{ClusterSpec, Role, TestCluster, args};
use pd_cluster_tests::openai::{self, Api};
use pd_cluster_tests::python;
use serde_json::json;

/// The key `tests/clients/openai_client.py` gives the SDK.
const SDK_KEY: &str = "sk-cluster-test";
const SECOND_KEY: &str = "second-key";
const TRUSTED: &str = "trusted-client-key";
const NODE_KEY: &str = "node-only-key";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_needs_one_of_the_api_keys_and_refusals_reach_no_node() {
    let c = TestCluster::start(
        "api-keys",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            gateway_args: args(&[
                "--api-key",
                SDK_KEY,
                "--api-key",
                SECOND_KEY,
                "--trusted-client-token",
                TRUSTED,
            ]),
            node_args: args(&["--api-key", NODE_KEY]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let gw = &c.gateway.http;
    let body = Api::Chat.body("Who may ask?", 3);

    // Refused: no key, a wrong key, a key of the right length but wrong, another scheme.
    let mut refused = 0.0;
    for bearer in [None, Some("wrong"), Some("sk-cluster-tesT")] {
        let a = openai::send(&c.client, gw, Api::Chat, &body, bearer).await;
        assert_eq!(a.status, 401, "{bearer:?}: {}", a.body);
        let e = a.error.as_ref().expect("an error object");
        assert_eq!(e["code"], "invalid_api_key", "{}", a.body);
        assert_eq!(e["type"], "invalid_request_error", "{}", a.body);
        refused += 1.0;
    }
    let basic = c
        .client
        .post(format!("{gw}/v1/completions"))
        .header("authorization", format!("Basic {SDK_KEY}"))
        .json(&Api::Completions.body("hi", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(basic.status(), 401);
    refused += 1.0;
    let models = c
        .client
        .get(format!("{gw}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 401);
    refused += 1.0;
    let models = c
        .client
        .get(format!("{gw}/v1/models"))
        .bearer_auth(SECOND_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    // `models.retrieve`: the registered model's card, 404 for another.
    for (id, status) in [(openai::MODEL, 200), ("no-such-model", 404)] {
        let r = c
            .client
            .get(format!("{gw}/v1/models/{id}"))
            .bearer_auth(SECOND_KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{id}");
        let v: serde_json::Value = r.json().await.unwrap();
        if status == 200 {
            assert_eq!(v["id"], id);
        } else {
            assert_eq!(v["error"]["code"], "model_not_found");
        }
    }
    // vLLM's tokenizer endpoints are guarded like `/v1/`.
    let tokenize = |key: Option<&str>| {
        let mut r = c
            .client
            .post(format!("{gw}/tokenize"))
            .json(&json!({"prompt": "keyed"}));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    assert_eq!(tokenize(None).await.unwrap().status(), 401);
    refused += 1.0;
    assert_eq!(tokenize(Some(SECOND_KEY)).await.unwrap().status(), 200);
    // Open without a key.
    for path in ["/health", "/metrics"] {
        let r = c.client.get(format!("{gw}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }

    // Accepted: each configured key and the trusted client token, through P and D.
    let mut served = 0.0;
    for key in [SECOND_KEY, TRUSTED] {
        let a = openai::send(
            &c.client,
            gw,
            Api::Completions,
            &Api::Completions.body(key, 3),
            Some(key),
        )
        .await
        .ok();
        assert!(a.pulled_tokens.is_some_and(|p| p > 0), "{}", a.body);
        served += 1.0;
    }
    // The unmodified `openai` package, its `api_key` one of the keys.
    let spec = json!({"api": "chat", "stream": true, "n": 1, "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "Keyed."}]});
    let got = python::run_specs(&python::interpreter(), gw, &[spec]).await;
    assert!(
        got[0]["kv_pulled_tokens"].as_u64().is_some_and(|p| p > 0),
        "{}",
        got[0]
    );
    served += 1.0;

    // A node's own `/v1/` takes its key (or the cluster token), not the gateway's keys.
    for n in &c.nodes {
        for (bearer, status) in [(None, 401), (Some(SDK_KEY), 401), (Some(NODE_KEY), 200)] {
            let mut r = c.client.get(format!("{}/v1/models", n.http));
            if let Some(key) = bearer {
                r = r.bearer_auth(key);
            }
            let r = r.send().await.unwrap();
            assert_eq!(r.status(), status, "{} with {bearer:?}", n.engine_id);
            if status == 401 {
                let v: serde_json::Value = r.json().await.unwrap();
                assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
            }
        }
        let info = c
            .client
            .get(format!("{}/tokenizer_info", n.http))
            .send()
            .await;
        assert_eq!(info.unwrap().status(), 401, "{}", n.engine_id);
        let health = c.client.get(format!("{}/health", n.http)).send().await;
        assert_eq!(health.unwrap().status(), 200);
    }

    // A stored response belongs to the key that made it: another key neither reads, lists,
    // deletes nor continues it (404, as if it never was); its own key still does all four.
    let turn = openai::send(
        &c.client,
        gw,
        Api::Responses,
        &Api::Responses.body("Whose turn?", 3),
        Some(SECOND_KEY),
    )
    .await
    .ok();
    served += 1.0;
    let stored: serde_json::Value = serde_json::from_str(&turn.body).expect("a response object");
    let id = stored["id"].as_str().expect("a response id").to_owned();
    let stored_as = |method: reqwest::Method, path: String, key: &'static str| {
        c.client
            .request(method, format!("{gw}/v1/responses/{path}"))
            .bearer_auth(key)
            .send()
    };
    for key in [SDK_KEY, TRUSTED] {
        for (method, path) in [
            (reqwest::Method::GET, id.clone()),
            (reqwest::Method::GET, format!("{id}/input_items")),
            (reqwest::Method::DELETE, id.clone()),
        ] {
            let r = stored_as(method.clone(), path.clone(), key).await.unwrap();
            assert_eq!(r.status(), 404, "{method} {path} with another key");
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(
                v["error"]["message"],
                format!("Response with id '{id}' not found."),
                "{v}"
            );
        }
        let mut next = Api::Responses.body("And now?", 3);
        next["previous_response_id"] = json!(id);
        let a = openai::send(&c.client, gw, Api::Responses, &next, Some(key)).await;
        assert_eq!(a.status, 404, "{}", a.body);
    }
    let own = stored_as(reqwest::Method::GET, id.clone(), SECOND_KEY)
        .await
        .unwrap();
    assert_eq!(own.status(), 200, "the owner still reads it");
    let own: serde_json::Value = own.json().await.unwrap();
    assert_eq!(own["id"], id.as_str());
    let mut next = Api::Responses.body("And now?", 3);
    next["previous_response_id"] = json!(id);
    openai::send(&c.client, gw, Api::Responses, &next, Some(SECOND_KEY))
        .await
        .ok();
    served += 1.0;
    let gone = stored_as(reqwest::Method::DELETE, id.clone(), SECOND_KEY)
        .await
        .unwrap();
    assert_eq!(gone.status(), 200, "the owner deletes it");

    let g = c.gateway_metrics().await;
    assert_eq!(g.sum("pd_gateway_unauthorized_total", &[]), refused);
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[("outcome", "ok")]),
        served,
        "{}",
        g.show("pd_gateway_requests_total")
    );
    // No refused request reached a node: P saw exactly the served prompts.
    assert_eq!(
        c.sum_over(Role::Prefill, "pd_node_prompts_total", &[])
            .await,
        served
    );
}
