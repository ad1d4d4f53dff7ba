//! Structured output end to end: token for token under a constraint, and a producer's first
//! token that breaks it.

use crate::common::*;
use pd_engine::{
    FinishReason, GenerateRequest, RemoteKv, RequestEvent, SamplingParams, StructuredOutput,
    first_token_key,
};
use pd_grammar::{OutputSpec, TokenMatcher, Vocabulary};

fn structured(spec: OutputSpec) -> Option<StructuredOutput> {
    Some(StructuredOutput {
        spec,
        field: "response_format",
    })
}

/// A schema whose every output ends within a few dozen bytes.
fn bounded_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
            "tag": {"enum": ["red", "green", "blue"]},
            "name": {"type": "string", "maxLength": 5}
        },
        "required": ["id", "ok", "tag", "name"],
        "additionalProperties": false
    })
}

fn check_bounded(text: &str) {
    let v: serde_json::Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("{text:?} is not an object"));
    assert_eq!(o.len(), 4, "{text}");
    assert!((0..=999).contains(&o["id"].as_i64().expect("id")), "{text}");
    assert!(o["ok"].is_boolean(), "{text}");
    assert!(
        ["red", "green", "blue"].contains(&o["tag"].as_str().expect("tag")),
        "{text}"
    );
    assert!(
        o["name"].as_str().expect("name").chars().count() <= 5,
        "{text}"
    );
}

/// Structured output on the engine: greedy under a JSON schema is the stock model's greedy
/// pick over logits masked by the same matcher, token for token, and ends (reason `stop`) where
/// the JSON value closes; sampled children each follow the schema on their own; preemption
/// (recompute) keeps every child's output and position in the schema; a bad schema is refused
/// naming the field. Structured output never lets the model write outside the constraint.
#[tokio::test]
async fn structured_outputs_follow_their_constraint_token_for_token() {
    let dir = model_dir("structured");
    let h = engine(&dir, |_| {});
    let p = prompt(12, 21);
    let spec = OutputSpec::JsonSchema(bounded_schema());
    let params = SamplingParams {
        structured: structured(spec.clone()),
        ..greedy(120)
    };
    let o = run(&h, p.clone(), params.clone()).await;
    assert_eq!(o.reasons, vec![Some(FinishReason::Stop)]);
    check_bounded(&o.texts[0]);

    // The reference: candle-transformers' Llama, its rows masked by a matcher of our own.
    let tokenizer = std::sync::Arc::new(pd_tokenize::Tokenizer::from_dir(&dir).unwrap());
    let eos = tokenizer.eos_token_ids().to_vec();
    let vocab = Vocabulary::new(tokenizer, &eos).unwrap();
    let mut m: TokenMatcher = vocab.compile(&spec).unwrap();
    let want = reference_greedy_masked(&dir, &p, 120, |row, out| {
        if let Some(&t) = out.last() {
            m.accept(t).unwrap();
            if m.is_complete() {
                return true;
            }
        }
        m.mask(row).unwrap();
        false
    });
    assert_eq!(
        o.tokens[0], want,
        "structured greedy differs from the masked reference"
    );
    // Unconstrained, the same prompt writes something else (the mask did the work).
    let plain = run(&h, p.clone(), greedy(want.len())).await;
    assert_ne!(plain.tokens[0], want);

    // n = 3 sampled children, each valid on its own, and not all the same.
    let sampled = SamplingParams {
        n: 3,
        temperature: 1.0,
        seed: Some(5),
        ..params.clone()
    };
    let o = run(&h, p.clone(), sampled.clone()).await;
    for t in &o.texts {
        check_bounded(t);
    }
    assert!(
        o.texts[0] != o.texts[1] || o.texts[1] != o.texts[2],
        "{:?}",
        o.texts
    );

    // Preempted and recomputed in a pool too small for all at once: every output the same as
    // with room, each child still valid.
    let tight = engine(&dir, |c| c.num_blocks = Some(28));
    let sampled = SamplingParams {
        max_tokens: Some(80),
        ..sampled
    };
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(20, 60 + i)).collect();
    let roomy =
        futures::future::join_all(prompts.iter().map(|p| run(&h, p.clone(), sampled.clone())))
            .await;
    let squeezed = futures::future::join_all(
        prompts
            .iter()
            .map(|p| run(&tight, p.clone(), sampled.clone())),
    )
    .await;
    assert!(
        tight.metrics().preemptions.get() > 0,
        "the test must preempt"
    );
    for (a, b) in roomy.iter().zip(&squeezed) {
        assert_eq!(a.tokens, b.tokens);
        for t in &b.texts {
            check_bounded(t);
        }
    }

    // Other kinds, greedy: a choice and a regex.
    let choice = vec!["alpha".to_string(), "beta".into(), "gamma delta".into()];
    let o = run(
        &h,
        p.clone(),
        SamplingParams {
            structured: structured(OutputSpec::Choice(choice.clone())),
            ..greedy(50)
        },
    )
    .await;
    assert!(choice.contains(&o.texts[0]), "{:?}", o.texts[0]);
    let o = run(
        &h,
        p.clone(),
        SamplingParams {
            structured: structured(OutputSpec::Regex("[A-F]{2}[0-9]{4}".into())),
            ..greedy(50)
        },
    )
    .await;
    let t = o.texts[0].as_bytes();
    assert!(
        t.len() == 6
            && t[..2].iter().all(|c| (b'A'..=b'F').contains(c))
            && t[2..].iter().all(u8::is_ascii_digit),
        "{:?}",
        o.texts[0]
    );

    // A bad constraint is refused before it runs, naming the field it came in.
    match h.submit(GenerateRequest {
        prompt_tokens: p.clone(),
        params: SamplingParams {
            structured: Some(StructuredOutput {
                spec: OutputSpec::Regex("(unclosed".into()),
                field: "structured_outputs",
            }),
            ..greedy(5)
        },
        kv: Default::default(),
        cache_salt: None,
        gateway: None,
    }) {
        Err(pd_engine::EngineError::Invalid(e)) => {
            assert_eq!(e.param, Some("structured_outputs"), "{e}");
        }
        other => panic!("expected invalid, got {other:?}"),
    }
    // A structured request is picked differently from a plain one: its own first-token key.
    assert_ne!(first_token_key(&params), first_token_key(&greedy(1)));
    assert_ne!(first_token_key(&params), 0);
    wait_all_free(&h).await;
    wait_all_free(&tight).await;
}

/// A first token from the producer that breaks the request's constraint (a faulty or forged
/// producer: the key matched, the token did not) fails the request with the reason and is never
/// emitted; the failure is counted and the blocks come back. A token within it is taken as
/// given, and the rest follows the constraint.
#[tokio::test]
async fn a_given_first_token_outside_the_constraint_fails_the_request_instead_of_emitting_it() {
    let dir = model_dir("structured-given");
    let h = engine(&dir, |_| {});
    let params = SamplingParams {
        structured: structured(OutputSpec::Regex("[0-9]{4}".into())),
        ..greedy(10)
    };
    let key = first_token_key(&params);
    for (i, given, ok) in [(0, b'x', false), (1, b'7', true)] {
        let p = prompt(10, 90 + i);
        let (mut s, r) = consume(&h, p.clone(), params.clone()).await;
        h.remote_kv_ready(
            r,
            RemoteKv::PulledWithFirstToken {
                tokens: p.len(),
                first_token: u32::from(given),
                key,
            },
        );
        let (mut tokens, mut failed, mut text) = (Vec::new(), None, String::new());
        while let Some(e) = s.recv().await {
            match e {
                RequestEvent::Token {
                    token_id, text: t, ..
                } => {
                    tokens.push(token_id);
                    text.push_str(&t);
                }
                RequestEvent::Finished { text: t, .. } => text.push_str(&t),
                RequestEvent::Failed { message } => failed = Some(message),
                _ => {}
            }
        }
        if ok {
            assert_eq!(failed, None);
            assert_eq!(tokens[0], u32::from(given));
            assert_eq!(text.len(), 4, "{text:?}");
            assert!(
                text.starts_with('7') && text.bytes().all(|b| b.is_ascii_digit()),
                "{text:?}"
            );
        } else {
            assert!(tokens.is_empty(), "{tokens:?}");
            let message = failed.expect("the request fails");
            assert!(message.contains("structured output"), "{message}");
        }
    }
    assert_eq!(h.metrics().structured_failures.get(), 1);
    assert_eq!(h.metrics().structured_requests.get(), 2);
    wait_all_free(&h).await;
}
