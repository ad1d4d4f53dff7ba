//! Reading structured values from a fuzzer's bytes: every read succeeds (an exhausted input
//! reads zeros), so any byte string is a valid input.

/// A cursor over the fuzzer's bytes.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// Reads from `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    /// Whether every byte was read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The next byte (0 when none is left).
    pub fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((b, rest)) => {
                self.data = rest;
                *b
            }
            None => 0,
        }
    }

    /// A flag.
    pub fn bool(&mut self) -> bool {
        self.byte() & 1 == 1
    }

    /// Little-endian `u16`.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    /// Little-endian `u32`.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    /// Little-endian `u64`.
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A number in `0..n` (`n > 0`), small numbers likelier.
    pub fn below(&mut self, n: usize) -> usize {
        let v = if self.bool() {
            usize::from(self.byte())
        } else {
            self.u32() as usize
        };
        v % n.max(1)
    }

    /// Up to `max` bytes, their count read first.
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let n = self.below(max + 1).min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }

    /// Up to `max` bytes as text (invalid UTF-8 replaced).
    pub fn string(&mut self, max: usize) -> String {
        String::from_utf8_lossy(self.bytes(max)).into_owned()
    }

    /// One of `choices`.
    pub fn pick<T: Clone>(&mut self, choices: &[T]) -> T {
        choices[self.below(choices.len())].clone()
    }

    /// The bytes not read yet (all consumed).
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }

    /// Splits off the part before the first `sep` (all when there is none); the rest stays.
    pub fn until(&mut self, sep: &[u8]) -> &'a [u8] {
        match self.data.windows(sep.len()).position(|w| w == sep) {
            Some(i) => {
                let (head, rest) = self.data.split_at(i);
                self.data = &rest[sep.len()..];
                head
            }
            None => self.rest(),
        }
    }
}
