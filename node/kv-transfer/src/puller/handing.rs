//! Handing a pull's blocks to a [`Landing`] as they land: the caller's task hands each part on
//! as the puller thread says it is in, and settles the landing on every way out, so no upload
//! is under way once the pull returned.

use pd_kv_pool::BlockId;
use pd_ucx::MemoryRegion;

use crate::landing::Landing;
use crate::pull::PullError;

/// The blocks of one pull handed to a [`Landing`] as they come in, in order, on the pull's task
/// (a part at a time, yielding between parts); the first failure stops the handing and is
/// returned by [`Handing::finish`], which settles once it began.
pub(super) struct Handing<'a> {
    landing: &'a dyn Landing,
    region: &'a MemoryRegion,
    local: &'a [BlockId],
    block_bytes: usize,
    per_part: usize,
    begun: bool,
    pub(super) handed: usize,
    failed: Option<PullError>,
}

impl<'a> Handing<'a> {
    pub(super) fn new(
        landing: &'a dyn Landing,
        region: &'a MemoryRegion,
        local: &'a [BlockId],
        block_bytes: usize,
        per_part: usize,
    ) -> Self {
        Self {
            landing,
            region,
            local,
            block_bytes,
            per_part,
            begun: false,
            handed: 0,
            failed: None,
        }
    }

    /// The first `upto` local blocks are in: hand on those not handed yet.
    pub(super) async fn upto(&mut self, upto: usize) {
        let per_part = self.per_part;
        let upto = upto.min(self.local.len());
        while self.failed.is_none() && self.handed < upto {
            if !self.begun {
                self.begun = true;
                if let Err(e) = self.landing.begin() {
                    self.failed = Some(PullError::Landing(e));
                    return;
                }
            }
            let end = upto.min(self.handed + per_part);
            // SAFETY: the puller said these blocks are in (or replied): nothing writes them any
            // more, and they stay this pull's until it returns, after `finish`.
            let r = unsafe {
                crate::landing::land(
                    self.landing,
                    self.region,
                    &self.local[self.handed..end],
                    self.block_bytes,
                )
            };
            match r {
                Ok(()) => self.handed = end,
                Err(e) => self.failed = Some(e),
            }
            if self.handed < upto {
                tokio::task::yield_now().await;
            }
        }
    }

    /// Settles what was handed on; the first failure, if any.
    pub(super) fn finish(mut self) -> Result<(), PullError> {
        let settled = if self.begun {
            self.begun = false;
            self.landing.settle().map_err(PullError::Landing)
        } else {
            Ok(())
        };
        match self.failed.take() {
            Some(e) => Err(e),
            None => settled,
        }
    }
}

impl Drop for Handing<'_> {
    /// A pull dropped midway (its task cancelled) still waits for the copies it started, so
    /// none runs once its blocks are freed. (A settle failure has nothing left to tell.)
    fn drop(&mut self) {
        if self.begun {
            let _ = self.landing.settle();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// Logs what it is asked to do.
    #[derive(Debug, Default)]
    struct Log(Mutex<Vec<String>>);

    impl Landing for Log {
        fn begin(&self) -> Result<(), crate::landing::LandingError> {
            self.0.lock().unwrap().push("begin".into());
            Ok(())
        }

        unsafe fn landed(
            &self,
            first: BlockId,
            bytes: &[u8],
        ) -> Result<(), crate::landing::LandingError> {
            // (Blocks of 64 bytes in the test below.)
            for i in 0..bytes.len() / 64 {
                self.0
                    .lock()
                    .unwrap()
                    .push(format!("landed {}", first.0 + i as u32));
            }
            Ok(())
        }

        fn settle(&self) -> Result<(), crate::landing::LandingError> {
            self.0.lock().unwrap().push("settle".into());
            Ok(())
        }
    }

    /// Handing hands blocks on in parts, each once, up to what it is told is in; finishing
    /// settles once; a handing dropped midway (its pull's task cancelled) settles too, and one
    /// that never began does not.
    #[tokio::test(flavor = "current_thread")]
    async fn handing_settles_once_whether_finished_or_dropped() {
        let ctx = pd_ucx::Context::new().unwrap();
        let region = MemoryRegion::allocate(&ctx, 8 * 64).unwrap();
        let local: Vec<BlockId> = (0..5).map(BlockId).collect();
        let log = Log::default();
        let mut h = Handing::new(&log, &region, &local, 64, 2);
        h.upto(3).await;
        h.upto(3).await;
        h.upto(5).await;
        h.finish().unwrap();
        let want: Vec<String> = ["begin", "landed 0", "landed 1", "landed 2", "landed 3"]
            .into_iter()
            .map(String::from)
            .chain(["landed 4".to_string(), "settle".to_string()])
            .collect();
        assert_eq!(*log.0.lock().unwrap(), want);

        let dropped = Log::default();
        let mut h = Handing::new(&dropped, &region, &local, 64, 2);
        h.upto(1).await;
        drop(h);
        assert_eq!(*dropped.0.lock().unwrap(), ["begin", "landed 0", "settle"]);

        let idle = Log::default();
        drop(Handing::new(&idle, &region, &local, 64, 2));
        assert!(idle.0.lock().unwrap().is_empty());
    }
}
