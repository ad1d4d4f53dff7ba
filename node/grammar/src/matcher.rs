//! [`TokenMatcher`]: one sequence's position in its constraint.

use std::fmt;
use std::sync::Arc;

use llguidance::Matcher;

use crate::GrammarError;

/// Where one sequence's output stands in its constraint: which tokens may come next.
///
/// Cloning is cheap and gives an independent matcher at the same position (the compiled
/// grammar and lexer caches are shared): what `n > 1` children start from.
#[derive(Clone)]
pub struct TokenMatcher {
    matcher: Matcher,
    /// The model's EOS ids, sorted; the first one the trie knows as its EOS is `eos[eos_at]`.
    eos: Arc<[u32]>,
    /// Token ids the trie knows; rows beyond it are never allowed.
    size: usize,
}

impl fmt::Debug for TokenMatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenMatcher")
            .field("stopped", &self.matcher.is_stopped())
            .field("error", &self.matcher.get_error())
            .finish_non_exhaustive()
    }
}

impl TokenMatcher {
    pub(crate) fn new(matcher: Matcher, eos: Arc<[u32]>, size: usize) -> Self {
        Self { matcher, eos, size }
    }

    /// Sets the logit of every token of `row` (vocab,) that would break the constraint here to
    /// −∞. Where the constraint may end, every EOS id stays allowed.
    ///
    /// # Errors
    /// [`GrammarError::Failed`] when the matcher fails (one of its limits reached) or allows no
    /// token at all.
    pub fn mask(&mut self, row: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self
            .matcher
            .compute_mask()
            .map_err(|e| GrammarError::Failed(e.to_string()))?;
        let eos_ok = self
            .eos
            .iter()
            .any(|&t| (t as usize) < self.size && allowed.is_allowed(t));
        // Where the constraint may end, every EOS id keeps its logit: saved before the words
        // below mask the ones the trie does not allow.
        let eos_logits: Vec<(usize, f32)> = if eos_ok {
            self.eos
                .iter()
                .filter_map(|&t| row.get(t as usize).map(|&l| (t as usize, l)))
                .collect()
        } else {
            Vec::new()
        };
        // One 32-token word of the mask at a time: most are all-disallowed or all-allowed.
        let words = allowed.as_slice();
        let known = self.size.min(row.len());
        let (inside, beyond) = row.split_at_mut(known);
        for (chunk, &bits) in inside.chunks_mut(32).zip(words) {
            match bits {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                bits => {
                    for (j, l) in chunk.iter_mut().enumerate() {
                        if bits & (1 << j) == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        // A mask shorter than the vocabulary (it never is) allows nothing past its end.
        if let Some(rest) = inside.get_mut(words.len() * 32..) {
            rest.fill(f32::NEG_INFINITY);
        }
        beyond.fill(f32::NEG_INFINITY);
        for (i, l) in eos_logits {
            row[i] = l;
        }
        if !eos_ok && allowed.is_zero() {
            return Err(GrammarError::Failed(
                "no token can continue the output".into(),
            ));
        }
        Ok(())
    }

    /// Moves past `token`, the one picked from a row [`TokenMatcher::mask`] masked (or the
    /// same pick made on another node). An EOS id ends the output where the constraint may
    /// end, and is not fed to the matcher.
    ///
    /// # Errors
    /// [`GrammarError::Failed`] when `token` breaks the constraint (an EOS included, where the
    /// output is not complete) or the matcher fails.
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.eos.binary_search(&token).is_ok() {
            let may_end = self
                .matcher
                .is_accepting()
                .map_err(|e| GrammarError::Failed(e.to_string()))?;
            if !may_end {
                return Err(GrammarError::Failed(format!(
                    "EOS (token {token}) where the output is not complete"
                )));
            }
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Failed(e.to_string()))
    }

    /// Whether the constraint is complete and nothing may follow: the output ends here.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped() && self.matcher.get_error().is_none()
    }
}
