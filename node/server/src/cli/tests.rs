//! The command line's tests.

use super::*;

#[test]
fn sizes() {
    assert_eq!(parse_size("1024"), Ok(1024));
    assert_eq!(parse_size("256MiB"), Ok(256 << 20));
    assert_eq!(parse_size("1GiB"), Ok(1 << 30));
    assert_eq!(parse_size("1gib"), Ok(1 << 30));
    assert_eq!(parse_size("512k"), Ok(512 << 10));
    assert_eq!(parse_size("500MB"), Ok(500_000_000));
    assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
    assert!(parse_size("12 parsecs").is_err());
    assert!(parse_size("").is_err());
    assert!(parse_size("-1").is_err());
    assert!(parse_size("99999999999TiB").is_err());
}

#[test]
fn serve_args_map_to_engine_config() {
    let cli = Cli::try_parse_from([
        "pd-node",
        "serve",
        "--model",
        "/m",
        "--port",
        "0",
        "--kv-cache-memory",
        "64MiB",
        "--num-gpu-blocks",
        "100",
        "--no-enable-prefix-caching",
    ])
    .unwrap();
    let Command::Serve(args) = cli.command else {
        panic!("expected serve")
    };
    let cfg = args.engine_config().unwrap();
    assert_eq!(cfg.kv_cache_memory, 64 << 20);
    assert_eq!(cfg.num_blocks, Some(100));
    assert!(!cfg.enable_prefix_caching);
    assert_eq!(cfg.block_size, 16);
    assert_eq!(args.listen_addr().unwrap().port(), 0);
}

#[test]
fn cluster_token_flag_wins_over_the_environment() {
    assert_eq!(flag_or_env(Some("f"), Some("e".into())), "f");
    assert_eq!(flag_or_env(None, Some("e".into())), "e");
    assert_eq!(flag_or_env(None, None), "");
    let cli = Cli::try_parse_from([
        "pd-node",
        "serve",
        "--model",
        "/m",
        "--cluster-token",
        "s3cret",
    ])
    .unwrap();
    let Command::Serve(args) = cli.command else {
        panic!("expected serve")
    };
    assert_eq!(args.cluster_token(), "s3cret");
}

/// `--api-key`: not empty; behind a gateway, only with the node's own cluster token, which
/// then opens `/v1/` too. (Flags only: `PD_CLUSTER_TOKEN` and `PD_NODE_API_KEY` are unset
/// where tests run.)
#[test]
fn an_api_key_behind_a_gateway_needs_the_nodes_own_cluster_token() {
    let serve = |extra: &[&str]| {
        let mut argv = vec!["pd-node", "serve", "--model", "/m"];
        argv.extend_from_slice(extra);
        let Command::Serve(args) = Cli::try_parse_from(argv).unwrap().command else {
            panic!("expected serve")
        };
        args.api_key().map_err(|e| e.to_string())
    };
    assert_eq!(serve(&[]), Ok((None, false)));
    assert_eq!(serve(&["--api-key", "k"]), Ok((Some("k".into()), false)));
    assert!(serve(&["--api-key", ""]).is_err());
    let err = serve(&["--api-key", "k", "--gateway", "127.0.0.1:1"]).unwrap_err();
    assert!(err.contains("--cluster-token"), "{err}");
    assert_eq!(
        serve(&[
            "--api-key",
            "k",
            "--gateway",
            "127.0.0.1:1",
            "--cluster-token",
            "t"
        ]),
        Ok((Some("k".into()), true))
    );
}

#[test]
#[cfg(not(feature = "cuda"))]
fn cuda_is_refused() {
    let cli =
        Cli::try_parse_from(["pd-node", "serve", "--model", "/m", "--device", "cuda"]).unwrap();
    let Command::Serve(args) = cli.command else {
        panic!("expected serve")
    };
    let err = args.engine_config().unwrap_err();
    assert!(err.to_string().contains("built without CUDA support"));
}

#[test]
fn gen_tiny_model_defaults() {
    let cli = Cli::try_parse_from([
        "pd-node",
        "gen-tiny-model",
        "--out",
        "/tmp/x",
        "--seed",
        "7",
    ])
    .unwrap();
    let Command::GenTinyModel(args) = cli.command else {
        panic!("expected gen-tiny-model")
    };
    let spec = args.spec();
    assert_eq!(
        (spec.seed, spec.layers, spec.hidden, spec.vocab, spec.shards),
        (7, 2, 64, 512, 1)
    );
    assert!(Cli::try_parse_from(["pd-node", "gen-tiny-model", "--out", "/tmp/x"]).is_err());
}

/// `--gateway`: a comma-separated list, the flag repeated, or both; names are looked up again
/// every `--gateway-resolve-ms` (5 s by default).
#[test]
fn several_gateways_by_list_and_by_repeating_the_flag() {
    let parse = |extra: &[&str]| {
        let mut argv = vec!["pd-node", "serve", "--model", "/m"];
        argv.extend_from_slice(extra);
        let Command::Serve(args) = Cli::try_parse_from(argv).unwrap().command else {
            panic!("expected serve")
        };
        (args.gateway, args.gateway_resolve_ms)
    };
    let (gateways, every) = parse(&["--gateway", "g1:50051,g2:50051", "--gateway", "10.0.0.3:1"]);
    assert_eq!(gateways, ["g1:50051", "g2:50051", "10.0.0.3:1"]);
    assert_eq!(every, 5000);
    let (one, every) = parse(&["--gateway", "g:1", "--gateway-resolve-ms", "250"]);
    assert_eq!((one, every), (vec!["g:1".to_string()], 250));
}
