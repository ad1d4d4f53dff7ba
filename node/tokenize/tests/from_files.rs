//! `Tokenizer::from_files`: a tokenizer rebuilt elsewhere (the gateway) from the files a node's
//! tokenizer was built from is the same tokenizer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use pd_tokenize::prompt::{PromptKind, prompt_tokens};
use pd_tokenize::{ChatMessage, TokenizeError, Tokenizer, write_byte_level_tokenizer};
use serde_json::json;

/// A unique directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "pd-tokenize-files-{name}-{}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn write(&self, file: &str, contents: &str) {
        std::fs::write(self.0.join(file), contents).expect("write file");
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A byte-level model directory with every file `from_dir` reads, and a large `config.json`.
fn full_dir(name: &str) -> TempDir {
    let dir = TempDir::new(name);
    write_byte_level_tokenizer(dir.path(), 300).expect("write tokenizer");
    dir.write(
        "config.json",
        &json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "eos_token_id": 257,
                "text_config": {"eos_token_id": [256], "hidden_size": 64}})
        .to_string(),
    );
    dir.write(
        "chat_template.jinja",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    );
    dir
}

/// Every file of `dir`, by name.
fn read_all(dir: &Path) -> BTreeMap<String, String> {
    std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| {
            let e = e.expect("entry");
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read_to_string(e.path()).expect("read"),
            )
        })
        .collect()
}

#[test]
fn from_files_builds_what_from_dir_builds() {
    let dir = full_dir("same");
    let from_dir = Tokenizer::from_dir(dir.path()).expect("from_dir");
    let mut files = read_all(dir.path());
    files.insert("README.md".into(), "not a tokenizer file".into());
    let from_files = Tokenizer::from_files(&files).expect("from_files");

    assert_eq!(from_files.files(), from_dir.files());
    assert_eq!(from_files.fingerprint(), from_dir.fingerprint());
    assert_eq!(from_files.eos_token_ids(), from_dir.eos_token_ids());
    assert_eq!(from_files.vocab_size(), from_dir.vocab_size());
    assert_eq!(from_files.bos_token(), from_dir.bos_token());
    let names: Vec<&str> = from_dir.files().keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );

    for text in ["plain text", "<|im_start|>special<|im_end|>", "é ü 漢字"] {
        for special in [true, false] {
            assert_eq!(
                from_files.encode(text, special).unwrap(),
                from_dir.encode(text, special).unwrap()
            );
        }
    }
    let messages = vec![
        ChatMessage::new("system", "be brief"),
        ChatMessage::new("user", "hello"),
    ];
    assert_eq!(
        from_files.apply_chat_template(&messages, true).unwrap(),
        from_dir.apply_chat_template(&messages, true).unwrap()
    );
    assert_eq!(
        prompt_tokens(&from_files, PromptKind::Chat(messages.clone(), "messages")).unwrap(),
        prompt_tokens(&from_dir, PromptKind::Chat(messages, "messages")).unwrap()
    );

    // Rebuilt from its own files: the same again.
    let again = Tokenizer::from_files(from_files.files()).expect("round trip");
    assert_eq!(again.fingerprint(), from_dir.fingerprint());
    assert_eq!(again.eos_token_ids(), from_dir.eos_token_ids());
}

#[test]
fn config_json_is_reduced_to_its_eos_fields() {
    let dir = full_dir("reduced");
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    let config: serde_json::Value =
        serde_json::from_str(&tok.files()["config.json"]).expect("json");
    assert_eq!(
        config,
        json!({"eos_token_id": 257, "text_config": {"eos_token_id": [256]}})
    );
    assert!(tok.eos_token_ids().contains(&257));
    assert!(tok.eos_token_ids().contains(&256));

    // Fields the tokenizer does not read do not change the fingerprint; those it reads do.
    dir.write(
        "config.json",
        &json!({"hidden_size": 4096, "eos_token_id": 257, "text_config": {"eos_token_id": [256]}})
            .to_string(),
    );
    assert_eq!(
        Tokenizer::from_dir(dir.path()).unwrap().fingerprint(),
        tok.fingerprint()
    );
    dir.write("config.json", &json!({"eos_token_id": 258}).to_string());
    let other = Tokenizer::from_dir(dir.path()).unwrap();
    assert_ne!(other.fingerprint(), tok.fingerprint());
}

#[test]
fn the_fingerprint_covers_names_and_contents() {
    let dir = full_dir("fingerprint");
    let base = Tokenizer::from_dir(dir.path()).unwrap().fingerprint();
    let mut files = read_all(dir.path());
    assert_eq!(Tokenizer::from_files(&files).unwrap().fingerprint(), base);

    let template = files.get_mut("chat_template.jinja").unwrap();
    template.push(' ');
    assert_ne!(Tokenizer::from_files(&files).unwrap().fingerprint(), base);

    let mut files = read_all(dir.path());
    files.remove("chat_template.jinja");
    assert_ne!(Tokenizer::from_files(&files).unwrap().fingerprint(), base);
}

#[test]
fn missing_required_files_are_named() {
    let dir = full_dir("missing");
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        let mut files = read_all(dir.path());
        files.remove(name);
        let err = Tokenizer::from_files(&files).expect_err("missing");
        assert!(
            matches!(&err, TokenizeError::MissingFile { path } if path == Path::new(name)),
            "{err}"
        );
        assert_eq!(err.to_string(), format!("missing {name}"));
    }
    let mut files = read_all(dir.path());
    files.insert("config.json".into(), "{not json".into());
    let err = Tokenizer::from_files(&files).expect_err("bad json");
    assert_eq!(err.to_string(), "failed to parse config.json as JSON");
}

#[test]
fn no_template_from_files_reads_well() {
    let dir = full_dir("no-template");
    let mut files = read_all(dir.path());
    files.remove("chat_template.jinja");
    let mut config: serde_json::Value =
        serde_json::from_str(&files["tokenizer_config.json"]).unwrap();
    config.as_object_mut().unwrap().remove("chat_template");
    files.insert("tokenizer_config.json".into(), config.to_string());
    let tok = Tokenizer::from_files(&files).unwrap();
    let err = tok
        .apply_chat_template(&[ChatMessage::new("user", "x")], true)
        .unwrap_err();
    assert_eq!(err.to_string(), "the tokenizer has no chat template");
}
