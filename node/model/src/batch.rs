//! One step's input, flattened across sequences (no padding).

use pd_kv_pool::BlockId;

use crate::error::ModelError;

/// The tokens of one sequence inside a [`BatchInput`].
#[derive(Debug, Clone)]
pub struct SeqView {
    /// Row of this sequence's first token in [`BatchInput::tokens`].
    pub query_start: usize,
    /// Tokens of this sequence computed in this step.
    pub query_len: usize,
    /// Tokens whose K/V will be in the pool after this step (cached + computed before + now).
    /// The new tokens sit at positions `context_len - query_len .. context_len`.
    pub context_len: usize,
    /// Pool blocks holding positions `0..context_len`, in order (`block_size` positions each).
    pub block_table: Vec<BlockId>,
}

/// Everything a forward step needs, for all scheduled sequences at once.
#[derive(Debug, Clone, Default)]
pub struct BatchInput {
    /// (num_tokens,) token ids, sequences concatenated.
    pub tokens: Vec<u32>,
    /// (num_tokens,) absolute position of each token in its sequence.
    pub positions: Vec<u32>,
    /// (num_tokens,) pool slot (`block * block_size + offset`) where each token's K/V goes.
    pub slots: Vec<usize>,
    /// One entry per sequence, in the order of `tokens`.
    pub seqs: Vec<SeqView>,
    /// Rows of `tokens` whose next-token logits are wanted, in output order.
    pub logits_rows: Vec<u32>,
}

impl BatchInput {
    /// Appends `tokens` of one sequence, starting at position `start`, whose blocks are
    /// `block_table`; asks for logits of its last token when `want_logits`.
    ///
    /// # Errors
    /// [`ModelError::InvalidBatch`] when `block_table` does not cover the new positions.
    pub fn push_seq(
        &mut self,
        tokens: &[u32],
        start: usize,
        block_table: &[BlockId],
        block_size: usize,
        want_logits: bool,
    ) -> Result<(), ModelError> {
        if block_size == 0 || block_table.len() * block_size < start + tokens.len() {
            return Err(ModelError::InvalidBatch(format!(
                "{} blocks of {block_size} cannot hold {} positions",
                block_table.len(),
                start + tokens.len()
            )));
        }
        let query_start = self.tokens.len();
        for (i, &t) in tokens.iter().enumerate() {
            let pos = start + i;
            self.tokens.push(t);
            self.positions.push(pos as u32);
            self.slots
                .push(block_table[pos / block_size].index() * block_size + pos % block_size);
        }
        self.seqs.push(SeqView {
            query_start,
            query_len: tokens.len(),
            context_len: start + tokens.len(),
            block_table: block_table.to_vec(),
        });
        if want_logits && !tokens.is_empty() {
            self.logits_rows
                .push((query_start + tokens.len() - 1) as u32);
        }
        Ok(())
    }

    /// [`BatchInput::push_seq`], also asking for the logits of the positions in `rows`
    /// (absolute positions within `start..start + tokens.len()`, ascending), ahead of the last
    /// token's when `want_logits`: prompt logprobs score every prompt token.
    ///
    /// # Errors
    /// [`ModelError::InvalidBatch`] when `block_table` does not cover the new positions or a
    /// row lies outside them.
    pub fn push_seq_with_rows(
        &mut self,
        tokens: &[u32],
        start: usize,
        block_table: &[BlockId],
        block_size: usize,
        rows: std::ops::Range<usize>,
        want_logits: bool,
    ) -> Result<(), ModelError> {
        if !rows.is_empty() && (rows.start < start || rows.end > start + tokens.len()) {
            return Err(ModelError::InvalidBatch(format!(
                "logits rows {rows:?} outside positions {start}..{}",
                start + tokens.len()
            )));
        }
        let query_start = self.tokens.len();
        self.push_seq(tokens, start, block_table, block_size, false)?;
        self.logits_rows
            .extend(rows.map(|p| (query_start + p - start) as u32));
        if want_logits && !tokens.is_empty() {
            self.logits_rows
                .push((query_start + tokens.len() - 1) as u32);
        }
        Ok(())
    }

    /// Number of tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
}
