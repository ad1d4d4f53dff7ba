//! How a pulled lease is confirmed, decided without IO: whether to ask the owner as the request
//! arrives, whether to ask alongside the reads, whether the lease's record on the owner's lease
//! board confirms it alone, what the owner's answer settles, and whether what the lease holds
//! is the reader's prompt. [`crate::puller::lease`] runs the reads and the calls these decide.
//!
//! Three ways a lease is confirmed after the reads ([`Confirmed`]):
//! - `board` alone: the lease's record, read right after the reads, shows this lease and
//!   generation before its deadline, and the board beat recently (the owner was alive a moment
//!   before): the owner's answer is not waited for;
//! - `board` with the owner's answer: the owner's `ConfirmLease`, asked early (as the request
//!   arrived) or alongside the reads, says what the record says;
//! - `rpc`: anything else — the owner confirms after the reads, and says why not.

use std::time::Duration;

use pd_kv_pool::{BoardRecord, LeaseContents, LeaseId};

use crate::owner_clock::OwnerClock;
use crate::peer::TransferError;

/// How a pull's lease was confirmed (`pd_kv_lease_confirms_total{via}`, and
/// `pd_kv_lease_board_alone_confirms_total` for [`Confirmed::BoardAlone`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirmed {
    /// The board's record alone: it beat recently enough.
    BoardAlone,
    /// The board's record, saying what the owner's answer (early or alongside the reads) said.
    Board,
    /// The owner's `ConfirmLease` after the reads.
    Rpc,
}

impl Confirmed {
    /// The metric label (`via`).
    pub fn label(self) -> &'static str {
        match self {
            Confirmed::BoardAlone | Confirmed::Board => "board",
            Confirmed::Rpc => "rpc",
        }
    }
}

/// Whether to ask the owner for its confirmation as the request arrives (it then runs while the
/// request waits for blocks and reads them): the params name a board slot, unless the owner's
/// board, mapped here, beat (`beat_age` ago, by the owner's clock) within half of
/// `board_freshness` — then the record alone will very likely confirm the lease (half the
/// window leaves room for the wait and the reads), and the owner is asked after the reads only
/// if it does not.
pub fn ask_early(
    board_slot: Option<u32>,
    board_freshness: Option<Duration>,
    beat_age: Option<Duration>,
) -> bool {
    let board_will_do = board_freshness
        .zip(beat_age)
        .is_some_and(|(window, age)| age <= window / 2);
    board_slot.is_some() && !board_will_do
}

/// Whether the lease's record on the owner's board can show the lease live after the reads:
/// the params named its slot and the owner's board has slots (it is then read when mapped
/// here). Only then does an early confirmation count.
pub fn board_counts(board_slot: Option<u32>, board_slots: u32) -> bool {
    board_slot.is_some() && board_slots > 0
}

/// Whether to send the owner's confirmation alongside the reads: the board counts, none was
/// asked early, and the caller does not count on a fresh board (`board_freshness`).
pub fn alongside(board_counts: bool, asked_early: bool, board_freshness: Option<Duration>) -> bool {
    board_counts && !asked_early && board_freshness.is_none()
}

/// The lease's record, when it alone confirms `lease` (id, generation): this lease's record,
/// before its deadline, on a board that beat at most `board_freshness` before our clock's
/// `now_ns` — by the owner's `clock` as its handshake stated it.
pub fn fresh_record(
    record: Option<BoardRecord>,
    (lease, generation): (LeaseId, u64),
    board_freshness: Option<Duration>,
    clock: Option<OwnerClock>,
    now_ns: u64,
) -> Option<BoardRecord> {
    record.filter(|r| {
        r.generation == generation
            && r.lease_tag == lease.tag()
            && board_freshness.zip(clock).is_some_and(|(within, clock)| {
                clock.age(r.beat, now_ns).is_some_and(|age| age <= within)
                    && clock.before_at(r.deadline, now_ns)
            })
    })
}

/// The owner's answer to a confirmation asked before or alongside the reads.
#[derive(Debug)]
pub enum Answer {
    /// The lease is live; its blocks hold this.
    Said(LeaseContents),
    /// The owner refused (the lease ended) or the call failed.
    Refused(TransferError),
    /// No answer by the pull's deadline.
    Late,
}

impl<E> From<Result<Result<LeaseContents, TransferError>, E>> for Answer {
    /// A call under a timeout (`Err`: the timeout).
    fn from(r: Result<Result<LeaseContents, TransferError>, E>) -> Self {
        match r {
            Ok(Ok(c)) => Answer::Said(c),
            Ok(Err(e)) => Answer::Refused(e),
            Err(_) => Answer::Late,
        }
    }
}

/// What settles the confirmation once the reads are in.
#[derive(Debug)]
pub enum Verdict {
    /// The board's record confirms the lease, holding `contents`; `alone`: without the owner's
    /// answer.
    Board {
        /// What the lease holds.
        contents: LeaseContents,
        /// Confirmed on a fresh board, the owner not heard.
        alone: bool,
    },
    /// The owner said the lease is not live, or the call failed: the pull fails so.
    Refused(TransferError),
    /// The owner's answer did not come by the deadline.
    Late,
    /// Ask the owner now (after the reads).
    AskOwner,
}

/// What settles the confirmation: a `fresh` record ([`fresh_record`]) alone; else the owner's
/// `answer` (asked early or alongside the reads) when the lease's `record` of `generation`,
/// read after the reads, holds what the owner says (the record shows the lease had not ended by
/// then); a refusal or a late answer fails the pull; anything else asks the owner now.
pub fn verdict(
    fresh: Option<BoardRecord>,
    answer: Option<Answer>,
    record: Option<BoardRecord>,
    generation: u64,
) -> Verdict {
    let on_board = |theirs: &LeaseContents| {
        record.is_some_and(|r| r.generation == generation && r.contents == *theirs)
    };
    match (fresh, answer) {
        (Some(r), _) => Verdict::Board {
            contents: r.contents,
            alone: true,
        },
        (None, Some(Answer::Said(theirs))) if on_board(&theirs) => Verdict::Board {
            contents: theirs,
            alone: false,
        },
        (None, Some(Answer::Refused(e))) => Verdict::Refused(e),
        (None, Some(Answer::Late)) => Verdict::Late,
        (None, _) => Verdict::AskOwner,
    }
}

/// What a confirmed lease vouches for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attested {
    /// The owner attested what the blocks hold, and it is the reader's prompt.
    pub attested: bool,
    /// The owner's token after the blocks' tokens and its key, when both sides attest.
    pub next_token: Option<(u32, u64)>,
}

/// Checks what the owner says `lease` holds (`theirs`) against the reader's prompt (`expect`):
/// an owner that attests its lease must hold exactly the reader's prompt, otherwise the params
/// were forged or mixed up and the blocks are another prompt's KV. KV nobody vouched for is
/// not attested (this request only, never a prefix cache).
///
/// # Errors
/// [`TransferError::PromptMismatch`].
pub fn attest(
    lease: LeaseId,
    theirs: LeaseContents,
    expect: LeaseContents,
) -> Result<Attested, TransferError> {
    if theirs.attested() && expect.attested() && !theirs.same_contents(&expect) {
        return Err(TransferError::PromptMismatch {
            lease: lease.to_string(),
            theirs,
            ours: expect,
        });
    }
    Ok(Attested {
        attested: theirs.attested(),
        // Only when the owner vouched for exactly the reader's tokens.
        next_token: theirs
            .next_token
            .filter(|_| theirs.attested() && expect.attested())
            .map(|t| (t, theirs.next_token_key)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn contents(tokens: &[u32]) -> LeaseContents {
        LeaseContents::of(&pd_kv_pool::BindingKey::from_cluster_token("t"), tokens)
            .in_blocks(&[pd_kv_pool::BlockId(3)])
    }

    fn record(lease: LeaseId, generation: u64, beat: u64, deadline: u64) -> BoardRecord {
        BoardRecord {
            generation,
            contents: contents(&[1, 2, 3]),
            lease_tag: lease.tag(),
            deadline,
            beat,
        }
    }

    #[test]
    fn the_owner_is_asked_early_unless_its_board_beat_within_half_the_window() {
        let slot = Some(0);
        assert!(ask_early(slot, None, Some(MS)), "no window: always ask");
        assert!(ask_early(slot, Some(10 * MS), None), "board not mapped");
        assert!(!ask_early(slot, Some(10 * MS), Some(5 * MS)));
        assert!(ask_early(slot, Some(10 * MS), Some(6 * MS)));
        assert!(
            !ask_early(None, None, None),
            "no board slot: nothing to overlap"
        );
    }

    #[test]
    fn a_confirmation_goes_alongside_the_reads_only_where_the_board_counts() {
        assert!(board_counts(Some(1), 8));
        assert!(!board_counts(Some(1), 0));
        assert!(!board_counts(None, 8));
        assert!(alongside(true, false, None));
        assert!(!alongside(true, true, None), "asked early already");
        assert!(!alongside(true, false, Some(MS)), "counts on a fresh board");
        assert!(!alongside(false, false, None));
    }

    /// The record alone confirms only this lease's record, before its deadline, on a board
    /// that beat within the window, by the owner's clock.
    #[test]
    fn a_fresh_record_is_this_leases_before_its_deadline_on_a_recent_beat() {
        let lease = LeaseId(0xabc);
        let clock = OwnerClock::local();
        let now = 1_000 * 1_000_000; // our clock: 1 s
        let r = record(lease, 2, now - 2_000_000, now + 1);
        let fresh = |r: BoardRecord, window: Option<Duration>, clock: Option<OwnerClock>| {
            fresh_record(Some(r), (lease, 2), window, clock, now)
        };
        assert_eq!(fresh(r, Some(5 * MS), Some(clock)), Some(r));
        assert_eq!(fresh(r, Some(MS), Some(clock)), None, "beat too old");
        assert_eq!(fresh(r, None, Some(clock)), None, "no window");
        assert_eq!(fresh(r, Some(5 * MS), None), None, "no clock stated");
        let past = record(lease, 2, now - 2_000_000, now);
        assert_eq!(
            fresh(past, Some(5 * MS), Some(clock)),
            None,
            "at its deadline"
        );
        let other = record(LeaseId(0xabd), 2, now - 2_000_000, now + 1);
        assert_eq!(
            fresh(other, Some(5 * MS), Some(clock)),
            None,
            "another lease"
        );
        let regranted = record(lease, 3, now - 2_000_000, now + 1);
        assert_eq!(fresh(regranted, Some(5 * MS), Some(clock)), None);
        assert_eq!(
            fresh_record(None, (lease, 2), Some(MS), Some(clock), now),
            None
        );
    }

    #[test]
    fn the_verdict_takes_the_board_then_the_owners_word_then_asks() {
        let lease = LeaseId(7);
        let r = record(lease, 2, 1, u64::MAX);
        let said = || Some(Answer::Said(contents(&[1, 2, 3])));
        assert!(matches!(
            verdict(Some(r), None, Some(r), 2),
            Verdict::Board { alone: true, .. }
        ));
        assert!(matches!(
            verdict(Some(r), Some(Answer::Late), Some(r), 2),
            Verdict::Board { alone: true, .. }
        ));
        assert!(matches!(
            verdict(None, said(), Some(r), 2),
            Verdict::Board { alone: false, .. }
        ));
        // The record says otherwise (another generation, other contents), or there is none:
        // the owner is asked again after the reads.
        assert!(matches!(
            verdict(None, said(), Some(r), 3),
            Verdict::AskOwner
        ));
        let other = Some(Answer::Said(contents(&[9])));
        assert!(matches!(
            verdict(None, other, Some(r), 2),
            Verdict::AskOwner
        ));
        assert!(matches!(verdict(None, said(), None, 2), Verdict::AskOwner));
        assert!(matches!(verdict(None, None, Some(r), 2), Verdict::AskOwner));
        let lost = TransferError::LeaseLost {
            lease: lease.to_string(),
            reason: "expired".into(),
        };
        assert!(matches!(
            verdict(None, Some(Answer::Refused(lost)), Some(r), 2),
            Verdict::Refused(TransferError::LeaseLost { .. })
        ));
        assert!(matches!(
            verdict(None, Some(Answer::Late), Some(r), 2),
            Verdict::Late
        ));
        let timed_out: Result<Result<LeaseContents, TransferError>, ()> = Err(());
        assert!(matches!(Answer::from(timed_out), Answer::Late));
    }

    #[test]
    fn attested_contents_must_be_the_readers_prompt() {
        let lease = LeaseId(1);
        let ours = contents(&[1, 2, 3]);
        let mut theirs = ours;
        theirs.next_token = Some(42);
        theirs.next_token_key = 5;
        assert_eq!(
            attest(lease, theirs, ours).unwrap(),
            Attested {
                attested: true,
                next_token: Some((42, 5))
            }
        );
        let e = attest(lease, contents(&[1, 2, 4]), ours).unwrap_err();
        assert_eq!(e.reason(), "prompt_mismatch");
        // The owner does not attest: usable for this request only, its token not taken.
        let unattested = LeaseContents {
            next_token: Some(42),
            ..LeaseContents::default()
        };
        assert_eq!(
            attest(lease, unattested, ours).unwrap(),
            Attested {
                attested: false,
                next_token: None
            }
        );
        // The reader does not attest (no prompt to check): the owner's token is not taken.
        let got = attest(lease, theirs, LeaseContents::default()).unwrap();
        assert_eq!(got.next_token, None);
        assert!(got.attested);
    }
}
