//! One-sided get and put between two workers in one process (real UCX, loopback transports).

use crate::common::{Mapped, pattern, progress_until, wait_both};
use pd_ucx::{Context, Error, Worker};

/// Side A maps a patterned buffer; side B unpacks A's key and pulls non-contiguous ranges into
/// its own mapped buffer with posted gets and one flush.
#[test]
fn get_noncontiguous_ranges_then_flush() {
    let ctx_a = Context::new().unwrap();
    let ctx_b = Context::new().unwrap();
    let a = Worker::new(&ctx_a).unwrap();
    let b = Worker::new(&ctx_b).unwrap();

    let src = Mapped::new(&ctx_a, pattern(1 << 20, 7));
    let dst = Mapped::new(&ctx_b, vec![0u8; 1 << 20]);
    let ep = b.connect(&a.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&src.region.rkey_pack().unwrap()).unwrap();

    // (remote offset, local offset, len): scattered, out of order, varied sizes.
    let ranges = [
        (0usize, 4096usize, 100usize),
        (777, 0, 1),
        (65536, 200_000, 65536),
        (500_000, 8, 3000),
        (1_048_000, 900_000, 576),
    ];
    for &(roff, loff, len) in &ranges {
        ep.post_get(
            &dst.region,
            loff,
            len,
            src.region.base() + roff as u64,
            &rkey,
        )
        .unwrap();
    }
    wait_both(ep.flush().unwrap(), &a).unwrap();

    let got = dst.snapshot();
    let want = src.snapshot();
    for &(roff, loff, len) in &ranges {
        assert_eq!(
            &got[loff..loff + len],
            &want[roff..roff + len],
            "range {roff}+{len}"
        );
    }
    // Bytes outside the ranges stay zero.
    assert_eq!(got[4096 + 100], 0);
    assert_eq!(got[1], 0);
    drop(rkey);
    wait_both(ep.close().unwrap(), &a).unwrap();
}

/// A thousand 16 KiB gets (one per "KV block", reversed order) completed by a single flush.
#[test]
fn thousand_gets_one_flush() {
    const BLOCK: usize = 16 << 10;
    const N: usize = 1000;
    let ctx = Context::new().unwrap();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    let src = Mapped::new(&ctx, pattern(BLOCK * N, 3));
    let dst = Mapped::new(&ctx, vec![0u8; BLOCK * N]);
    let ep = b.connect(&a.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&src.region.rkey_pack().unwrap()).unwrap();
    for i in 0..N {
        let remote = src.region.base() + (i * BLOCK) as u64;
        ep.post_get(&dst.region, (N - 1 - i) * BLOCK, BLOCK, remote, &rkey)
            .unwrap();
    }
    wait_both(ep.flush().unwrap(), &a).unwrap();
    let (got, want) = (dst.snapshot(), src.snapshot());
    for i in 0..N {
        let j = N - 1 - i;
        assert_eq!(
            &got[j * BLOCK..(j + 1) * BLOCK],
            &want[i * BLOCK..(i + 1) * BLOCK],
            "block {i}"
        );
    }
    drop(rkey);
    wait_both(ep.close().unwrap(), &a).unwrap();
}

/// Individual requests: `get_nbx` into a region, polled while both workers progress.
#[test]
fn get_nbx_requests() {
    let ctx = Context::new().unwrap();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    let src = Mapped::new(&ctx, pattern(1 << 16, 11));
    let dst = Mapped::new(&ctx, vec![0u8; 1 << 16]);
    let ep = b.connect(&a.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&src.region.rkey_pack().unwrap()).unwrap();

    let mut reqs: Vec<_> = (0..8)
        .map(|i| {
            ep.get_nbx(
                &dst.region,
                i * 8192,
                8192,
                src.region.base() + (i * 8192) as u64,
                &rkey,
            )
            .unwrap()
        })
        .collect();
    progress_until(&a, &b, || reqs.iter_mut().all(|r| r.is_complete()));
    for r in &mut reqs {
        r.poll().unwrap().unwrap();
    }
    drop(reqs);
    assert_eq!(dst.snapshot(), src.snapshot());
    drop(rkey);
    wait_both(ep.close().unwrap(), &a).unwrap();
}

/// Memory that UCX allocated (shared-memory domain) is read one-sidedly: gets complete while
/// only the reader's worker progresses (UCX 1.13; registered memory would need the owner to
/// progress too).
#[test]
fn allocated_region_is_one_sided() {
    if std::env::var_os("UCX_TLS").is_some() {
        eprintln!("UCX_TLS is set: transports may emulate gets with active messages; skipping");
        return;
    }
    let ctx = Context::new().unwrap();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    let src = pd_ucx::MemoryRegion::allocate(&ctx, 1 << 20).unwrap();
    let want = pattern(src.len(), 9);
    // SAFETY: the region is 1 MiB of UCX-allocated memory and nothing else accesses it yet.
    unsafe { std::ptr::copy_nonoverlapping(want.as_ptr(), src.as_ptr(), want.len()) };
    let ep = b.connect(&a.address().unwrap()).unwrap();
    // Wire up once with both sides progressing.
    wait_both(ep.flush().unwrap(), &a).unwrap();
    let rkey = ep.unpack_rkey(&src.rkey_pack().unwrap()).unwrap();

    // From here on only `b` progresses (`get` waits on b alone).
    let mut small = [0u8; 33];
    ep.get(&mut small, src.base() + 1000, &rkey).unwrap();
    assert_eq!(&small[..], &want[1000..1033]);
    let mut big = vec![0u8; 600_000];
    ep.get(&mut big, src.base() + 4096, &rkey).unwrap();
    assert_eq!(&big[..], &want[4096..4096 + 600_000]);
    drop(rkey);
    wait_both(ep.close().unwrap(), &a).unwrap();
}

/// B writes into A's region with `put_nbx` (copied source) and `put_nbx_region` (zero-copy).
#[test]
fn put_then_flush() {
    let ctx_a = Context::new().unwrap();
    let ctx_b = Context::new().unwrap();
    let a = Worker::new(&ctx_a).unwrap();
    let b = Worker::new(&ctx_b).unwrap();
    let target = Mapped::new(&ctx_a, vec![0u8; 1 << 18]);
    let local = Mapped::new(&ctx_b, pattern(1 << 17, 5));
    let ep = b.connect(&a.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&target.region.rkey_pack().unwrap()).unwrap();

    let msg = b"hello from b".to_vec();
    let r1 = ep.put_nbx(&msg, target.region.base() + 10, &rkey).unwrap();
    let r2 = ep
        .put_nbx_region(
            &local.region,
            0,
            1 << 17,
            target.region.base() + (1 << 17),
            &rkey,
        )
        .unwrap();
    wait_both(r1, &a).unwrap();
    wait_both(r2, &a).unwrap();
    ep.put(&[0xEE; 5], target.region.base() + 100, &rkey)
        .unwrap();
    wait_both(ep.flush().unwrap(), &a).unwrap();

    let got = target.snapshot();
    assert_eq!(&got[10..10 + msg.len()], &msg[..]);
    assert_eq!(&got[100..105], &[0xEE; 5]);
    assert_eq!(&got[1 << 17..], &local.snapshot()[..]);
    assert_eq!(got[0], 0);
    drop(rkey);
    wait_both(ep.close().unwrap(), &a).unwrap();
}

/// Local bounds and key/endpoint pairing are checked before anything reaches UCX.
#[test]
fn misuse_is_rejected() {
    let ctx = Context::new().unwrap();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    let src = Mapped::new(&ctx, pattern(4096, 1));
    let dst = Mapped::new(&ctx, vec![0u8; 4096]);
    let addr = a.address().unwrap();
    let ep1 = b.connect(&addr).unwrap();
    let ep2 = b.connect(&addr).unwrap();
    // Wire both up so closing them does not wait on `a`.
    wait_both(ep1.flush().unwrap(), &a).unwrap();
    wait_both(ep2.flush().unwrap(), &a).unwrap();
    let packed = src.region.rkey_pack().unwrap();
    let rkey1 = ep1.unpack_rkey(&packed).unwrap();

    let err = ep1
        .post_get(&dst.region, 4000, 97, src.region.base(), &rkey1)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfBounds {
                offset: 4000,
                len: 97,
                region_len: 4096
            }
        ),
        "{err}"
    );
    let err = ep2
        .post_get(&dst.region, 0, 8, src.region.base(), &rkey1)
        .unwrap_err();
    assert!(matches!(err, Error::RkeyEndpointMismatch { .. }), "{err}");
    for bad in [&packed[..3], &packed[..9], &packed[..packed.len() - 1]] {
        let err = ep1.unpack_rkey(bad).map(|_| ()).unwrap_err();
        assert!(matches!(err, Error::MalformedRkey { .. }), "{err}");
    }
    // A valid get with the key (an endpoint that unpacked a key but never used it crashes UCX
    // 1.13's tcp transport on close; see quirks.rs).
    let mut ok = [0u8; 16];
    // SAFETY: `ok` outlives the request, which is waited on here.
    let req =
        unsafe { ep1.get_nbx_raw(ok.as_mut_ptr(), ok.len(), src.region.base(), &rkey1) }.unwrap();
    wait_both(req, &a).unwrap();
    assert_eq!(&ok[..], &src.snapshot()[..16]);
    drop(rkey1);
    // Closing needs `a` to progress too: close explicitly and drive both.
    wait_both(ep1.close().unwrap(), &a).unwrap();
    wait_both(ep2.close().unwrap(), &a).unwrap();
}

/// Issue 12 asks UCX to map a node's pool read-only for peers. This records what UCX 1.13 does
/// with that request under the default transports: the region is mapped, peers still read it,
/// and a peer's `put` into it is *not* refused — shared memory hands the peer a writable mapping.
/// If a UCX upgrade starts enforcing it, this test fails and the limitation written down in
/// `docs/kv-transfer.md` ("Who may read a pool") can be lifted.
#[test]
fn remote_read_only_is_asked_for_but_not_enforced_on_shm() {
    let ctx_a = Context::new().unwrap();
    let ctx_b = Context::new().unwrap();
    let a = Worker::new(&ctx_a).unwrap();
    let b = Worker::new(&ctx_b).unwrap();
    let len = 64 << 10;
    let region =
        pd_ucx::MemoryRegion::allocate_with(&ctx_a, len, pd_ucx::RemoteAccess::ReadOnly).unwrap();
    // SAFETY: the region is `len` bytes we own; nobody else uses it yet.
    unsafe { std::ptr::write_bytes(region.as_ptr(), 7, len) };
    let ep = b.connect(&a.address().unwrap()).unwrap();
    let rkey = ep.unpack_rkey(&region.rkey_pack().unwrap()).unwrap();
    // Reads work, one-sidedly still: only B's worker progresses during the get.
    let mut got = vec![0u8; 4096];
    ep.get(&mut got, region.base(), &rkey).unwrap();
    assert!(got.iter().all(|&x| x == 7));
    // A write: refused (error) or not (the bytes changed)?
    let put = ep.put(&[9u8; 4096], region.base(), &rkey);
    // SAFETY: as above; the put completed (or failed) before this read.
    let first = unsafe { *region.as_ptr() };
    eprintln!("put into a remote-read-only region: {put:?}, first byte now {first}");
    assert!(
        put.is_ok() && first == 9,
        "UCX now enforces remote read-only ({put:?}, byte {first}): update ARCHITECTURE.md"
    );
    drop(rkey);
    drop(ep);
}
