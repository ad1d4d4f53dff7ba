//! Helpers shared by the unit tests.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::Tokenizer;

/// A unique directory under the system temp dir, removed on drop.
#[derive(Debug)]
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("pd-tokenize-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A byte-level tokenizer with 300 ids, and the directory holding it.
pub(crate) fn byte_level_tokenizer() -> (TempDir, Tokenizer) {
    let dir = TempDir::new("byte-level");
    crate::write_byte_level_tokenizer(dir.path(), 300).expect("write tokenizer");
    let tok = Tokenizer::from_dir(dir.path()).expect("load tokenizer");
    (dir, tok)
}
