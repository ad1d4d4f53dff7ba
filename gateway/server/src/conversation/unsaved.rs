//! Turns whose write to the state store failed (the store was out), kept by id until they are
//! written: the turn itself stays in the [`super::ResponseStore`], which serves it here; once
//! the store answers again it is written, so another replica, or this one restarted, can
//! continue it. Bounded: past [`MAX_UNSAVED`] the oldest id is dropped (that turn stays in
//! memory only, as every turn does without a store).

use std::collections::VecDeque;
use std::sync::Mutex;

/// Ids kept at most.
pub const MAX_UNSAVED: usize = 65_536;

/// Ids of turns not yet written, oldest first.
#[derive(Debug, Default)]
pub struct Unsaved {
    ids: Mutex<VecDeque<String>>,
}

impl Unsaved {
    fn ids(&self) -> std::sync::MutexGuard<'_, VecDeque<String>> {
        self.ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remembers `id`'s write failed; false when the oldest had to be dropped for it.
    pub fn add(&self, id: &str) -> bool {
        let mut ids = self.ids();
        ids.push_back(id.to_owned());
        let full = ids.len() > MAX_UNSAVED;
        if full {
            ids.pop_front();
        }
        !full
    }

    /// Every id, oldest first; none kept.
    pub fn take(&self) -> Vec<String> {
        self.ids().drain(..).collect()
    }

    /// Puts `ids` (oldest first) back before those added since, within the bound.
    pub fn put_back(&self, ids: Vec<String>) {
        let mut kept = self.ids();
        for id in ids.into_iter().rev() {
            if kept.len() >= MAX_UNSAVED {
                break;
            }
            kept.push_front(id);
        }
    }

    /// How many wait.
    pub fn len(&self) -> usize {
        self.ids().len()
    }

    /// Whether none does.
    pub fn is_empty(&self) -> bool {
        self.ids().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_come_back_oldest_first_and_stay_bounded() {
        let u = Unsaved::default();
        assert!(u.add("a") && u.add("b"));
        let taken = u.take();
        assert_eq!(taken, ["a", "b"]);
        assert!(u.is_empty());
        u.add("c");
        u.put_back(taken);
        assert_eq!(u.take(), ["a", "b", "c"]);
        for i in 0..MAX_UNSAVED {
            assert!(u.add(&i.to_string()));
        }
        assert!(!u.add("last"), "the oldest dropped");
        assert_eq!(u.len(), MAX_UNSAVED);
        assert_eq!(u.take()[0], "1");
    }
}
